"""An out-of-memory error anywhere in a step ends well (train/update/out_of_memory.py, rollout/fitting.py and
train/loop.py), on the shipped tiny model with faults injected where a card would raise them (dapo_train/faults.py):
before a weight moves it is redone smaller and the step equals one run at the smaller size from the start (dropout
drawn the same), nothing generated twice, one line said, a resume keeping the size; where nothing can be redone (one
completion alone, an optimizer step, the weight sync) the run stops, exit code 7, at a checkpoint whose resume trains
the failed step's prompts. A step that does not fail copies nothing: the budget's largest micro-batch runs once."""

import logging
import re

import pytest
import torch
from safetensors.torch import load_file
from test_train import SMALL

from dapo_train.config.load import load_config
from dapo_train.errors import one_line_exits
from dapo_train.faults import (
    BACKWARD_TOKENS,
    DECODE_ROWS,
    OLD_LOGPROB_TOKENS,
    OPTIMIZER_STEP,
    SYNC_STEP,
    UPDATE_TOKENS,
)
from dapo_train.rollout import hf_engines
from dapo_train.run.logs import read_metrics
from dapo_train.run.rollouts import read_rollouts, rollouts_path
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


def _same_steps(a, b, weights: str = "model.safetensors", rel: float = 0.0) -> None:
    """Runs a and b made the same steps: their metrics and last weights equal to 1e-6 (and `rel`: micro-batches cut
    otherwise sum their gradients in another order)."""
    first, second = read_metrics(a), read_metrics(b)
    assert len(first) == len(second) and any(m.get("groups_kept") for m in first)
    for key in COMPARED:
        assert [m.get(key) for m in first] == pytest.approx([m.get(key) for m in second], abs=1e-6, rel=rel), key
    last = max(m["step"] for m in first)
    weights, expected = (load_file(d / f"checkpoint_{last}" / weights) for d in (a, b))
    for name in expected:
        torch.testing.assert_close(weights[name], expected[name], atol=1e-6, rtol=rel)


def _lowered(run_dir, step: int) -> dict:
    """The budgets checkpoint_<step> records as lowered out of memory: key -> (value, the value it replaced)."""
    state = torch.load(run_dir / f"checkpoint_{step}" / "trainer_state.pt", weights_only=False)
    return {entry["key"]: (entry["value"], entry["replaced"]) for entry in state["lowered_budgets"]}


def _halvings(caplog, where: str = "the update") -> list[tuple[int, int]]:
    """The lines that halved a budget: (positions of the micro-batch that failed, the budget it set), in order."""
    found = []
    for line in _lines(caplog, f"out of memory in {where}"):
        assert "\n" not in line and "no weight had moved" in line
        found.append(tuple(map(int, re.search(r"a micro-batch of \d+ completions, (\d+) positions, at "
                                              r"train.micro_batch_tokens=\d+\): redone .* at "
                                              r"train.micro_batch_tokens=(\d+),", line).groups())))
    return found


def test_an_update_out_of_memory_is_redone_at_half_the_micro_batch_and_equals_that_budget_from_the_start(
        tmp_path, monkeypatch, caplog, generated):
    """A micro-batch over 400 positions fails: at step 1, before any optimizer step, the budget's largest
    micro-batch (as many 48-token completions of the longest prompt, 166 tokens, as 1,024 positions hold) fails
    first, and the budget halves until it fits; step 2 runs at it. The run equals one begun at that budget."""
    monkeypatch.setenv(UPDATE_TOKENS, "400")
    with caplog.at_level(logging.INFO, logger="dapo_train"):
        failed = _run(tmp_path / "failed", "train.max_steps=2", "train.micro_batch_tokens=1024")
    halvings = _halvings(caplog)
    assert halvings and all(positions > 400 and budget == min(positions, 1024) // 2 for positions, budget in halvings)
    assert all(line.startswith("step 1: ") for line in _lines(caplog, "out of memory in the update"))
    halved = halvings[-1][1]
    assert _lowered(failed, 2) == {"train.micro_batch_tokens": (halved, 1024)}
    generated_once, generated[0] = generated[0], 0

    monkeypatch.delenv(UPDATE_TOKENS)
    smaller = _run(tmp_path / "smaller", "train.max_steps=2", f"train.micro_batch_tokens={halved}")
    _same_steps(failed, smaller)
    assert generated_once == generated[0] == sum(m["generated_tokens"] for m in read_metrics(smaller))

    # A resume keeps the smaller budget: under the same fault it fails nowhere (at 1,024 it would).
    monkeypatch.setenv(UPDATE_TOKENS, "400")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dapo_train"):
        _run(tmp_path / "failed", "train.max_steps=3", "train.micro_batch_tokens=1024", resume=True)
    assert _lines(caplog, f"train.micro_batch_tokens={halved}, as the checkpoint's run lowered it")
    assert not _lines(caplog, "out of memory in the update")
    assert _lowered(failed, 3) == {"train.micro_batch_tokens": (halved, 1024)}


LORA_DROPOUT = ("model.lora.r=4", "model.lora.alpha=8", "model.lora.dropout=0.3", "train.learning_rate=1e-3",
                "dapo.old_logprobs=rollout", "dapo.rollout_correction=off")


def test_out_of_memory_inside_the_backward_is_redone_and_draws_the_dropout_of_a_run_at_that_budget(
        tmp_path, monkeypatch, caplog):
    """The fault raised inside autograd's backward, once every layer has left its gradients: the redo drops them
    and draws LoRA's dropout from the random state the update began with, so the run equals one begun at the
    smaller budget, dropout on (without the restore the failed forward's draws would shift every later one)."""
    monkeypatch.setenv(BACKWARD_TOKENS, "400")
    with caplog.at_level(logging.INFO, logger="dapo_train"):
        failed = _run(tmp_path / "failed", "train.max_steps=2", "train.micro_batch_tokens=1024", *LORA_DROPOUT)
    halved = _halvings(caplog)[-1][1]
    monkeypatch.delenv(BACKWARD_TOKENS)
    smaller = _run(tmp_path / "smaller", "train.max_steps=2", f"train.micro_batch_tokens={halved}", *LORA_DROPOUT)
    _same_steps(failed, smaller, weights="adapter_model.safetensors")


def test_a_redo_draws_the_dropout_a_run_at_the_smaller_budget_draws(tmp_path, monkeypatch, caplog):
    """Step 1's second micro-batch fails once, after the first one's forward drew LoRA's dropout: the redo starts
    from the random state the update began with, so the run equals one begun at the smaller budget; without
    that, the first micro-batch's draws of the failed try would shift every draw after them."""
    original, calls = update_module._micro_batch_backward, []

    def failing_once(learner, micro, *args):
        if bool(micro.advantages.abs().sum()):  # a micro-batch of the step's groups, not the guard's probe
            calls.append(micro.batch.forward_tokens)
            if len(calls) == 2:
                raise torch.OutOfMemoryError("a fault of this test")
        return original(learner, micro, *args)

    monkeypatch.setattr(update_module, "_micro_batch_backward", failing_once)
    with caplog.at_level(logging.INFO, logger="dapo_train"):  # a mini-batch's 4 completions in 2 micro-batches
        failed = _run(tmp_path / "failed", "train.max_steps=2", "train.micro_batch_size=2", *LORA_DROPOUT)
    [line] = _lines(caplog, "out of memory in the update")
    assert "a micro-batch of 2 completions" in line and "redone on the same groups at train.micro_batch_size=1" in line
    monkeypatch.setattr(update_module, "_micro_batch_backward", original)
    smaller = _run(tmp_path / "smaller", "train.max_steps=2", "train.micro_batch_size=1", *LORA_DROPOUT)
    _same_steps(failed, smaller, weights="adapter_model.safetensors")


def test_out_of_memory_in_the_old_log_prob_pass_is_redone_smaller(tmp_path, monkeypatch, caplog):
    """The old-log-prob pass (no gradient, before the update) over 300 positions fails: it is redone at half its
    failing micro-batch, no weight having moved, and the run equals one begun at the budget it ends at."""
    monkeypatch.setenv(OLD_LOGPROB_TOKENS, "300")
    recompute = "dapo.old_logprobs=recompute"  # on a CPU the rollout is the training forward: no pass by default
    with caplog.at_level(logging.INFO, logger="dapo_train"):
        failed = _run(tmp_path / "failed", "train.max_steps=2", "train.micro_batch_tokens=1024", recompute)
    halvings = _halvings(caplog, "the old-log-prob pass")
    assert halvings and all(line.startswith("step 1: ") for line in _lines(caplog, "old-log-prob pass"))
    halved = halvings[-1][1]
    assert _lowered(failed, 2) == {"train.micro_batch_tokens": (halved, 1024)} and halved < 1024
    monkeypatch.delenv(OLD_LOGPROB_TOKENS)
    _same_steps(failed, _run(tmp_path / "smaller", "train.max_steps=2", f"train.micro_batch_tokens={halved}",
                             recompute))


def test_a_step_that_does_not_fail_copies_nothing_and_the_budgets_largest_micro_batch_runs_once(tmp_path):
    """The guard's cost: the largest micro-batch of the budget, once, at the first step; none after (every
    micro-batch of the run is no larger); the training equals a run without it (the probe's gradient dropped)."""
    run = _run(tmp_path / "run", "train.max_steps=3", "train.micro_batch_tokens=1024")
    rows = [m for m in read_metrics(run) if m["step"] > 0]
    assert [m["update_probes"] for m in rows] == [1, 0, 0]
    assert 900 < rows[0]["update_probe_positions"] <= 1024  # 48-token completions of the longest prompt in 1,024
    assert [m["update_probe_positions"] for m in rows[1:]] == [0, 0]


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


def _stopped(out, capsys, *extra) -> str:
    """A run that must stop out of memory: exit code 7, no traceback. -> its last line on stderr."""
    with pytest.raises(SystemExit) as ended, one_line_exits(debug=False):
        _run(out, *extra)
    assert ended.value.code == 7
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def _step_rollouts(run_dir, step: int) -> list[tuple]:
    """What step `step` generated and trained: every sampled completion's prompt, text and reward."""
    return [(r["uid"], r["completion"], r["reward"]) for r in read_rollouts(rollouts_path(run_dir, step))]


def _resumes_into_the_failed_step(tmp_path, stopped, steps: int, failed_step: int, rel: float = 0.0) -> None:
    """The stopped run, resumed without the fault, is the uninterrupted run from the failed step on: its step
    generates the same completions (the same prompts, carried-over groups and random state) and trains alike (to
    `rel` where the stop lowered the budget: _same_steps)."""
    _run(stopped, f"train.max_steps={steps}", "dapo.dynamic_sampling=false", resume=True)
    whole = _run(tmp_path / "whole", f"train.max_steps={steps}", "dapo.dynamic_sampling=false")
    for step in range(failed_step, steps + 1):
        assert _step_rollouts(stopped, step) == _step_rollouts(whole, step)
    _same_steps(stopped, whole, rel=rel)


def test_a_completion_that_cannot_fit_alone_stops_the_run_at_its_last_good_step(tmp_path, monkeypatch, capsys):
    """From step 2 on every micro-batch fails: the update halves down to one completion, then the run stops
    with checkpoint_1 (the weights step 1 left, at step 2's data position), one line, exit code 7; its resume
    trains step 2's prompts as the uninterrupted run does."""
    original = update_module._micro_batch_backward

    def failing_after_step_1(learner, *args):
        if learner.optimizer.steps >= 2:  # step 1's two optimizer steps are done
            raise torch.OutOfMemoryError("a fault of this test")
        return original(learner, *args)

    monkeypatch.setattr(update_module, "_micro_batch_backward", failing_after_step_1)
    stopped = tmp_path / "stopped"
    line = _stopped(stopped, capsys, "train.max_steps=3", "dapo.dynamic_sampling=false")
    assert line.startswith("out of memory: step 2's update: one completion alone")
    assert "model.gradient_checkpointing=on" in line and "checkpoint_1 holds the last good step" in line
    assert [p.name for p in stopped.glob("checkpoint_*")] == ["checkpoint_1"]
    monkeypatch.setattr(update_module, "_micro_batch_backward", original)
    _resumes_into_the_failed_step(tmp_path, stopped, steps=3, failed_step=2, rel=1e-5)  # at micro_batch_size 1


def test_an_optimizer_step_out_of_memory_stops_at_the_last_good_step_and_the_resume_trains_the_failed_step(
        tmp_path, monkeypatch, capsys):
    """Step 2's first optimizer step (the run's third: 2 a step) runs out of memory before it moves anything: no
    budget lowers an optimizer step, so the run stops at checkpoint_1, the weights step 1 left at step 2's data
    position and random state; resumed, it trains step 2's prompts as the uninterrupted run does."""
    monkeypatch.setenv(OPTIMIZER_STEP, "2")
    stopped = tmp_path / "stopped"
    line = _stopped(stopped, capsys, "train.max_steps=3", "dapo.dynamic_sampling=false")
    assert line.startswith("out of memory: step 2's optimizer step: AdamW's step does not fit")
    assert "LoRA (model.lora.r > 0)" in line and "checkpoint_1 holds the last good step" in line
    assert [p.name for p in stopped.glob("checkpoint_*")] == ["checkpoint_1"]
    monkeypatch.delenv(OPTIMIZER_STEP)
    _resumes_into_the_failed_step(tmp_path, stopped, steps=3, failed_step=2)


def test_out_of_memory_after_a_weight_moved_keeps_the_last_checkpoint_on_disk_and_says_what_is_lost(
        tmp_path, monkeypatch, capsys):
    """Step 3's second optimizer step fails after its first moved the weights: nothing of step 3's start is kept
    (no host copy), so no checkpoint is written from the moved weights; the line names the last one on disk and
    the steps that train again."""
    monkeypatch.setenv(OPTIMIZER_STEP, "5")  # step 3's second: 2 optimizer steps a step
    stopped = tmp_path / "stopped"
    line = _stopped(stopped, capsys, "train.max_steps=4", "dapo.dynamic_sampling=false", "checkpoint.every_steps=1")
    assert "the step had moved the weights, so step 2's are gone" in line
    assert "checkpoint_2, the last checkpoint saved, holds step 2" in line
    assert sorted(p.name for p in stopped.glob("checkpoint_*")) == ["checkpoint_1", "checkpoint_2"]
    monkeypatch.setenv(OPTIMIZER_STEP, "3")  # step 2's second, with no checkpoint since the start
    line = _stopped(tmp_path / "unsaved", capsys, "train.max_steps=4", "dapo.dynamic_sampling=false")
    assert "no checkpoint saved" in line and not list((tmp_path / "unsaved").glob("checkpoint_*"))


def test_a_weight_sync_out_of_memory_keeps_the_trained_step_and_the_resume_goes_on_from_it(
        tmp_path, monkeypatch, capsys):
    """The engine runs out of memory taking step 2's weights (vllm loading them on a card): step 2 trained, so it
    is logged and saved (checkpoint_2), exit code 7; resumed, step 3 is the uninterrupted run's step 3."""
    monkeypatch.setenv(SYNC_STEP, "2")
    stopped = tmp_path / "stopped"
    line = _stopped(stopped, capsys, "train.max_steps=3", "dapo.dynamic_sampling=false")
    assert line.startswith("out of memory: the rollout engine ran out of memory taking step 2's weights")
    assert "checkpoint_2 holds step 2, trained" in line
    assert [m["step"] for m in read_metrics(stopped)] == [1, 2]
    monkeypatch.delenv(SYNC_STEP)
    _resumes_into_the_failed_step(tmp_path, stopped, steps=3, failed_step=3)


def test_with_several_processes_an_out_of_memory_update_is_not_redone(monkeypatch):
    """OutOfMemoryGuard(enabled=False), as session.setup builds it under several processes: the error goes on, no
    budget is halved, nothing is probed."""
    from types import SimpleNamespace

    from dapo_train.train.update import out_of_memory
    from dapo_train.train.update.batching import MicroBatchOutOfMemory

    def failing(learner, batch, plan):
        raise MicroBatchOutOfMemory(4, 900)

    monkeypatch.setattr(out_of_memory, "update_with_plan", failing)
    monkeypatch.setattr(out_of_memory.ranks, "plan_update", lambda *args: "plan")
    guard = out_of_memory.OutOfMemoryGuard(enabled=False)
    learner = SimpleNamespace(batching="untouched", optimizer=SimpleNamespace(steps=0))
    with pytest.raises(MicroBatchOutOfMemory):
        guard.update(learner, SimpleNamespace(groups=[1, 2]), load_config(None, []), 0)
    assert learner.batching == "untouched" and guard.fitted == []


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
