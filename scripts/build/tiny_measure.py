"""The tiny builds' measurement: how a warm start does on its test split, by the code of
`dapo-train eval`. Build-time code for make_tiny_model.py (next to this file).
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer, Qwen2ForCausalLM

from dapo_train.config.schema import DataConfig
from dapo_train.evaluation.generate import evaluate_prompts
from dapo_train.task.prompts import fixed_eval_subset, load_prompts

SEED = 0  # the T=1 samples' seed (the build's SEED)
MAX_NEW_TOKENS = 96  # the completion budget of the measurement (the trainer's default)


def measure(
    model, tokenizer, data_dir: Path, n_sampled: int = 100, k: int = 8,
    max_new_tokens: int = MAX_NEW_TOKENS, truncation: bool = False, eval_items: int = 0,
) -> dict:
    """Greedy accuracy and format rate on the test split; pass@k and informative groups at T=1 on
    its first n_sampled items; with `truncation`, the shares of completions cut at max_new_tokens;
    with `eval_items`, the greedy accuracy on the fixed subset of that many items that a run's
    periodic eval covers (eval.num_items: task.prompts.fixed_eval_subset), its step 0.

    The same code as the trainer's eval and `dapo-train eval`: prompts from data.load_prompts with
    the default DataConfig (the trainer's columns and system prompt), generation and grading by
    evaluate.evaluate_prompts (answers.extract_answer / answers_match, the hard_format check).
    Batches as the numbers were first measured: greedy 125 prompts per generate call, the
    n_sampled x k samples in one call seeded with SEED (0).
    """
    prompts, stats = load_prompts(DataConfig(path=str(data_dir)), tokenizer, "test")
    if stats.kept != stats.rows:
        raise RuntimeError(f"every test row must give a prompt: {stats.summary()}")
    greedy = evaluate_prompts(model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=125).records
    sampled = evaluate_prompts(
        model,
        tokenizer,
        prompts[:n_sampled],
        max_new_tokens=max_new_tokens,
        batch_size=n_sampled * k,
        samples=k,
        temperature=1.0,
        seed=SEED,
    ).records
    correct = [r["correct"] for r in greedy]
    hits = [sum(r["correct"] for r in sampled[i * k : (i + 1) * k]) for i in range(n_sampled)]
    cut = {"greedy_truncated_rate": greedy, "truncated_T1": sampled} if truncation else {}
    fixed = {p.uid for p in fixed_eval_subset(prompts, eval_items)} if eval_items else set()
    on_fixed = [r["correct"] for p, r in zip(prompts, greedy) if p.uid in fixed]
    return {
        **{key: sum(r["truncated"] for r in records) / len(records) for key, records in cut.items()},
        **({f"greedy_accuracy_on_{eval_items}_eval_items": sum(on_fixed) / len(on_fixed)} if eval_items else {}),
        "greedy_accuracy": sum(correct) / len(greedy),
        "greedy_format_rate": sum(r["format_ok"] for r in greedy) / len(greedy),
        "greedy_accuracy_on_sampled_items": sum(correct[:n_sampled]) / n_sampled,
        f"pass@{k}_T1": sum(h > 0 for h in hits) / n_sampled,
        "mean_accuracy_T1": sum(hits) / (k * n_sampled),
        "informative_groups_T1": sum(0 < h < k for h in hits) / n_sampled,
        "example_greedy": [r["completion"] for r in greedy[:3]],
    }


def remeasure(data_dir: Path, model_dir: Path, measure_kwargs: dict) -> int:
    """measure() on the saved model and test split; the build fields of build_info.json stay."""
    model = Qwen2ForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    info_path = model_dir / "build_info.json"
    info = json.loads(info_path.read_text(encoding="utf-8"))
    info.update(measure(model, tokenizer, data_dir, **measure_kwargs))
    write_info(info, info_path)
    return 0


def write_info(info: dict, path: Path) -> None:
    """build_info.json, also printed."""
    text = json.dumps(info, ensure_ascii=False, indent=2)
    path.write_text(text + "\n", encoding="utf-8")
    print(text)
