"""The peak memory of training a model under a config, estimated from the model's shape alone (no weights
are read): what preflight prints for the real model and what train.micro_batch_tokens=auto sizes its budget by
(update/budget.py), checked against measured peaks in tests/preflight/test_memory.py and docs/benchmarks.md.

Every term is bytes, counted from what the code allocates (P parameters, T trainable ones, h hidden
size, I intermediate size, L layers, V vocabulary, kv x d the key/value heads' width; b the bytes of
the rollout's or eval's element dtype: 2 under a bf16 copy, a bf16 base or autocast, else 4):

  weights       P x 4 (float32 master weights) or P x 2 (model.dtype bfloat16, the LoRA base)
  gradients     T x 4;  AdamW state  T x 8 (exp_avg and exp_avg_sq, float32)
  rollout copy  P x 2 when the rollout samples from a bfloat16 copy (rollout.dtype, auto on CUDA)
  vllm engine   rollout.engine=vllm, in place of the rollout's and eval's generation terms: on CUDA its share of
                the card (rollout.vllm_memory x 48 GB), or P x 2 and rollout.vllm_kv_cache_mib when that is set;
                on a CPU its P x 4 weights and its KV cache (generation_batch_size of the longest sequences). On
                CUDA it sleeps through the update (its KV cache freed, weights in host memory): generate and
                eval only; resident on a CPU
  reference     P x weight bytes when dapo.beta > 0 without LoRA (a frozen second copy)
  reward models each one's parameters x its dtype's bytes (its `dtype`, auto: bfloat16 on CUDA), resident
  KV cache      2 (keys, values) x L x kv x d x b x rows x cache length: one generate call's rows (the
                static-cache engine pads them to a power of two and the prompt to a multiple of 64 tokens)
  prefill       the no-grad forward over the prompts (every row for the static cache and generate, one per
                group for the decode loop): per token (3 I + 4 h) x b, a layer's MLP at its widest
                (act(gate), up and their product) beside the residual stream and the normed input; with
                LoRA adapters on the MLP, 2 I x a more (peft's scaled adapter output and the sum beside the
                base output; a = 4, the float32 adapters, or 2 under autocast)
  logits        rows x V x (b + 5 x 4) per decode step: the model's last-position logits and five float32
                (rows, V) tensors (the upcast, the temperature-scaled and truncated copies or the draw's
                noise, the log-softmax sampled from, the previous step's kept by the recorder)
  eval          the same three for the periodic greedy eval (eval.batch_size rows), which decodes through the
                rollout's weights: its copy's, or the float32 ones under autocast (rollout/engines.eval_decoding)
  autocast      P x 2 while bf16 autocast runs over float32 weights (the cached bfloat16 casts), in the
                backward and in any forward of the float32 weights under autocast (a rollout or eval without
                a copy: one autocast region per generate call); the LM head's weight among them, which the
                chunked head casts itself, once per call, and keeps from its forward to its backward (a tied
                embedding is never cast by autocast, so P x 2 holds it once)
  activations   what the forward saves for backward: with gradient checkpointing L x tokens x h x 4 (each
                layer's float32 input); without it, every layer: L x tokens x (38 h + 8 I) under bf16
                autocast, L x tokens x (48 h + 16 I) in float32 (the per-layer counts tally a Llama/Qwen
                decoder layer's saved tensors)
  recomputed    with gradient checkpointing, the layer being recomputed and its gradient: 2 x tokens x
  layer         (38 h + 8 I), or (48 h + 16 I) in float32
  LM head       the chunked head (LinearHeadLogprobs): 4 x train.logprob_chunk_mib of float32 logits
                (a chunk's logits, their exp, the gradient and its scaled copy) plus the completion
                positions' hidden states and their gradient (positions x h x 4 each)
  attention     packed shared-prefix rows (train.shared_prefix): the micro-batch's bool 4-D mask, tokens x
  mask          row width (layout.row_limit under a budget, else the widest group, at most 4,096), and
                the attention kernel's float copy of it (b bytes), saved for backward by every layer
                without gradient checkpointing, by the recomputed one with it
  head backward with a trained head (not LoRA): the float32 (V, h) weight-gradient accumulator and each
                chunk's (V, h) product in the compute dtype (plus its float32 copy under autocast):
                V x h x (8, or 10 under autocast); a tied embedding holds as much at the end of backward
  reward forward the largest reward model's no-grad forward over one scoring batch: batch_size texts x
                min(max_tokens, prompt + completion) tokens, per token (3 I + 4 h) x its bytes
  optimizer     AdamW's foreach step on CUDA allocates sqrt(exp_avg_sq) for every tensor at once: T x 4; the
  step          fused step of one process (update/optim.py) allocates nothing
  sharded       FSDP or ZeRO over N cards: weights, gradients, AdamW state and the step's temporaries / N; the
                rollout gathers the full weights (P x weight bytes), the update one layer at a time (/ L)

The peak is the largest of these moments, each the resident terms (weights, AdamW state, rollout copy,
reference, reward models) plus: generating (KV cache, then the larger of the prefill and the logits), the
periodic eval (the same for its batch, plus the autocast casts), reward scoring (the reward forward), the
backward of a micro-batch after the first (gradients, autocast casts, activations, the attention mask,
then the larger of the LM head with the head backward, which run first, and the recomputed layer, which
runs after them)
and the optimizer step (gradients and its temporaries). On a CPU the process's resident baseline (Python,
torch, the tokenizer) is added. Not counted: the CUDA context and allocator fragmentation (outside
torch.cuda.max_memory_allocated), the data set, other processes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dapo_train.config.schema import Config
from dapo_train.evaluation.generate import longest_sequence
from dapo_train.model.layout import SHARED_ROW_LIMIT, row_limit

GIB = 1024**3
BASELINE_CPU_BYTES = int(0.6 * GIB)  # peak RSS after importing the trainer and loading Qwen2.5's tokenizer (measured)
LOGITS_FLOAT32_COPIES = 5  # float32 (rows, V) tensors alive in a decode step (module docstring: logits)
HEAD_CHUNKS = 4  # chunk-sized float32 (c, V) tensors alive at once in the head's backward


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
    lora_mlp: bool = False  # LoRA adapters on the MLP's projections (their float32 outputs in a forward)

    @classmethod
    def from_config(cls, model_config, lora=None, classifier: bool = False) -> ModelShape:
        """Parameters counted exactly (the model is built on the meta device, no memory); with a LoRA
        config, the adapters' r x (in + out) per targeted linear layer are the trainable ones. classifier:
        a sequence classifier's (a reward model: a score head, no LM head)."""
        import torch
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

        kind = AutoModelForSequenceClassification if classifier else AutoModelForCausalLM
        with torch.device("meta"):
            model = kind.from_config(model_config)
        parameters = sum(p.numel() for p in model.parameters())
        adapted = lora is not None and lora.r > 0
        trainable = _lora_parameters(model, lora) if adapted else parameters
        hidden = model_config.hidden_size
        heads = model_config.num_attention_heads
        return cls(
            parameters=parameters, trainable=trainable, vocab=model_config.vocab_size, hidden=hidden,
            intermediate=model_config.intermediate_size, layers=model_config.num_hidden_layers,
            kv_heads=getattr(model_config, "num_key_value_heads", None) or heads,
            head_dim=getattr(model_config, "head_dim", None) or hidden // heads,
            lora_mlp=adapted and bool({"gate_proj", "up_proj"} & set(lora.target_modules)),
        )

    @property
    def head_trained(self) -> bool:
        """Whether the LM head gets a gradient: full fine-tuning, not LoRA."""
        return self.trainable == self.parameters

    def kv_bytes_per_token(self, element_bytes: int) -> int:
        """One position's keys and values in every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * element_bytes

    def forward_bytes_per_token(self, element_bytes: int, adapter_bytes: int = 4) -> int:
        """A no-grad forward's widest layer, per token (module docstring: prefill)."""
        adapters = 2 * self.intermediate * adapter_bytes if self.lora_mlp else 0
        return (3 * self.intermediate + 4 * self.hidden) * element_bytes + adapters


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
class Generation:
    """One generate call: its rows, the prefill's positions, each row's cache length, the element bytes (and
    the LoRA adapters' outputs': float32, bfloat16 under autocast)."""

    rows: int
    prefill_tokens: int
    cache_length: int
    element_bytes: int
    adapter_bytes: int = 4

    @classmethod
    def of(cls, sequences: int, group_size: int, prompt: int, completion: int, engine: str, element_bytes: int,
           limit: int, adapter_bytes: int = 4) -> Generation:
        """A call of `sequences` rows (prompts x group_size) on engine `static` (padded rows and prompt width,
        every row prefilled), `loop` (each prompt prefilled once, its cache repeated) or `generate`."""
        from dapo_train.rollout.hf_engines import BUCKET_WIDTH, bucket_size

        if engine == "static":
            rows, width = bucket_size(sequences, limit), -(-prompt // BUCKET_WIDTH) * BUCKET_WIDTH
            return cls(rows, rows * width, width + completion, element_bytes, adapter_bytes)
        prefilled = math.ceil(sequences / group_size) if engine == "loop" else sequences
        return cls(sequences, prefilled * prompt, prompt + completion, element_bytes, adapter_bytes)


@dataclass(frozen=True)
class RewardModelLoad:
    """A reward model as the estimate counts it: its shape, bytes per weight, one scoring batch's positions."""

    shape: ModelShape
    weight_bytes: int
    tokens: int


@dataclass(frozen=True)
class Setting:
    """How the run uses the device: what preflight resolves from the config for a CUDA card (or the CPU).

    tokens: positions of one micro-batch (train.micro_batch_tokens when set, else micro_batch_size rows),
    head_positions: the completion positions among them; rollout / eval: one generate call of each (eval
    None when off)."""

    cuda: bool
    weight_bytes: int
    autocast: bool
    checkpointing: bool
    rollout_copy: bool
    reference: bool
    head_positions: int
    tokens: int
    row_width: int  # packed shared-prefix rows' width (layout.row_limit), 0 for one row per completion
    chunk_mib: float
    rollout: Generation | None  # None: rollout.engine=vllm generates (vllm)
    eval: Generation | None = None
    reward_models: tuple[RewardModelLoad, ...] = ()
    shards: int = 1
    vllm: tuple[float, int, int] | None = None  # rollout.engine=vllm: (card share, KV bytes set, KV positions auto)
    card_bytes: int = 0  # the card's total memory, of which rollout.vllm_memory is a share (0: CARD_BYTES)
    fused_step: bool = False  # AdamW's fused step (one process on CUDA: update/optim.py), no temporaries

    @classmethod
    def from_config(cls, cfg: Config, cuda: bool = True, prompt_tokens: int | None = None, shards: int = 1,
                    reward_models: tuple[RewardModelLoad, ...] = (), card_bytes: int = 0,
                    processes: int = 1) -> Setting:
        """The config's settings as a run on a CUDA card (cuda) or the CPU resolves them. prompt_tokens:
        the longest prompt kept (default data.max_prompt_length); with train.shared_prefix each group's
        prompt is counted once per micro-batch; train.micro_batch_tokens, when set, is the micro-batch's
        positions (or one prompt + max_new_tokens sequence, if longer; at most what a mini-batch holds).
        shards: the cards FSDP or ZeRO shards the training state over (1 = none). reward_models:
        reward_model_loads(cfg, cuda, ...). card_bytes: the card's total memory (0: CARD_BYTES). processes: the
        run's (one on CUDA steps AdamW fused). A budget of `auto` counts as 0 here: resolve it first
        (update/budget.py)."""
        t, r, e = cfg.train, cfg.rollout, cfg.eval
        budget = t.micro_batch_tokens if isinstance(t.micro_batch_tokens, int) else 0
        prompt = prompt_tokens if prompt_tokens is not None else cfg.data.max_prompt_length
        micro = t.micro_batch_size
        shared = t.shared_prefix != "off"
        prompts_per_micro = math.ceil(micro / r.group_size) if shared else micro
        tokens = micro * r.max_new_tokens + prompts_per_micro * prompt
        head = micro * r.max_new_tokens  # completion positions the LM head scores
        row_width = min(SHARED_ROW_LIMIT, prompt + r.group_size * r.max_new_tokens, tokens) if shared else 0
        if budget > 0:  # the budget wins: its tokens, or one sequence over it alone
            tokens = min(max(budget, prompt + r.max_new_tokens), mini_batch_tokens(cfg, prompt, shards))
            head = tokens - prompt
            row_width = max(row_limit(budget), prompt + r.max_new_tokens) if shared else 0
        weight_bytes = 2 if cfg.model.dtype in ("bfloat16", "float16") else 4
        autocast = cuda and t.mixed_precision in ("auto", "bf16", "fp16")
        vllm = (r.vllm_memory, r.vllm_kv_cache_mib * 2**20, r.generation_batch_size * longest_sequence(cfg)) \
            if r.engine == "vllm" else None  # as the engine sizes its KV cache
        copy = weight_bytes == 4 and (r.dtype == "bfloat16" or (r.dtype == "auto" and cuda)) and not vllm
        compiled = r.compile == "on" or (r.compile == "auto" and cuda)
        engine = "generate" if r.engine == "hf-generate" else "static" if compiled else "loop"
        forward_bytes = 2 if weight_bytes == 2 or autocast else 4  # the training model's forward
        adapter_bytes = 2 if autocast else 4
        rollout = Generation.of(min(r.generation_batch_size, t.prompts_per_step * r.group_size), r.group_size,
                                prompt, r.max_new_tokens, engine, 2 if copy else forward_bytes, r.generation_batch_size,
                                adapter_bytes)
        evaluated = (e.every_steps > 0 or e.final_full) and not vllm
        evaluation = Generation.of(e.batch_size, 1, prompt, e.max_new_tokens or r.max_new_tokens, "loop",
                                   forward_bytes, e.batch_size, adapter_bytes) if evaluated else None
        return cls(
            cuda=cuda,
            weight_bytes=weight_bytes,
            autocast=autocast,
            checkpointing=cfg.model.gradient_checkpointing == "on" or (cfg.model.gradient_checkpointing == "auto"
                                                                      and cuda),
            rollout_copy=copy,
            reference=cfg.dapo.beta > 0 and cfg.model.lora.r == 0,
            head_positions=head, tokens=tokens, row_width=row_width,
            chunk_mib=t.logprob_chunk_mib, rollout=None if vllm else rollout, eval=evaluation,
            reward_models=reward_models, shards=shards, vllm=vllm, card_bytes=card_bytes,
            fused_step=cuda and max(processes, shards) == 1,
        )


@dataclass
class Estimate:
    """Bytes per term, and the moments' totals; `peak` is the largest."""

    terms: dict[str, int]
    moments: dict[str, int] = field(default_factory=dict)
    # the moments with the backward's two branches apart, each linear in the micro-batch's tokens (update/budget.py)
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def peak(self) -> int:
        return max(self.moments.values())

    @property
    def peak_moment(self) -> str:
        return max(self.moments, key=self.moments.get)


def _activations(shape: ModelShape, s: Setting) -> tuple[int, int]:
    """(what the forward saves, the recomputed layer with its gradient)."""
    per_token_layer = (38 * shape.hidden + 8 * shape.intermediate) if s.autocast else \
        (48 * shape.hidden + 16 * shape.intermediate)
    if s.checkpointing:
        return shape.layers * s.tokens * shape.hidden * 4, 2 * s.tokens * per_token_layer
    return shape.layers * s.tokens * per_token_layer, 0


def _generation(shape: ModelShape, g: Generation | None) -> dict[str, int]:
    """A generate call's KV cache, prefill and per-step logits (module docstring)."""
    if g is None:
        return {"kv cache": 0, "prefill": 0, "logits": 0}
    return {"kv cache": shape.kv_bytes_per_token(g.element_bytes) * g.rows * g.cache_length,
            "prefill": g.prefill_tokens * shape.forward_bytes_per_token(g.element_bytes, g.adapter_bytes),
            "logits": g.rows * shape.vocab * (g.element_bytes + LOGITS_FLOAT32_COPIES * 4)}


def _vllm_engine(shape: ModelShape, s: Setting) -> int:
    """rollout.engine=vllm's bytes (module docstring)."""
    if s.vllm is None:
        return 0
    share, kv_bytes, kv_positions = s.vllm
    if s.cuda:
        return shape.parameters * 2 + kv_bytes if kv_bytes else int(share * (s.card_bytes or CARD_BYTES))
    return shape.parameters * 4 + (kv_bytes or kv_positions * shape.kv_bytes_per_token(4))


def estimate(shape: ModelShape, s: Setting) -> Estimate:
    """The estimate's terms and moments for one model and setting (module docstring)."""
    p, t, n = shape.parameters, shape.trainable, s.shards
    rollout, evaluation = _generation(shape, s.rollout), _generation(shape, s.eval)
    saved, recomputed = _activations(shape, s)
    masks = 1 if s.checkpointing else shape.layers  # the attention kernel's float copies of the mask kept
    casts = (p * 2 if n == 1 else p * 2 // shape.layers) if s.autocast and s.weight_bytes == 4 else 0
    terms = {
        "weights": p * s.weight_bytes // n,
        "gradients": t * 4 // n,
        "adamw state": t * 8 // n,
        "gathered weights": p * s.weight_bytes if n > 1 else 0,
        "rollout copy": p * 2 if s.rollout_copy else 0,
        "vllm engine": _vllm_engine(shape, s),
        "reference": p * s.weight_bytes if s.reference else 0,
        "reward models": sum(m.shape.parameters * m.weight_bytes for m in s.reward_models),
        **rollout,
        "eval kv cache": evaluation["kv cache"],
        "eval prefill": evaluation["prefill"],
        "eval logits": evaluation["logits"],
        "autocast casts": casts,
        "activations": saved,
        "recomputed layer": recomputed,
        "lm head": int(HEAD_CHUNKS * s.chunk_mib * 2**20) + 2 * s.head_positions * shape.hidden * 4,
        "attention mask": s.tokens * s.row_width * (1 + (2 if s.autocast else 4) * masks),
        "head backward": shape.vocab * shape.hidden * (10 if s.autocast else 8) if shape.head_trained else 0,
        "reward forward": max((m.tokens * m.shape.forward_bytes_per_token(m.weight_bytes) for m in s.reward_models),
                              default=0),
        "optimizer step": t * 4 // n if s.cuda and not s.fused_step else 0,
        "process baseline": 0 if s.cuda else BASELINE_CPU_BYTES,
    }
    resident = sum(terms[name] for name in ("weights", "adamw state", "rollout copy", "reference", "reward models",
                                            "process baseline"))
    rollout_casts = 0 if s.rollout_copy or s.vllm else casts  # the float32 model's forward under autocast
    engine = terms["vllm engine"] if s.cuda else 0  # asleep through the update on CUDA; on a CPU always there
    resident += terms["vllm engine"] - engine
    backward = resident + terms["gradients"] + terms["gathered weights"] // max(1, shape.layers) + casts + saved + \
        terms["attention mask"]
    parts = {
        "generate": resident + terms["gathered weights"] + rollout_casts + rollout["kv cache"] +
        max(rollout["prefill"], rollout["logits"]) + engine,
        "eval": resident + terms["gathered weights"] + rollout_casts + evaluation["kv cache"] +
        max(evaluation["prefill"], evaluation["logits"]) + engine,
        "reward scoring": resident + terms["reward forward"],
        "backward": backward + terms["lm head"] + terms["head backward"],
        RECOMPUTING: backward + recomputed,
        "optimizer step": resident + terms["gradients"] + terms["optimizer step"],
    }
    moments = {name: value for name, value in parts.items() if name != RECOMPUTING}
    moments["backward"] = max(parts["backward"], parts[RECOMPUTING])
    return Estimate(terms, moments, parts)


RECOMPUTING = "backward, recomputing a layer"  # the backward's branch after the LM head (module docstring)


def reward_model_loads(cfg: Config, cuda: bool, sequence: int) -> tuple[RewardModelLoad, ...]:
    """The config's reward models as the estimate counts them: each one's config.json (read, no weights),
    its dtype on this device, and a scoring batch of batch_size texts of at most `sequence` tokens (the
    policy's prompt and completion; fewer when its max_tokens cuts them)."""
    from dapo_train.rewards.model import memory_footprint

    loads = []
    for spec in cfg.rewards:
        if spec.name == "reward_model":
            model_config, weight_bytes, rows, max_tokens = memory_footprint(spec.args, cuda)
            shape = ModelShape.from_config(model_config, classifier=True)
            loads.append(RewardModelLoad(shape, weight_bytes, rows * min(max_tokens, sequence)))
    return tuple(loads)


def describe(result: Estimate) -> list[tuple[str, str]]:
    """(term, GiB) rows for a table: the non-zero terms, then the peak and its moment."""
    rows = [(name, f"{value / GIB:.2f}") for name, value in result.terms.items() if value]
    rows.append((f"peak ({result.peak_moment})", f"{result.peak / GIB:.2f}"))
    return rows



def mini_batch_tokens(cfg: Config, prompt: int, shards: int = 1) -> int:
    """The most tokens one rank's share of a mini-batch can hold (every completion at max_new_tokens,
    each group's prompt once with train.shared_prefix): a micro-batch never holds more."""
    t, r = cfg.train, cfg.rollout
    groups = math.ceil(math.ceil(t.prompts_per_step / t.updates_per_step) / shards)
    prompts = 1 if t.shared_prefix != "off" else r.group_size
    return groups * (r.group_size * r.max_new_tokens + prompts * prompt)


CARD_BYTES = 48 * 10**9  # the card the shipped Qwen configs are sized for (48 GB), and vllm_memory's default card
