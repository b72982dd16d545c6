"""The model: loading the policy, its tokenizer and the reference (full weights or LoRA), scoring
completions with it (memory-bounded log-probs), and the checkpoint folder it is saved in.

loading.py     policy, tokenizer and reference from a Hub id, local folder or checkpoint, with clear errors
lora.py        adapters through peft; the base as the reference; adapter checkpoints
layout.py      a micro-batch in rows: one per completion, or packed rows sharing each group's prompt
scoring.py     forward -> per-token log-probs and entropy, chunked LM head on valid tokens only
checkpoint.py  checkpoint_<step>/ on disk: atomic save, discovery, pruning, the state files, the best one
random_state.py  the random streams a checkpoint holds, restored on another count of CUDA devices too
export.py      `dapo-train export`: a checkpoint as a folder other tools load
"""
