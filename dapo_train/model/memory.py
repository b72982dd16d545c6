"""The peak memory of training a model under a config, estimated from the model's shape alone (no weights
are read): what preflight prints for the real model, and what docs/benchmarks.md checks against
measured peaks.

Every term is bytes, counted from what the code allocates (P parameters, T trainable ones, h hidden
size, I intermediate size, L layers, V vocabulary; tokens = the positions of one micro-batch):

  weights      P x 4 (float32 master weights) or P x 2 (model.dtype bfloat16, the LoRA base)
  gradients    T x 4;  AdamW state  T x 8 (exp_avg and exp_avg_sq, float32)
  rollout copy P x 2 when the rollout samples from a bfloat16 copy (rollout.dtype, auto on CUDA)
  reference    P x weight bytes when dapo.beta > 0 without LoRA (a frozen second copy)
  KV cache     2 x L x kv_heads x head_dim x 2 bytes x rows x (prompt + completion budget); rows = one
               generate call's sequences (a static cache pads them to a power of two)
  autocast     P x 2 while bf16 autocast runs over float32 weights (the cached bfloat16 casts)
  activations  with gradient checkpointing: L x tokens x h x 4 (each layer's float32 input) plus one
               layer recomputed with its gradient, 2 x tokens x (38 h + 8 I); without it, every layer:
               L x tokens x (38 h + 8 I) under bf16 autocast, L x tokens x (48 h + 16 I) in float32
               (the per-layer counts tally a Llama/Qwen decoder layer's saved tensors)
  LM head      the chunked head: 3 x train.logprob_chunk_mib of float32 logits (forward chunk, softmax,
               gradient) plus the completion positions' hidden states; the pre-chunking head kept
               (N, T, V) bfloat16 logits, three copies at once in backward, and 1,024-row float32 chunks
  optimizer    AdamW's foreach step on CUDA allocates sqrt(exp_avg_sq) for every tensor at once: T x 4
  step
  sharded      FSDP or ZeRO over N cards: weights, gradients, AdamW state and the step's temporaries / N; the
               rollout gathers the full weights (P x weight bytes), the update one layer at a time (/ L)

The peak is the largest of three moments: generating (weights, AdamW state, rollout copy, KV cache),
the backward of a micro-batch after the first (everything above but the KV cache and the step) and
the optimizer step (weights, gradients, AdamW state and its temporaries, rollout copy). On a CPU the
process's resident baseline (Python, torch, the tokenizer) is added. Not counted: the CUDA context and
allocator fragmentation (outside torch.cuda.max_memory_allocated), the data set, other processes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dapo_train.config.schema import Config

GIB = 1024**3
BASELINE_CPU_BYTES = int(0.6 * GIB)  # peak RSS after importing the trainer and loading Qwen2.5's tokenizer (measured)


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a model: counted on the meta device from its transformers config."""

    parameters: int
    trainable: int
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, model_config, lora=None) -> ModelShape:
        """Parameters counted exactly (the model is built on the meta device, no memory); with a LoRA
        config, the adapters' r x (in + out) per targeted linear layer are the trainable ones."""
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(model_config)
        parameters = sum(p.numel() for p in model.parameters())
        trainable = parameters if lora is None or lora.r == 0 else _lora_parameters(model, lora)
        hidden = model_config.hidden_size
        heads = model_config.num_attention_heads
        return cls(
            parameters=parameters, trainable=trainable, vocab=model_config.vocab_size, hidden=hidden,
            intermediate=model_config.intermediate_size, layers=model_config.num_hidden_layers,
            kv_heads=getattr(model_config, "num_key_value_heads", None) or heads,
            head_dim=getattr(model_config, "head_dim", None) or hidden // heads,
        )


def _lora_parameters(model, lora) -> int:
    """r x (in + out) for every linear layer whose name ends with one of lora.target_modules."""
    import torch

    total = 0
    for name, module in model.named_modules():
        targeted = any(name == target or name.endswith(f".{target}") for target in lora.target_modules)
        if isinstance(module, torch.nn.Linear) and targeted:
            total += lora.r * (module.in_features + module.out_features)
    return total


@dataclass(frozen=True)
class Setting:
    """How the run uses the device: what preflight resolves from the config for a CUDA card (or the CPU).

    tokens: positions of one micro-batch; rows: sequences of one generate call; old_head: the LM head
    before chunking (the code the recorded H200 peaks were measured on)."""

    cuda: bool
    weight_bytes: int
    autocast: bool
    checkpointing: bool
    rollout_copy: bool
    reference: bool
    micro_rows: int
    completion: int
    tokens: int
    generate_rows: int
    sequence: int
    chunk_mib: float
    old_head: bool = False
    shards: int = 1

    @classmethod
    def from_config(cls, cfg: Config, cuda: bool = True, prompt_tokens: int | None = None, shards: int = 1
                    ) -> Setting:
        """The config's settings as a run on a CUDA card (cuda) or the CPU resolves them. prompt_tokens:
        the longest prompt kept (default data.max_prompt_length); with train.shared_prefix each group's
        prompt is counted once per micro-batch. shards: the cards FSDP or ZeRO shards the training state
        over (1 = none)."""
        t, r = cfg.train, cfg.rollout
        prompt = prompt_tokens if prompt_tokens is not None else cfg.data.max_prompt_length
        micro = t.micro_batch_size
        shared = t.shared_prefix != "off"
        prompts_per_micro = math.ceil(micro / r.group_size) if shared else micro
        rows = min(r.generation_batch_size, t.prompts_per_step * r.group_size)
        compiled = r.compile == "on" or (r.compile == "auto" and cuda)
        if compiled:
            rows = 1 << (rows - 1).bit_length()
        weight_bytes = 2 if cfg.model.dtype in ("bfloat16", "float16") else 4
        return cls(
            cuda=cuda,
            weight_bytes=weight_bytes,
            autocast=cuda and t.mixed_precision in ("auto", "bf16", "fp16"),
            checkpointing=cfg.model.gradient_checkpointing == "on" or (cfg.model.gradient_checkpointing == "auto"
                                                                      and cuda),
            rollout_copy=weight_bytes == 4 and (r.dtype == "bfloat16" or (r.dtype == "auto" and cuda)),
            reference=cfg.dapo.beta > 0 and cfg.model.lora.r == 0,
            micro_rows=micro, completion=r.max_new_tokens, tokens=micro * r.max_new_tokens + prompts_per_micro * prompt,
            generate_rows=rows, sequence=prompt + r.max_new_tokens, chunk_mib=t.logprob_chunk_mib, shards=shards,
        )


@dataclass
class Estimate:
    """Bytes per term, and the three moments' totals; `peak` is the largest."""

    terms: dict[str, int]
    moments: dict[str, int] = field(default_factory=dict)

    @property
    def peak(self) -> int:
        return max(self.moments.values())

    @property
    def peak_moment(self) -> str:
        return max(self.moments, key=self.moments.get)


def _activations(shape: ModelShape, s: Setting) -> int:
    per_token_layer = (38 * shape.hidden + 8 * shape.intermediate) if s.autocast else \
        (48 * shape.hidden + 16 * shape.intermediate)
    if s.checkpointing:
        return shape.layers * s.tokens * shape.hidden * 4 + 2 * s.tokens * per_token_layer
    return shape.layers * s.tokens * per_token_layer


def _lm_head(shape: ModelShape, s: Setting) -> int:
    positions = s.micro_rows * s.completion
    if s.old_head:
        return 3 * positions * shape.vocab * 2 + 2 * 1024 * shape.vocab * 4
    return int(3 * s.chunk_mib * 2**20) + positions * shape.hidden * 4


def estimate(shape: ModelShape, s: Setting) -> Estimate:
    """The estimate's terms and moments for one model and setting (module docstring)."""
    p, t, n = shape.parameters, shape.trainable, s.shards
    terms = {
        "weights": p * s.weight_bytes // n,
        "gradients": t * 4 // n,
        "adamw state": t * 8 // n,
        "gathered weights": p * s.weight_bytes if n > 1 else 0,
        "rollout copy": p * 2 if s.rollout_copy else 0,
        "reference": p * s.weight_bytes if s.reference else 0,
        "kv cache": 2 * shape.layers * shape.kv_heads * shape.head_dim * 2 * s.generate_rows * s.sequence,
        "autocast casts": (p * 2 if n == 1 else p * 2 // shape.layers) if s.autocast and s.weight_bytes == 4 else 0,
        "activations": _activations(shape, s),
        "lm head": _lm_head(shape, s),
        "optimizer step": t * 4 // n if s.cuda else 0,
        "process baseline": 0 if s.cuda else BASELINE_CPU_BYTES,
    }
    resident = terms["weights"] + terms["adamw state"] + terms["rollout copy"] + terms["reference"] + \
        terms["process baseline"]
    moments = {
        "generate": resident + terms["gathered weights"] + terms["kv cache"],
        "backward": resident + terms["gradients"] + terms["gathered weights"] // max(1, shape.layers) +
        terms["autocast casts"] + terms["activations"] + terms["lm head"],
        "optimizer step": resident + terms["gradients"] + terms["optimizer step"],
    }
    return Estimate(terms, moments)


def describe(result: Estimate) -> list[tuple[str, str]]:
    """(term, GiB) rows for a table: the non-zero terms, then the peak and its moment."""
    rows = [(name, f"{value / GIB:.2f}") for name, value in result.terms.items() if value]
    rows.append((f"peak ({result.peak_moment})", f"{result.peak / GIB:.2f}"))
    return rows
