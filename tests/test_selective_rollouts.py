"""End to end on the shipped tiny model: a run that screens (dapo.screen_size), sizes its rounds from the
keep rate (dapo.max_round_prompts) and skips prompts on their history (dapo.skip_history) resumes from a
mid-run checkpoint into the same next steps as the uninterrupted run."""

import pytest
import torch
from safetensors.torch import load_file

from dapo_train.config.load import load_config
from dapo_train.run.logs import read_metrics
from dapo_train.run.rollouts import read_rollouts, rollouts_path
from dapo_train.task.locations import TINY_DATA_DIR
from dapo_train.train.loop import train

# Six training prompts, so that they come back and the history acts; 2 prompts x G=4 a step, a screen of 2.
SELECTIVE = [
    "model.name_or_path=builtin:tiny", "rollout.group_size=4", "rollout.max_new_tokens=32", "train.prompts_per_step=2",
    "train.micro_batch_size=4", "train.updates_per_step=2", "eval.every_steps=0", "train.deterministic=true",
    "train.num_threads=1", "rewards=[{name: accuracy}, {name: overlong, args: {cache_length: 16}}]",
    "logging.progress_bar=false", "eval.final_full=false", "logging.rollout_groups=-1", "dapo.screen_size=2",
    "dapo.max_round_prompts=6", "dapo.skip_history=true", "dapo.skip_floor=0.2", "train.max_starved_steps=100",
]


def _first_items(folder, train: int, test: int):
    """The shipped task's first items (the tiny model's own kind of question): folder/{train,test}.jsonl."""
    folder.mkdir()
    for split, count in (("train", train), ("test", test)):
        lines = (TINY_DATA_DIR / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()[:count]
        (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


def _run(out, data, *extra, resume=None):
    return train(load_config(None, [*SELECTIVE, f"data.path={data}", f"output_dir={out}", *extra]), resume=resume)


def test_resume_with_screening_round_sizes_and_history_reproduces_the_run(tmp_path):
    data = _first_items(tmp_path / "task", train=6, test=2)
    straight = _run(tmp_path / "straight", data, "train.max_steps=8")
    _run(tmp_path / "split", data, "train.max_steps=4")
    resumed = _run(tmp_path / "split", data, "train.max_steps=8", resume=True)
    a, b = read_metrics(straight), read_metrics(resumed)
    assert [m["step"] for m in b] == list(range(1, 9))
    assert sum(m["prompts_skipped"] for m in a[4:]) > 0  # the history skipped prompts after the checkpoint
    assert sum(m["groups_screened_all_right"] + m["groups_screened_all_wrong"] for m in a) > 0
    for key in ("prompts_skipped", "gen_rounds", "groups_kept", "groups_screened_all_wrong", "generated_tokens",
                "loss", "reward_mean"):
        assert [m.get(key) for m in a] == pytest.approx([m.get(key) for m in b], abs=1e-6), key
    for step in range(5, 9):
        assert [r["completion"] for r in read_rollouts(rollouts_path(straight, step))] == \
            [r["completion"] for r in read_rollouts(rollouts_path(resumed, step))]
    final_a = load_file(straight / "checkpoint_8" / "model.safetensors")
    final_b = load_file(resumed / "checkpoint_8" / "model.safetensors")
    for name in final_a:
        torch.testing.assert_close(final_a[name], final_b[name], atol=1e-5, rtol=0)
