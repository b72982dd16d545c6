"""The settings schema: one dataclass field per option with its help text, and the invariants
across fields. The defaults describe the embedded tiny CPU demo and are the single source of
truth; load.py reads YAML files and KEY=VALUE overrides into these classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dapo_train.config.validate import validate

# The trackers accelerate speaks to (accelerate.utils.LoggerType) that logging.trackers offers;
# dapo_train.metrics.TRACKERS says how each is checked and names its run.
TRACKER_NAMES = ("tensorboard", "wandb", "mlflow", "comet_ml", "aim", "clearml", "trackio")

BUILTIN_MODEL = "builtin:tiny"
BUILTIN_DATA = "builtin:tiny-zh-math"

DEFAULT_SYSTEM_PROMPT = (
    "你是一个擅长数学的助手。请先在 <think> 和 </think> 之间逐步推理，"
    "再在 <answer> 和 </answer> 之间只写出最终的数字答案。格式如下：\n"
    "<think>\n...\n</think>\n<answer>\n...\n</answer>"
)


def _opt(default: Any, help: str, choices: tuple | None = None, **kwargs: Any) -> Any:
    """A dataclass field carrying its help text (and allowed values) in metadata."""
    metadata = {"help": help, "choices": choices}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata, **kwargs)
    return field(default=default, metadata=metadata, **kwargs)


# Qwen2 / Llama / Mistral names for every projection of a decoder layer: attention and MLP.
DEFAULT_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class LoraConfig:
    r: int = _opt(
        0, "LoRA rank (0 = off: train every weight). With r > 0 only the adapters train (needs the peft package: "
        "pip install 'dapo-train[lora]'), checkpoints hold the adapter, and the dapo.beta reference is the base "
        "model with adapters disabled (no second copy).",
    )
    alpha: float = _opt(16.0, "LoRA alpha: the adapter's update is scaled by alpha / r.")
    dropout: float = _opt(0.0, "Dropout on the adapter's input while training (0 = off; > 0 makes the ratio noisy).")
    target_modules: list[str] = _opt(
        DEFAULT_LORA_TARGETS,
        "Layers that get adapters, by name or dotted name suffix (self_attn.q_proj); each must match a linear or "
        "embedding layer of the model.",
    )


@dataclass
class ModelConfig:
    name_or_path: str = _opt(
        BUILTIN_MODEL,
        "HF model id, local folder, or builtin:tiny / builtin:tiny-long / builtin:tiny-tools / builtin:tiny-strong "
        "(shipped).",
    )
    dtype: str = _opt(
        "auto",
        "Weights dtype. auto = float32 master weights everywhere; on CUDA bf16 autocast "
        "(train.mixed_precision) does the fast part.",
        ("auto", "float32", "bfloat16", "float16"),
    )
    trust_remote_code: bool = _opt(False, "Allow model code from the hub. Off for safety.")
    attn_implementation: str | None = _opt(
        None,
        "Attention kernel passed to from_pretrained; null = transformers' default (sdpa). flash_attention_2 and "
        "flash_attention_3 need CUDA and their package (flash-attn, flash-attn-3).",
        (None, "sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"),
    )
    gradient_checkpointing: str = _opt(
        "auto", "Recompute activations in backward to save memory. auto = on for CUDA.", ("auto", "on", "off")
    )
    keep_dropout: bool = _opt(
        False,
        "Keep the checkpoint's dropout (attention_dropout, ...) in the training forwards. Off by default: dropout "
        "makes the old-log-prob and update forwards differ at the same weights (a noisy ratio even at lr 0), so the "
        "loaded config's dropout fields are set to 0 (and saved so in checkpoints).",
    )
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class DataConfig:
    path: str = _opt(
        BUILTIN_DATA,
        "HF dataset id, local folder (save_to_disk or parquet/json/jsonl per split), a single "
        "jsonl/parquet/csv file, or builtin:tiny-zh-math / builtin:tiny-zh-math-long (shipped generated tasks).",
    )
    prompt_field: str = _opt("question_zh-cn", "Column holding the question.")
    answer_field: str = _opt(
        "answer_only", "Column holding the gold answer (numeric: a number, or a solution ending '#### N')."
    )
    correctness: str = _opt(
        "numeric",
        "How a completion is graded against the gold answer (the accuracy rewards, dynamic sampling, eval): "
        "numeric (the <answer> block's number equals the gold's), or a plugin 'pkg.module:function' taking "
        "(completion, gold text) and returning a bool.",
    )
    train_split: str = _opt("train", "Split used for training rollouts.")
    eval_split: str = _opt("test", "Split used for the periodic evaluation.")
    system_prompt: str = _opt(DEFAULT_SYSTEM_PROMPT, "System message placed before each question.")
    max_prompt_length: int = _opt(256, "Prompts longer than this (tokens, template included) are dropped and counted.")


@dataclass
class RolloutConfig:
    group_size: int = _opt(8, "G: completions sampled per prompt.")
    max_new_tokens: int = _opt(96, "L_max: completion budget; no EOS within it = truncated.")
    temperature: float = _opt(1.0, "Sampling temperature; log-probs use logits / temperature too.")
    top_p: float = _opt(
        1.0, "Nucleus sampling threshold (1.0 = off). Truncation is not corrected: the objective stays the untruncated "
        "policy's, the cut mass is logged (rollout_kl_truncation).",
    )
    top_k: int = _opt(0, "Top-k sampling (0, or at least the vocabulary, = off); see rollout.top_p.")
    generation_batch_size: int = _opt(
        256, "Most sequences per generate call (bounds rollout memory); prompts x G are batched up to it."
    )
    engine: str = _opt(
        "hf",
        "Rollout engine: hf (a decode loop over the model: each prompt prefilled once per group, finished rows "
        "dropped), hf-generate (plain model.generate, the reference), vllm (an in-process vLLM engine sharing the "
        "device, its weights synced after every step; pip install 'dapo-train[vllm]', docs/vllm.md), or "
        "'pkg.module:Factory' (docs/benchmarks.md: Another rollout engine).",
    )
    dtype: str = _opt(
        "auto",
        "Weights the rollout samples from: auto = a bfloat16 copy on CUDA (refreshed after each step's updates), "
        "the float32 training weights on CPU.", ("auto", "float32", "bfloat16"),
    )
    compile: str = _opt(
        "auto",
        "hf engine: decode with a static KV cache and a compiled step (CUDA graphs), batch rows bucketed to powers "
        "of two. auto = on for CUDA, off with rollout.tools (only the decode loop runs tools). vllm: auto = "
        "torch.compile and CUDA graphs on CUDA, eager on a CPU. On CUDA without a C compiler (Triton's), or a "
        "compile that fails, decoding is eager (said once).", ("auto", "on", "off"),
    )
    vllm_memory: float = _opt(
        0.3, "rollout.engine=vllm on CUDA: the share of the card's memory vLLM may take beside training (its copy of "
        "the weights, activations and KV cache; gpu_memory_utilization); it is released while the update runs "
        "(sleep mode). On a CPU see rollout.vllm_kv_cache_mib.",
    )
    vllm_kv_cache_mib: int = _opt(
        0, "rollout.engine=vllm: vLLM's KV cache in MiB. 0 = auto: on CUDA what rollout.vllm_memory leaves after its "
        "weights; on a CPU room for rollout.generation_batch_size sequences of the longest prompt and completion "
        "(vLLM's own CPU default takes most of the machine's memory and a minute to allocate).",
    )
    tools: list[str] = _opt(
        [],
        "Tools the policy may call while it samples, by name (calculator) or 'pkg.module:function' (docs/tools.md). "
        "The prompts list them through the chat template (tools=); a completion that ends a turn with a call gets "
        "the tool's reply as a tool turn and goes on. Tool turns are context: out of the loss. [] = none.",
    )
    max_tool_calls: int = _opt(
        4, "Most tool calls per completion (rollout.tools); a turn that would exceed it ends the completion there, "
        "its calls not run: an end of its own (over_calls), not truncation, so overlong filtering keeps it in the "
        "loss.",
    )


@dataclass
class DapoConfig:
    policy_loss: str = _opt(
        "clip",
        "Policy objective: clip (Eq. 10, the decoupled clip, dual-clipped with clip_ratio_c; bounds eps_low / "
        "eps_high), gspo (GSPO: one clipped ratio per completion, the geometric mean of its token ratios; bounds "
        "gspo_eps_low / gspo_eps_high), cispo (CISPO: REINFORCE weighted by the clipped, detached token ratio; "
        "bounds cispo_eps_low / cispo_eps_high), another name registered with "
        "dapo_train.algo.register_policy_loss, or 'pkg.module:function' (docs/training.md: Adding a loss).",
    )
    eps_low: float = _opt(0.2, "Lower clip range (Eq. 10, policy_loss clip): ratio floored at 1 - eps_low for A < 0.")
    eps_high: float = _opt(
        0.28, "Upper clip range (Eq. 10, clip-higher, policy_loss clip): ratio capped at 1 + eps_high for A > 0."
    )
    clip_ratio_c: float | None = _opt(
        None, "Dual-clip bound (> 1) on the loss of A < 0 tokens (policy_loss clip); null = off."
    )
    gspo_eps_low: float = _opt(
        3e-4, "GSPO's lower clip (policy_loss gspo): the sequence ratio floored at 1 - gspo_eps_low for A < 0 "
        "(the paper: 3e-4).",
    )
    gspo_eps_high: float = _opt(
        4e-4, "GSPO's upper clip (policy_loss gspo): the sequence ratio capped at 1 + gspo_eps_high for A > 0 "
        "(the paper: 4e-4).",
    )
    cispo_eps_low: float = _opt(
        1.0, "CISPO's lower bound (policy_loss cispo): the importance weight floored at 1 - cispo_eps_low; 1 = no "
        "floor (the paper).",
    )
    cispo_eps_high: float = _opt(
        4.0, "CISPO's upper bound (policy_loss cispo): the importance weight capped at 1 + cispo_eps_high (4: a cap "
        "of 5, TRL's recommended epsilon_high for CISPO).",
    )
    beta: float = _opt(
        0.0, "KL coefficient to a frozen reference: the k3 estimate at the sampled tokens, clamped as verl's (log-ratio"
        " +-20, each token's term at most 10), not weighted by the ratio. 0 = no reference model (DAPO).",
    )
    loss_reduction: str = _opt(
        "token", "token: Eq. 12 (sum over the step's tokens / their count); sample: GRPO mean of means; constant: "
        "Dr. GRPO, the token sum / (sequences x rollout.max_new_tokens).",
        ("token", "sample", "constant"),
    )
    advantage_std: str = _opt(
        "population", "Std in the group advantage (Eq. 9): population, sample (Bessel) or none.",
        ("population", "sample", "none"),
    )
    dynamic_sampling: bool = _opt(True, "Eq. 11: keep only groups whose filter metric varies.")
    filter_metric: str = _opt(
        "correct",
        "What must vary within a kept group: correct (data.correctness bits), total (the summed reward) "
        "or reward:<name> (one configured reward).",
    )
    max_gen_rounds: int = _opt(
        4, "Most generation rounds per step while filling the batch; then train on what was kept."
    )
    max_round_prompts: int = _opt(
        0,
        "0: every generation round draws train.prompts_per_step prompts. N > 0: a round draws the groups still "
        "missing divided by the running keep rate (groups kept per prompt drawn, over about the last 10 rounds), "
        "at least the missing count and at most N (>= train.prompts_per_step), so a step usually fills in one "
        "round; the surplus carries over.",
    )
    skip_history: bool = _opt(
        False,
        "GRESO: skip a drawn prompt whose last z groups in a row were all alike (dropped or screened out) with "
        "probability 1 - max(dapo.skip_floor, 0.5^z); the history is in the checkpoint and the same on every "
        "rank. Pays on runs of more than one epoch of the data. Needs dynamic sampling.",
    )
    skip_floor: float = _opt(
        0.1, "dapo.skip_history: the least probability that a drawn prompt is generated, however alike its history.",
    )
    screen_size: int = _opt(
        0,
        "Screening (SPEED): a round first samples this many completions per prompt (0 = off, else 2 to "
        "rollout.group_size - 1); a prompt whose screen is all alike on a side of dapo.screen_drop gets no more, the "
        "others are completed to rollout.group_size, the screen's completions kept in the group. The screen "
        "judges correct bits, whatever dapo.filter_metric; needs dynamic sampling (docs/training.md, What "
        "generation costs, and screening).",
    )
    screen_drop: list[str] = _opt(
        ["all_wrong", "all_right"],
        "Which screens rule a prompt out (dapo.screen_size > 0): all_wrong (every screen completion wrong), "
        "all_right (every one correct), or both. Each side costs the groups it cuts that would have mixed at "
        "rollout.group_size: 1 - (1-p)^(G-k) of the all-wrong screens of a prompt of pass rate p.",
        ("all_wrong", "all_right"),
    )
    overlong_filtering: bool = _opt(False, "Mask truncated completions out of the loss (overlong filtering).")
    num_iterations: int = _opt(
        1, "Passes over each rollout batch (PPO epochs); each pass is train.updates_per_step optimizer steps."
    )
    old_logprobs: str = _opt(
        "auto",
        "Where the ratio's old log-probs come from: recompute (a no-grad pass of the training forward after "
        "collection), rollout (the rollout's own log-probs before top-k/top-p, recorded while sampling: no pass), "
        "auto = rollout exactly when the rollout is the training forward (the CPU demo: float32 weights, decode "
        "loop), else recompute. The choice is printed at start.", ("auto", "recompute", "rollout"),
    )
    rollout_correction: str = _opt(
        "auto",
        "Correct for sampling from the rollout's forward instead of the training forward: off; tis (each token's "
        "loss times min(pi_old / pi_rollout, cap), detached; both before top-k/top-p, which is not corrected); mis "
        "(tokens whose weight leaves [1/cap, cap] out of the loss and its normaliser); seq-tis / seq-mis (the same "
        "with the sequence's product of weights). auto = tis when the rollout is not the training forward (another "
        "dtype, compiled cache, generate, another engine), off when it is. Printed at start.",
        ("auto", "off", "tis", "mis", "seq-tis", "seq-mis"),
    )
    rollout_correction_cap: float = _opt(
        2.0, "Cap (> 1) of dapo.rollout_correction: tis truncates weights at it, mis keeps [1/cap, cap]."
    )


@dataclass
class RewardSpec:
    name: str = _opt("accuracy", "Registered reward name or import path 'pkg.mod:function'.")
    weight: float = _opt(1.0, "Weight of this reward in the total.")
    args: dict = _opt({}, "Keyword arguments bound to the reward function (e.g. cache_length for overlong).")


def _default_rewards() -> list[RewardSpec]:
    return [RewardSpec(name="accuracy", weight=1.0), RewardSpec(name="overlong", weight=1.0, args={"cache_length": 32})]


@dataclass
class TrainConfig:
    max_steps: int = _opt(40, "Steps: one rollout batch each (its updates are optimizer steps).")
    prompts_per_step: int = _opt(8, "Informative groups (prompts) per step: the rollout batch.")
    updates_per_step: int = _opt(
        8,
        "Optimizer steps per rollout batch and pass: its groups are cut into this many mini-batches of whole "
        "groups (at most one per group; the paper: 16). Above 1 the policy drifts from the one that sampled, "
        "so eps_low / eps_high act.",
    )
    micro_batch_size: int = _opt(
        16, "Sequences per forward/backward; a mini-batch's are accumulated. Used only when micro_batch_tokens "
        "is 0, or auto on a CPU (a token budget wins over this count)."
    )
    micro_batch_tokens: int | str = _opt(
        0,
        "If > 0, micro-batches are formed by this token budget and micro_batch_size is not used (the budget "
        "wins): a mini-batch is cut, in order, into the fewest micro-batches within the budget, balanced to "
        "carry similar tokens. Tokens: the positions the forward computes, padding included: with shared_prefix "
        "rows of each group's prompt once + its completions, filled up to half the budget (at most 4,096; a "
        "group cut between rows repeats its prompt), so memory follows the budget, not the completions' "
        "length; without, rows x widest prompt+completion. A sequence over the budget gets a micro-batch of "
        "its own (warned once). Per rank. auto: on CUDA the largest budget (a multiple of 1,024) whose estimated "
        "peak (preflight's memory model) fits the card's free memory at start less a 10% margin, logged with its "
        "numbers; on a CPU micro_batch_size, as 0. An update out of memory is redone at half the micro-batch that "
        "failed, kept for the run (one process). `dapo-train preflight` names auto's choice on 24, 48 and 80 GB "
        "cards.",
    )
    learning_rate: float = _opt(1e-4, "AdamW learning rate.")
    lr_scheduler: str = _opt(
        "constant", "Schedule after warmup, over the run's optimizer steps (max_steps x updates_per_step x "
        "num_iterations).", ("constant", "cosine"),
    )
    warmup_steps: int = _opt(
        0, "Linear warmup, in optimizer steps; one longer than the run (whose LR never reaches learning_rate) is "
        "said at start.",
    )
    weight_decay: float = _opt(0.0, "AdamW weight decay.")
    adam_beta1: float = _opt(0.9, "AdamW beta1.")
    adam_beta2: float = _opt(0.99, "AdamW beta2.")
    max_grad_norm: float = _opt(1.0, "Gradient-norm clipping, per optimizer step (0 = off).")
    mixed_precision: str = _opt("auto", "auto = bf16 autocast on CUDA, none on CPU.", ("auto", "no", "bf16", "fp16"))
    logprob_chunk_mib: float = _opt(
        64.0,
        "Log-probs go through the LM head in chunks of at most this many MiB of float32 logits (recomputed in "
        "backward): the bound on the scoring's vocabulary memory, whatever the batch.",
    )
    shared_prefix: str = _opt(
        "auto",
        "Score each group's prompt once for all its completions (a 4-D attention mask) instead of once per "
        "completion: same loss, less work. auto = on when the attention kernel takes a 4-D mask (sdpa, eager).",
        ("auto", "on", "off"),
    )
    deterministic: bool = _opt(
        False, "Use deterministic torch algorithms (slower; for exact resume tests). On CUDA it needs rollout.top_p=1 "
        "(torch has no deterministic cumsum there) and sets CUBLAS_WORKSPACE_CONFIG=:4096:8 when unset."
    )
    num_threads: int = _opt(
        1,
        "CPU threads for torch (0 = torch's default). The tiny model runs fastest on 1: thread start-up costs "
        "more than its maths. More than the CPUs this process may use runs that many, said at start."
    )
    max_bad_steps: int = _opt(
        5, "Stop the run (exit code 3) after this many steps with a NaN/inf loss or gradient norm since the last step "
        "that trained (each is skipped; no checkpoint is saved from weights an optimizer step changed before one).",
    )
    max_starved_steps: int = _opt(
        5, "Steps in a row without an informative group (Eq. 11: every group scored alike in all "
        "dapo.max_gen_rounds rounds; each is skipped) after which the run judges why: after a non-finite step, or "
        "when the training accuracy or the share of untruncated completions fell far below the steps before, it "
        "stops broken (exit code 3); when every prompt drawn had all its completions right (its group; a screen's "
        "k for one dapo.screen_size ruled out; its last group or screen for one dapo.skip_history skipped), the "
        "task is solved: it saves its checkpoint and stops (exit code 5); otherwise (all wrong: too hard for the "
        "model for now) it says so once and goes on.",
    )


@dataclass
class EvalConfig:
    every_steps: int = _opt(
        10, "Evaluate every N steps and at the last (0 = off); step 0 is evaluated first. Per-item records: "
        "eval_items/step_<N>.jsonl."
    )
    num_items: int = _opt(100, "Items of the eval split (a fixed subset: the same items every time; 0 = all).")
    batch_size: int = _opt(128, "Prompts per greedy generate call.")
    max_new_tokens: int = _opt(0, "Completion budget for eval (0 = rollout.max_new_tokens).")
    print_samples: int = _opt(2, "Sample completions printed at each eval.")
    samples: int = _opt(
        0, "K >= 2: each periodic eval also draws K completions per item of its eval.num_items as the rollout "
        "samples (rollout.temperature, top_p, top_k; seeded by seed, the training's random streams untouched): "
        "sampled pass@1 (the mean share of the K right), maj@K and pass@K (eval/sampled/pass_at_1, maj_at_k and "
        "pass_at_k in metrics.jsonl, whatever K), each with its paired change from step 0 and 95% interval; "
        "per-item records in eval_items/sampled_<N>.jsonl. 0 = off: at K = 8 it costs about 3.5x the greedy eval "
        "(the tiny demo's 100 items on one thread: 5.3-6.1 s of CPU against 1.6 s).",
    )
    final_full: bool = _opt(
        True,
        "At the end of a run, greedy accuracy on the whole eval split (final_accuracy and final/* in the last "
        "metrics row, per-item records in eval_items/final_<step>.jsonl); the periodic evals stay on "
        "eval.num_items items. false: no end-of-run eval beyond those.",
    )
    stop_on_regression: bool = _opt(
        False, "Stop the run at the first periodic eval whose strict or answer accuracy is worse than step 0's by "
        "the exact one-sided sign test on the items the two grade differently, at p <= eval.regression_alpha / "
        "(2 x the run's periodic evals): the run says so in one line either way; stopping, the checkpoint of that "
        "step is saved, the summary names the best (checkpoint.keep_best) and the exit code is 6. false: the run "
        "says so and goes on.",
    )
    regression_alpha: float = _opt(
        0.01, "The regression test's chance of a false alarm over a whole run (eval.stop_on_regression): a run "
        "whose accuracy does not change is called worse than step 0, at any eval in either accuracy, with chance "
        "at most this, however many evals it makes (Bonferroni: each eval's test is held to alpha / (2 x the "
        "periodic evals)). Larger flags smaller drops sooner and healthy runs more often.",
    )


@dataclass
class CheckpointConfig:
    every_steps: int = _opt(0, "Save checkpoint_<step>/ every N steps (0 = only at the end).")
    keep_last: int = _opt(
        0, "Keep only the newest N checkpoints (0 = keep all); N + 1 for a moment, as a new one is written whole "
        "before the oldest goes. The run compares them with the free disk space before its first step.",
    )
    keep_best: bool = _opt(
        False, "Keep the checkpoint with the best periodic eval accuracy (the fixed eval.num_items subset) beside "
        "the newest: keep_last never prunes it, the end-of-run summary names it and `dapo-train eval RUN --best` "
        "evaluates it. Ranked: the checkpoints saved at an eval step (checkpoint.every_steps a multiple of "
        "eval.every_steps ranks them all); a tie keeps the earlier. Remembered across --resume; a resume from an "
        "earlier checkpoint goes back to the best as of that one.",
    )


@dataclass
class LoggingConfig:
    trackers: list[str] = _opt(
        [],
        "Experiment trackers besides metrics.jsonl, through accelerate (each needs its package; e.g. "
        "[tensorboard, wandb]; one name alone is a list of one). Offline: WANDB_MODE=offline; TensorBoard, "
        "Aim and trackio write locally.",
        TRACKER_NAMES,
    )
    project: str = _opt(
        "dapo-train",
        "Project the trackers file the run under (wandb/Comet/Aim/trackio project, MLflow experiment, ClearML "
        "project; TensorBoard's folder in the run directory); the run is named run_name.",
    )
    progress_bar: bool = _opt(
        True, "Show tqdm bars on stderr: over steps, and over the items (with their rate) of the end-of-run eval "
        "on the whole split and of `dapo-train eval` (the periodic evals stay quiet: one generate call each at "
        "the default eval.batch_size).",
    )
    rollout_groups: int = _opt(
        8,
        "Groups per step whose completions go to rollouts/step_<N>.jsonl (text, answer, each reward, advantage, "
        "the group's fate, ratios), drawn from every group the step generated, dropped ones too; -1 = all, 0 = "
        "none. `dapo-train show RUN` prints them. The default keeps every shipped config's run under about 65 MB "
        "(configs/qwen1.5b.yaml: about 32 MB; docs/training.md: Run directory).",
    )
    rollout_every: int = _opt(
        10,
        "Every N steps, the step's rollout records as a table in the trackers (TensorBoard text, W&B and ClearML "
        "tables; logging.trackers); 0 = off.",
    )


@dataclass
class Config:
    output_dir: str = _opt("", "Run directory; empty = outputs/<run_name>.")
    run_name: str = _opt(
        "", "Run name; empty = the config file's name and the overrides that change training, sorted by key "
        "(qwen1.5b_eps_high=0.4): paths to a copy of the config's model or data, the data's columns, the eval, "
        "checkpoint and logging sections and speed settings name nothing; at most 80 characters, then a hash of "
        "the rest (docs/training.md, Run names).",
    )
    seed: int = _opt(0, "Seed for data order, sampling and initialisation.")
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    dapo: DapoConfig = field(default_factory=DapoConfig)
    rewards: list[RewardSpec] = field(
        default_factory=_default_rewards, metadata={
            "help": "Rewards summed with weights into each completion's total (the advantage's R, Eq. 9); the "
            "registered names and their args: `dapo-train config --keys rewards`, docs/rewards-and-tasks.md.",
            "choices": None,
        },
    )
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        validate(self)
