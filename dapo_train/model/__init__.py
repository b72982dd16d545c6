"""The model: loading the policy, its tokenizer and the reference (full weights or LoRA), and scoring
completions with it (memory-bounded log-probs). Where a run saves it (checkpoint_<step>/) is run/'s.

loading.py     policy, tokenizer and reference from a Hub id, local folder or checkpoint, with clear errors
lora.py        adapters through peft; the base as the reference; adapter checkpoints
layout.py      a micro-batch in rows: one per completion, or packed rows sharing each group's prompt
scoring.py     forward -> per-token log-probs and entropy, chunked LM head on valid tokens only
random_state.py  the random streams a checkpoint holds, restored on another count of CUDA devices too
"""
