"""configs/ablation/: each row differs from the one before it in its named technique only, and
the last row is the demo's DAPO plus overlong filtering (the paper's rows are cumulative), with the
ablation's eval schedule."""

import dataclasses
from pathlib import Path

from dapo_train.config import config_to_dict, flatten_config, load_config

ABLATION = Path(__file__).resolve().parent.parent / "configs" / "ablation"
# Row -> the dotted keys its technique changes, relative to the previous row.
STEPS = {
    "1-grpo": None,
    "2-overlong-filtering": {"dapo.overlong_filtering"},
    "3-clip-higher": {"dapo.eps_high"},
    "4-soft-overlong": {"rewards.1.name", "rewards.1.weight", "rewards.1.args.cache_length"},
    "5-token-level-loss": {"dapo.loss_reduction"},
    "6-dapo": {"dapo.dynamic_sampling"},
}


def _settings(path: Path) -> dict:
    flat = flatten_config(config_to_dict(load_config(str(path), ["output_dir=x", "run_name=x"])))
    return {key: value for key, value in flat.items() if value not in (None, {})}


def test_each_row_adds_exactly_its_technique():
    files = sorted(ABLATION.glob("*.yaml"))
    assert [f.stem for f in files] == list(STEPS)
    first = _settings(files[0])
    assert (first["dapo.eps_low"], first["dapo.eps_high"], first["dapo.loss_reduction"]) == (0.2, 0.2, "sample")
    assert (first["dapo.dynamic_sampling"], first["dapo.overlong_filtering"], first["dapo.beta"]) == (False, False, 0.0)
    assert [key for key in first if key.startswith("rewards.")] == ["rewards.0.name", "rewards.0.weight"]
    for before, after in zip(files, files[1:]):
        old, new = _settings(before), _settings(after)
        changed = {key for key in old.keys() | new.keys() if old.get(key) != new.get(key)}
        assert changed == STEPS[after.stem], after.stem


def test_the_last_row_is_the_demos_dapo_with_overlong_filtering():
    dapo = load_config(str(ABLATION / "6-dapo.yaml"), [])
    demo = load_config(None, ["dapo.overlong_filtering=true"])
    assert dataclasses.replace(dapo, eval=demo.eval, run_name=demo.run_name, output_dir=demo.output_dir) == demo


def test_the_ablation_script_counts_completions_and_reads_accuracy(tmp_path):
    """summarize on a hand-made run: 8 prompts x G=8 per round, 2 steps of 1 and 3 rounds -> 256
    completions; best leaves out step 0; the overlong penalty fired on one of two steps."""
    import importlib.util
    import json

    from dapo_train.config import save_config

    spec = importlib.util.spec_from_file_location("ablation", ABLATION.parents[1] / "scripts" / "ablation.py")
    ablation = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ablation)
    run = tmp_path / "run"
    run.mkdir()
    save_config(load_config(str(ABLATION / "6-dapo.yaml"), [f"output_dir={run}"]), run / "config.yaml")
    rows = [
        {"step": 0, "accuracy": 0.2, "seconds_eval": 1.0},
        {"step": 1, "gen_rounds": 1, "seconds_step": 2.0, "completion_length_max": 50, "truncated_ratio": 0.0,
         "rewards/overlong/mean": 0.0},
        {"step": 2, "gen_rounds": 3, "seconds_step": 3.0, "completion_length_max": 70, "truncated_ratio": 0.5,
         "rewards/overlong/mean": -0.1, "accuracy": 0.3, "seconds_eval": 1.0},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = ablation.summarize(run)
    assert (summary["final"], summary["best"], summary["completions"], summary["wall"]) == (0.3, 0.3, 256, 7.0)
    assert (summary["overlong_steps"], summary["length_max"], summary["truncated"]) == (0.5, 70, 0.25)
    assert summary["curve"] == [(0, 0, 0.2), (16, 256, 0.3)]  # 8 optimizer steps per step
    assert "| 6-dapo | 2 | 0.300 ± 0.000 |" in ablation.table({"6-dapo": [summary, summary]})
