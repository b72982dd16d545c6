"""Evaluation of a loaded model on a list of prompts: generate, grade, one record per completion.

The trainer's periodic eval, `dapo-train eval` and the tiny model's build all call
`evaluate_prompts` (or `eval_records`), so the numbers a run logs and the numbers a later `eval`
prints come from the same prompt builder (task/prompts.py), the same batched, left-padded generation
(rollout/) and the same answer check (the task's data.correctness; numeric by default).
- Greedy decoding over a fixed item list by default, so two evals of the same weights on the same
  items give the same numbers.
- Completions are cut at the first EOS token.
With `samples = K > 1`, K completions per item are sampled at the given temperature; the summary
(evaluation/stats.py) adds pass@K and maj@K. Configured reward models score the records too
(add_model_scores): accuracy stays the task's check, and their mean is logged beside it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
from tqdm.auto import tqdm

from dapo_train.config.schema import Config
from dapo_train.evaluation.stats import summarize_records
from dapo_train.rewards.scoring import REWARDS, RewardSet, score
from dapo_train.rollout.completions import Completion, policy_part, sample_completions
from dapo_train.rollout.decoding import decode_loop
from dapo_train.rollout.engines import RolloutEngine
from dapo_train.rollout.sampling import SamplingSettings
from dapo_train.run.signals import StopRequested
from dapo_train.task.answers import ANSWER_CHECKS, AnswerCheck
from dapo_train.task.prompts import Prompt
from dapo_train.tools.turns import ToolTurns

NUMERIC = ANSWER_CHECKS["numeric"]


class EvalStopped(Exception):
    """A stop (run/signals.py) ended an eval before its last chunk of items: its records are incomplete."""


@dataclass
class EvalResult:
    """metrics: stable keys (see summarize_records); records: one dict per completion, in
    item order and, within an item, sample order (keys: uid, question, gold, completion,
    extracted, correct, answer_correct, format_ok, length, truncated, and sample when K > 1)."""

    metrics: dict[str, float] = field(default_factory=dict)
    records: list[dict] = field(default_factory=list)


# --------------------------------------------------------------------------------------------
# Generation and scoring.


def eval_max_new_tokens(cfg: Config) -> int:
    """eval.max_new_tokens, or the rollout budget when it is 0."""
    return cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens


def longest_sequence(cfg: Config) -> int:
    """The most positions a rollout or eval sequence of the run takes: the longest prompt kept and the
    largest completion budget (what an engine that sizes its cache, vllm, is started with)."""
    evaluating = cfg.eval.every_steps > 0 or cfg.eval.final_full
    return cfg.data.max_prompt_length + max(cfg.rollout.max_new_tokens, eval_max_new_tokens(cfg) if evaluating else 0)


def completion_records(
    prompts: Sequence[Prompt], completions: Sequence[Completion], samples: int, check: AnswerCheck = NUMERIC
) -> list[dict]:
    """One record per completion: the task's answer and correct bit (check, data.correctness: strict, as the
    reward grades), its answer_correct bit (the gold number wherever a reader takes the final answer to be)
    and the hard format check of the `hard_format` reward (format_ok), read in the policy's own text (with
    tools, the transcript `completion` less its `tool_turn_spans`)."""
    texts = [c.policy_text for c in completions]
    golds = [prompts[i // samples].gold for i in range(len(completions))]
    format_scores = REWARDS["hard_format"].fn(texts, golds)
    records = []
    for index, (completion, text, gold, format_score) in enumerate(zip(completions, texts, golds, format_scores)):
        prompt = prompts[index // samples]
        record = {
            "uid": prompt.uid,
            "question": prompt.question,
            "gold": gold,
            "completion": completion.text,
            "extracted": check.extract(text),
            "correct": bool(check.is_correct(text, gold)),
            "answer_correct": bool(check.is_answer_correct(text, gold)),
            "format_ok": format_score > 0,
            "length": completion.length,
            "truncated": completion.truncated,
            "tool_turn_spans": [list(span) for span in completion.tool_turn_spans],
        }
        if samples > 1:
            record["sample"] = index % samples
        records.append(record)
    return records


def add_model_scores(reward_set: RewardSet, prompts: Sequence[Prompt], records: list[dict]) -> None:
    """Each record's score by every reward of `reward_set` that owns a model, as record["scores"][key]
    (records in completion_records' order, K per prompt); nothing when none is configured."""
    models = reward_set.models()
    if not models.rewards or not records:
        return
    samples = len(records) // len(prompts)
    item = [prompts[index // samples] for index in range(len(records))]
    texts = [policy_part(r["completion"], r.get("tool_turn_spans", [])) for r in records]
    scores = score(models, texts, [r["gold"] for r in records],
                   lengths=[r["length"] for r in records], prompts=[p.text for p in item],
                   questions=[p.question for p in item])
    for index, record in enumerate(records):
        record["scores"] = {key: values[index] for key, values in scores.per_reward.items()}


@contextlib.contextmanager
def _seeded(seed: int | None, device: torch.device):
    """Seed sampling without disturbing the caller's RNG streams (the trainer's stay intact)."""
    if seed is None:
        yield
        return
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        torch.manual_seed(seed)
        yield


def evaluate_prompts(model, tokenizer, prompts: list[Prompt], *, samples: int = 1, **options) -> EvalResult:
    """Evaluate an already-loaded model on `prompts`, in their order: eval_records (same options),
    summarised."""
    records = eval_records(model, tokenizer, prompts, samples=samples, **options)
    return EvalResult(metrics=summarize_records(records, samples), records=records)


def eval_records(
    model,
    tokenizer,
    prompts: list[Prompt],
    *,
    max_new_tokens: int,
    batch_size: int,
    samples: int = 1,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    check: AnswerCheck = NUMERIC,
    tools: ToolTurns | None = None,
    progress: str | None = None,
    engine: RolloutEngine | None = None,
    stop: StopRequested | None = None,
) -> list[dict]:
    """The completion records (completion_records) of an already-loaded model on `prompts`, in their
    order; the trainer's ranks each make their share's and summarise the gathered whole once. tools:
    the run's rollout.tools, run as in its rollouts (the prompts list them).

    samples == 1: greedy decoding (temperature ignored), deterministic for a fixed item list and
    batch size. samples == K > 1: K samples per item at `temperature`, `top_p` and `top_k` (a run's sampled eval
    passes its rollout's), reproducible when `seed` is given (the caller's RNG state is restored afterwards).
    batch_size counts sequences per generate call (prompts x samples). The model is switched to
    eval mode during generation and back to its previous mode afterwards. progress: the label of a bar on
    stderr that counts items with their rate (None: quiet); it stays when it is the only bar, and goes
    when it runs under the training bar. engine: a rollout engine that serves evals (its `serves_eval`: vllm,
    whose weights are the model's) generates instead of the model, all items in one call. stop: a stop
    requested before a chunk of items (before the engine's one call) raises EvalStopped.
    """
    if not prompts:
        raise ValueError("evaluate_prompts needs at least one prompt")
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    if samples > 1 and temperature <= 0:
        raise ValueError(f"sampling needs temperature > 0, got {temperature}")
    settings = SamplingSettings(max_new_tokens=max_new_tokens, do_sample=samples > 1, temperature=temperature,
                                top_p=top_p, top_k=top_k)
    prompt_ids = [prompt.input_ids for prompt in prompts]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    bar = tqdm(total=len(prompts), desc=progress, unit="item", leave=None, disable=progress is None)
    try:
        with _seeded(seed if samples > 1 else None, device):
            if engine is not None:
                _check(stop)
                completions = engine.generate(prompt_ids, settings, samples)
                bar.update(len(prompts))
            else:
                completions = sample_completions(  # N*K rows, K per item
                    model, tokenizer, prompt_ids, settings, batch_size=batch_size, group_size=samples,
                    decode=_counted(partial(decode_loop, tools=tools), bar, stop),
                )
    finally:
        bar.close()
        model.train(was_training)
    return completion_records(prompts, completions, samples, check)


def _counted(decode, bar: tqdm, stop: StopRequested | None):
    """`decode`, moving `bar` on by the items of each chunk it decodes (sample_completions' chunks), and
    raising EvalStopped instead of decoding a chunk once `stop` is requested."""
    def counted(model, prompts, *args, **kwargs):
        _check(stop)
        decoded = decode(model, prompts, *args, **kwargs)
        bar.update(len(prompts))
        return decoded
    return counted


def _check(stop: StopRequested | None) -> None:
    if stop is not None and stop.requested:
        raise EvalStopped
