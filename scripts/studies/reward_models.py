"""The reward-model study on the embedded task: the rule reward alone, the shipped tiny verifier alone,
and both, every configs/reward_models/ row x every seed, then one table and one JSON file
(docs/studies.md reads them).

    python scripts/studies/reward_models.py                       # 3 rows x seeds 1,2,3, two runs at a time
    python scripts/studies/reward_models.py --seeds 1 --set train.max_steps=2   # a quicker look

As in scripts/studies/policy_losses.py (whose table helpers and scripts/studies/ablation.py's runner this uses), a row
holds only its own settings, laid over the demo's config with the demo's eval schedule (100 fixed
items every 10 steps, all 500 test items at the end); runs go to OUT/<row>_seed<N>/ and running the
command again skips finished runs. Why not `dapo-train sweep`: the verifier row also changes
dapo.filter_metric (filtering on the correct bits would hand it the rule check), so the rows are not a
grid over one key.

Per row: the final accuracy under the rule check on the 500 test items with its paired difference to
the rule row (item by item and seed by seed, 95% interval: `dapo-train compare --baseline`'s pairing),
the training samples' rule accuracy and verifier score over the last 10 steps, and, to see whether the
verifier was gamed, the verifier re-scoring every row's final eval completions: its mean P(correct),
the share of wrong completions it calls right (> 0.5), and its AUC against the rule check.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from dapo_train.config.schema import DataConfig, ModelConfig, RewardSpec
from dapo_train.model.loading import load_tokenizer
from dapo_train.rewards import build_rewards, score
from dapo_train.run.eval_items import FINAL, items_path, read_items
from dapo_train.study.compare import format_delta, paired_comparison
from dapo_train.study.runs import Point, RunRecord, summarize_metrics
from dapo_train.task.prompts import load_prompt_splits

from ablation import ROOT, TASKS, run_rows

sys.path.insert(0, str(ROOT / "scripts" / "build"))
from make_tiny_verifier import auc  # noqa: E402  (a build script)

ROWS_DIR = ROOT / "configs" / "reward_models"
ROWS = ("rule", "verifier", "both")  # rule first: the baseline of the paired differences
SCHEDULE = ["eval.every_steps=10", "eval.num_items=100"]  # the demo's own, on top of the ablation's
LAST_STEPS = 10


def _mean_std(values: list[float], digits: int = 3) -> str:
    if not values:
        return "-"
    if len(values) < 2:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def _last(run: RunRecord, key: str) -> float | None:
    values = [row[key] for row in run.rows if row["step"] > 0 and key in row][-LAST_STEPS:]
    return statistics.mean(values) if values else None


def rescore(runs: list[RunRecord]) -> list[dict]:
    """The tiny verifier on each run's final eval completions (the same texts, whichever rewards the run
    trained on): mean P(correct), the share of wrong ones above 0.5, AUC against the rule check."""
    verifier = build_rewards([RewardSpec("reward_model", 1.0, {"path": "builtin:tiny-verifier",
                                                                "normalize": "sigmoid"})],
                             max_new_tokens=96).load(torch.device("cpu"))
    prompts = {p.uid: p for p in load_prompt_splits(DataConfig(), load_tokenizer(ModelConfig()), ["test"])["test"][0]}
    out = []
    for run in runs:
        records = read_items(items_path(run.path, FINAL, max(r["step"] for r in run.rows)))
        p = score(verifier, [r["completion"] for r in records], [r["gold"] for r in records],
                  questions=[prompts[r["uid"]].question for r in records]).per_reward["reward_model"]
        correct = [bool(r["correct"]) for r in records]
        wrong = [value for value, right in zip(p, correct) if not right]
        out.append({"mean_p": statistics.mean(p), "wrong_called_right": sum(v > 0.5 for v in wrong) / len(wrong),
                    "auc": auc(p, correct), "accuracy": statistics.mean(correct),
                    "examples": [(r["completion"], v) for r, v in zip(records, p) if not r["correct"] and v > 0.5][:3]})
    return out


def table(by_row: dict[str, list[RunRecord]], rescored: dict[str, list[dict]]) -> tuple[str, dict]:
    points = {row: Point.row(row, runs) for row, runs in by_row.items()}
    names = list(points)
    paired = {name: paired_comparison(points[names[0]], points[name], {"row": "row"}) for name in names[1:]}
    lines = [
        f"| row | seeds | final acc (500) | Δ vs {names[0]} [95% CI] | train acc, last {LAST_STEPS} steps | "
        f"verifier score in training, last {LAST_STEPS} | verifier P(correct) on final completions | "
        "wrong ones it calls right | its AUC there | wall s |",
        "|" + " --- |" * 10,
    ]
    for name, runs in by_row.items():
        scores = [value for run in runs if (value := _last(run, "rewards/reward_model/mean")) is not None]
        again = rescored[name]
        lines.append(
            f"| {name} | {len(runs)} | {_mean_std([r['accuracy'] for r in again])} | "
            f"{format_delta(paired.get(name))} | {_mean_std([_last(run, 'train_accuracy') for run in runs])} | "
            f"{_mean_std(scores)} | {_mean_std([r['mean_p'] for r in again])} | "
            f"{_mean_std([r['wrong_called_right'] for r in again])} | {_mean_std([r['auc'] for r in again])} | "
            f"{_mean_std([summarize_metrics(run.rows)['wall_seconds'] for run in runs], 0)} |"
        )
    return "\n".join(lines), paired


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--jobs", type=int, default=2, help="Runs at a time (one torch thread each).")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="Override for every run.")
    parser.add_argument("--out", type=Path, default=Path("outputs") / "reward_models")
    args = parser.parse_args(argv)
    seeds, started = [int(s) for s in args.seeds.split(",")], time.monotonic()
    by_row = run_rows(TASKS["tiny"], ROWS_DIR, list(ROWS), seeds, args.out, [*SCHEDULE, *args.set], args.jobs)
    rescored = {row: rescore(runs) for row, runs in by_row.items()}
    text, paired = table(by_row, rescored)
    elapsed = time.monotonic() - started
    text += f"\n\n{len(ROWS) * len(seeds)} runs, {args.jobs} at a time: {elapsed / 60:.1f} minutes"
    print(text, flush=True)
    for row, results in rescored.items():
        for result in results:
            for completion, p in result["examples"][:1]:
                print(f"{row}: wrong, verifier {p:.2f}: {completion!r}")
    (args.out / "reward_models.md").write_text(text + "\n")
    (args.out / "reward_models.json").write_text(json.dumps({"paired": paired, "rescored": rescored,
                                                             "elapsed_s": elapsed}, indent=1, ensure_ascii=False))
    print(f"wrote {args.out / 'reward_models.md'} and {args.out / 'reward_models.json'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
