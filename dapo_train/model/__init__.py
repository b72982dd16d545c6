"""The model: loading the policy, its tokenizer and the reference (full weights or LoRA), scoring
completions with it (memory-bounded log-probs), and the checkpoint folder it is saved in.

loading.py     policy, tokenizer and reference from a Hub id, local folder or checkpoint, with clear errors
lora.py        adapters through peft; the base as the reference; adapter checkpoints
scoring.py     forward -> per-token log-probs and entropy, chunked LM head, shared prompt prefix
checkpoint.py  checkpoint_<step>/ on disk: atomic save, discovery, pruning, the state files
export.py      `dapo-train export`: a checkpoint as a folder other tools load
"""
