"""An out-of-memory step redone smaller, never lost (train/update/out_of_memory.py, rollout/fitting.py), on the shipped
tiny model with faults injected as a card would raise them (dapo_train/faults.py): the step equals one run at
the smaller size from the start, nothing is generated twice, one line says so, a resume keeps the size; a
completion that cannot fit alone stops the run at its last good step's checkpoint, exit code 6."""

import logging
import re

import pytest
import torch
from safetensors.torch import load_file
from test_train import SMALL

from dapo_train.config.load import load_config
from dapo_train.errors import one_line_exits
from dapo_train.faults import DECODE_ROWS, UPDATE_TOKENS
from dapo_train.rollout import hf_engines
from dapo_train.run.logs import read_metrics
from dapo_train.train.loop import train
from dapo_train.train.update import passes as update_module

COMPARED = ("loss", "grad_norm", "num_tokens", "generated_tokens", "reward_mean", "groups_kept",
            "completion_length_mean")


@pytest.fixture
def generated(monkeypatch) -> list[int]:
    """The completion tokens every rollout generate call returns, summed per run: a regenerated rollout shows."""
    counted = [0]
    original = hf_engines.TransformersEngine.generate

    def counting(self, *args, **kwargs):
        completions = original(self, *args, **kwargs)
        counted[0] += sum(int(c.completion_ids.numel()) for c in completions)
        return completions

    monkeypatch.setattr(hf_engines.TransformersEngine, "generate", counting)
    return counted


def _run(out, *extra, resume=None):
    return train(load_config(None, [*SMALL, f"output_dir={out}", *extra]), resume=resume)


def _lines(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def _same_steps(a, b) -> None:
    first, second = read_metrics(a), read_metrics(b)
    assert len(first) == len(second) and any(m.get("groups_kept") for m in first)
    for key in COMPARED:
        assert [m.get(key) for m in first] == pytest.approx([m.get(key) for m in second], abs=1e-6), key
    last = max(m["step"] for m in first)
    weights, expected = (load_file(d / f"checkpoint_{last}" / "model.safetensors") for d in (a, b))
    for name in expected:
        torch.testing.assert_close(weights[name], expected[name], atol=1e-6, rtol=0)


def _lowered(run_dir, step: int) -> dict:
    """The budgets checkpoint_<step> records as lowered out of memory: key -> (value, the value it replaced)."""
    state = torch.load(run_dir / f"checkpoint_{step}" / "trainer_state.pt", weights_only=False)
    return {entry["key"]: (entry["value"], entry["replaced"]) for entry in state["lowered_budgets"]}


def test_an_update_out_of_memory_is_redone_at_half_the_micro_batch_and_equals_that_budget_from_the_start(
        tmp_path, monkeypatch, caplog, generated):
    """A micro-batch over 200 positions fails (a step's mini-batch of 4 completions is about 240 in one
    micro-batch at 1,024): step 1's update is redone at half that micro-batch, step 2 runs at it."""
    monkeypatch.setenv(UPDATE_TOKENS, "200")
    with caplog.at_level(logging.INFO, logger="dapo_train"):
        failed = _run(tmp_path / "failed", "train.max_steps=2", "train.micro_batch_tokens=1024")
    said = _lines(caplog, "out of memory in the update")
    assert len(said) == 1 and "\n" not in said[0] and said[0].startswith("step 1: ")
    positions, halved = map(int, re.search(r"a micro-batch of \d+ completions, (\d+) positions, at "
                                           r"train.micro_batch_tokens=1024\): redone .* at "
                                           r"train.micro_batch_tokens=(\d+),", said[0]).groups())
    assert positions > 200 and halved == positions // 2
    assert _lowered(failed, 2) == {"train.micro_batch_tokens": (halved, 1024)}
    generated_once, generated[0] = generated[0], 0

    monkeypatch.delenv(UPDATE_TOKENS)
    smaller = _run(tmp_path / "smaller", "train.max_steps=2", f"train.micro_batch_tokens={halved}")
    _same_steps(failed, smaller)
    assert generated_once == generated[0] == sum(m["generated_tokens"] for m in read_metrics(smaller))

    # A resume keeps the smaller budget: under the same fault it fails nowhere (at 1,024 it would).
    monkeypatch.setenv(UPDATE_TOKENS, "200")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dapo_train"):
        _run(tmp_path / "failed", "train.max_steps=3", "train.micro_batch_tokens=1024", resume=True)
    assert _lines(caplog, f"train.micro_batch_tokens={halved}, as the checkpoint's run lowered it")
    assert not _lines(caplog, "out of memory in the update")
    assert _lowered(failed, 3) == {"train.micro_batch_tokens": (halved, 1024)}


def test_a_decode_out_of_memory_is_redone_in_halves_and_equals_that_batch_from_the_start(
        tmp_path, monkeypatch, caplog, generated):
    """A generate call of more than 4 rows fails: the round's 2 prompts x 4 are decoded again 4 rows at a
    time from the same random state, the same completions a run at rollout.generation_batch_size=4 draws."""
    monkeypatch.setenv(DECODE_ROWS, "4")
    with caplog.at_level(logging.INFO, logger="dapo_train"):
        failed = _run(tmp_path / "failed", "train.max_steps=2", "rollout.generation_batch_size=8")
    said = _lines(caplog, "out of memory in a generate call")
    assert len(said) == 1 and "\n" not in said[0] and "of 8 rows" in said[0] and "at most 4 rows" in said[0]
    assert _lowered(failed, 2) == {"rollout.generation_batch_size": (4, 8)}
    generated_once, generated[0] = generated[0], 0

    monkeypatch.delenv(DECODE_ROWS)
    smaller = _run(tmp_path / "smaller", "train.max_steps=2", "rollout.generation_batch_size=4")
    _same_steps(failed, smaller)
    assert generated_once == generated[0] == sum(m["generated_tokens"] for m in read_metrics(smaller))

    monkeypatch.setenv(DECODE_ROWS, "4")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dapo_train"):
        _run(tmp_path / "failed", "train.max_steps=3", "rollout.generation_batch_size=8", resume=True)
    assert _lines(caplog, "rollout.generation_batch_size=4, as the checkpoint's run lowered it")
    assert not _lines(caplog, "out of memory in a generate call")


def test_a_completion_that_cannot_fit_alone_stops_the_run_at_its_last_good_step(tmp_path, monkeypatch, capsys):
    """From step 2 on every micro-batch fails: the update halves down to one completion, then the run stops
    with checkpoint_1 (the weights step 1 left, equal to a run of one step), one line, exit code 6."""
    original = update_module._micro_batch_backward

    def failing_after_step_1(learner, *args):
        if learner.optimizer.steps >= 2:  # step 1's two optimizer steps are done
            raise torch.OutOfMemoryError("a fault of this test")
        return original(learner, *args)

    monkeypatch.setattr(update_module, "_micro_batch_backward", failing_after_step_1)
    with pytest.raises(SystemExit) as ended, one_line_exits(debug=False):
        _run(tmp_path / "stopped", "train.max_steps=3", "dapo.dynamic_sampling=false")
    assert ended.value.code == 7
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith("out of memory: step 2's update: one completion alone")
    assert "model.gradient_checkpointing=on" in line and "checkpoint_1 holds the last good step" in line
    assert [p.name for p in (tmp_path / "stopped").glob("checkpoint_*")] == ["checkpoint_1"]

    monkeypatch.setattr(update_module, "_micro_batch_backward", original)
    one_step = _run(tmp_path / "one", "train.max_steps=1", "dapo.dynamic_sampling=false")
    weights, expected = (load_file(d / "checkpoint_1" / "model.safetensors") for d in (tmp_path / "stopped", one_step))
    for name in expected:
        torch.testing.assert_close(weights[name], expected[name], atol=0, rtol=0)


def test_out_of_memory_after_an_optimizer_step_redoes_the_step_from_its_weights_and_adamw_state(
        tmp_path, monkeypatch, caplog):
    """Step 1's second mini-batch fails after its first made an optimizer step: the redo starts from the weights
    and AdamW state the step began with (their host copy), so the step equals one at the smaller budget."""
    original = update_module._micro_batch_backward

    def failing_second_mini_batch(learner, micro, *args):
        if learner.optimizer.steps == 1 and micro.advantages.numel() > 1:
            raise torch.OutOfMemoryError("a fault of this test")
        return original(learner, micro, *args)

    monkeypatch.setattr(update_module, "_micro_batch_backward", failing_second_mini_batch)
    with caplog.at_level(logging.INFO, logger="dapo_train"):
        failed = _run(tmp_path / "failed", "train.max_steps=1", "train.micro_batch_tokens=1024",
                      "dapo.dynamic_sampling=false")
    said = _lines(caplog, "out of memory in the update")
    assert len(said) == 1
    halved = int(re.search(r"redone .* at train.micro_batch_tokens=(\d+),", said[0]).group(1))
    monkeypatch.setattr(update_module, "_micro_batch_backward", original)
    smaller = _run(tmp_path / "smaller", "train.max_steps=1", f"train.micro_batch_tokens={halved}",
                   "dapo.dynamic_sampling=false")
    _same_steps(failed, smaller)
    assert read_metrics(failed)[0]["optimizer_steps"] == 2


def test_the_snapshot_survives_a_redo_that_steps_the_optimizer_and_fails_again():
    """Restored twice within one step (a redo that made optimizer steps and ran out again): the weights and
    AdamW state are the step's start both times, not what the first redo left (no tensor shared with the copy)."""
    from types import SimpleNamespace

    from dapo_train.train.update.out_of_memory import Snapshot

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)

    def optimizer_step() -> None:
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    optimizer_step()  # AdamW's moments exist
    learner = SimpleNamespace(model=model, optimizer=SimpleNamespace(optimizer=optimizer, steps=1))
    start = ({k: v.clone() for k, v in model.state_dict().items()},
             {k: v.clone() for k, v in optimizer.state[model.weight].items()})
    snapshot = Snapshot()
    snapshot.take(learner)
    for _ in range(2):
        optimizer_step()
        learner.optimizer.steps = 5
        snapshot.restore(learner)
        assert learner.optimizer.steps == 1
        for name, value in start[0].items():
            torch.testing.assert_close(model.state_dict()[name], value, atol=0, rtol=0)
        for name, value in start[1].items():
            torch.testing.assert_close(optimizer.state[model.weight][name], value, atol=0, rtol=0)


def test_with_several_processes_an_out_of_memory_update_is_not_redone(monkeypatch):
    """UpdateRetry(enabled=False), as session.setup builds it under several processes: the error goes on, no
    budget is halved, no host copy is taken."""
    from types import SimpleNamespace

    from dapo_train.train.update import out_of_memory as out_of_memory
    from dapo_train.train.update.passes import MicroBatchOutOfMemory

    def failing(learner, batch, cfg):
        raise MicroBatchOutOfMemory(4, 900)

    monkeypatch.setattr(out_of_memory, "update", failing)
    retry = out_of_memory.UpdateRetry(enabled=False)
    learner = SimpleNamespace(batching="untouched")
    cfg = load_config(None, ["train.updates_per_step=2"])
    with pytest.raises(MicroBatchOutOfMemory):
        retry.update(learner, SimpleNamespace(groups=[1, 2]), cfg, 0)
    assert learner.batching == "untouched" and retry.snapshot.optimizer is None


def test_the_console_script_ends_a_run_that_cannot_fit_with_exit_code_7_and_one_line(tmp_path):
    """`dapo-train run --resume` of a one-step run under a fault no completion fits (10 positions): exit code 6,
    one line on stderr and in run.log, no traceback, checkpoint_1 left as it was."""
    import os
    import subprocess
    import sys

    out = tmp_path / "run"
    args = [sys.executable, "-m", "dapo_train", "run", *SMALL, f"output_dir={out}"]
    assert subprocess.run([*args, "train.max_steps=1"], capture_output=True, text=True, timeout=600).returncode == 0
    before = load_file(out / "checkpoint_1" / "model.safetensors")
    done = subprocess.run([*args, "train.max_steps=2", "--resume"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, UPDATE_TOKENS: "10"})
    assert done.returncode == 7, done.stderr
    assert "Traceback" not in done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("out of memory: step 2's update: one completion alone") and "checkpoint_1" in line
    assert line in (out / "run.log").read_text(encoding="utf-8")
    after = load_file(out / "checkpoint_1" / "model.safetensors")
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert [p.name for p in out.glob("checkpoint_*")] == ["checkpoint_1"]
