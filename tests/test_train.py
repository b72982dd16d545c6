"""End to end on the shipped tiny model: exact resume, graceful signals, non-finite steps."""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from dapo_train import cli
from dapo_train.algo import objectives
from dapo_train.config.load import load_config
from dapo_train.errors import TaskSolved, TrainingAborted
from dapo_train.run.logs import read_metrics
from dapo_train.run.signals import StopRequested
from dapo_train.train import loop
from dapo_train.train.collect import screen
from dapo_train.train.loop import train

MODEL = "builtin:tiny"

# Small, float32, deterministic steps: 2 prompts x G=4, short completions, no eval.
SMALL = [
    f"model.name_or_path={MODEL}", "rollout.group_size=4", "rollout.max_new_tokens=48", "train.prompts_per_step=2",
    "train.micro_batch_size=4", "train.updates_per_step=2", "eval.every_steps=0", "train.deterministic=true",
    "train.num_threads=1",
    "rewards=[{name: accuracy}, {name: overlong, args: {cache_length: 16}}]", "logging.progress_bar=false",
    "eval.final_full=false",  # the end-of-run eval on all 500 items is tested in tests/run/test_eval_items.py
]


def _run(out, *extra, resume=None):
    cfg = load_config(None, [*SMALL, f"output_dir={out}", *extra])
    return train(cfg, resume=resume)


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    straight = _run(tmp_path / "straight", "train.max_steps=6")
    _run(tmp_path / "split", "train.max_steps=3")
    resumed = _run(tmp_path / "split", "train.max_steps=6", resume=True)
    a, b = read_metrics(straight), read_metrics(resumed)
    assert [m["step"] for m in b] == [1, 2, 3, 4, 5, 6]  # resumed logs continue, no duplicate rows
    assert any(m.get("groups_kept", 0) > 0 for m in a)  # there were real updates to reproduce
    for key in ("loss", "reward_mean", "groups_kept", "completion_length_mean"):
        assert [m.get(key) for m in a] == pytest.approx([m.get(key) for m in b], abs=1e-6), key
    final_a = load_file(straight / "checkpoint_6" / "model.safetensors")
    final_b = load_file(resumed / "checkpoint_6" / "model.safetensors")
    for name in final_a:
        torch.testing.assert_close(final_a[name], final_b[name], atol=1e-5, rtol=0)


def test_eps_high_changes_the_weights_and_the_clip_fires(tmp_path, caplog):
    """Two updates per rollout batch: the second trains on completions of the policy before the
    first, so eps_high moves the weights and clip_frac_high is non-zero somewhere; the run does not
    warn that the clip cannot act. With one update per batch it warns, naming the key. The tight bound,
    0.02, is one the second update's ratios cross at seed 0 (at 0.1 they stayed below it in these 4 steps
    once the CPU's token draw changed its random stream)."""
    runs = {eps: _run(tmp_path / f"eps{eps}", "train.max_steps=4", f"dapo.eps_high={eps}") for eps in (0.02, 0.5)}
    weights = [load_file(run / "checkpoint_4" / "model.safetensors") for run in runs.values()]
    assert any(not torch.equal(weights[0][name], weights[1][name]) for name in weights[0])
    rows = read_metrics(runs[0.02])
    assert any(row.get("clip_frac_high", 0) > 0 for row in rows)
    assert all(row["optimizer_steps"] == min(2, row["groups_kept"]) for row in rows if "loss" in row)
    assert any(row["optimizer_steps"] == 2 for row in rows)
    assert "cannot act" not in caplog.text
    _run(tmp_path / "one", "train.max_steps=1", "train.updates_per_step=1")
    assert "dapo.eps_low / dapo.eps_high cannot act" in caplog.text and "train.updates_per_step > 1" in caplog.text


def test_sigterm_saves_a_checkpoint_and_says_how_to_resume(tmp_path):
    out = tmp_path / "run"
    args = [*SMALL, f"output_dir={out}", "train.max_steps=200"]
    proc = subprocess.Popen([sys.executable, "-m", "dapo_train", "run", *args], stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text():
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "--resume" in stderr
    checkpoints = sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint_"))
    assert len(checkpoints) == 1
    step = int(checkpoints[0].split("_")[1])
    assert 1 <= step < 200
    assert read_metrics(out)[-1]["step"] == step  # the checkpoint matches the last logged step


def test_a_hangup_saves_a_checkpoint_and_writes_the_resume_line_to_the_run_log(tmp_path):
    """Issue 59, item 6: a SIGHUP (the terminal closed, the SSH session dropped) killed the run at once: no
    checkpoint, no line in run.log, the steps since the last save lost. It is a stop as SIGTERM is: the step ends,
    the checkpoint is written, run.log says how to resume, and the status is 128 + SIGHUP = 129."""
    out = tmp_path / "run"
    args = [*SMALL, f"output_dir={out}", "train.max_steps=200"]
    # a terminal's session hands its processes SIGHUP's default action (a test runner may have it ignored)
    proc = subprocess.Popen([sys.executable, "-m", "dapo_train", "run", *args], stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    deadline = time.time() + 240
    while time.time() < deadline and not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text():
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.5)
    proc.send_signal(signal.SIGHUP)
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 129, stderr
    checkpoints = sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint_"))
    assert len(checkpoints) == 1 and read_metrics(out)[-1]["step"] == int(checkpoints[0].split("_")[1]), checkpoints
    assert f"stopped early; resume with: dapo-train run --resume {out}" in (out / "run.log").read_text()


@pytest.mark.skipif(shutil.which("tee") is None, reason="needs tee, as in `dapo-train run ... 2>&1 | tee log`")
def test_ctrl_c_of_a_run_piped_into_tee_still_saves_and_writes_the_resume_command_to_the_run_log(tmp_path):
    """`dapo-train run ... 2>&1 | tee log`, then Ctrl-C: the terminal sends SIGINT to the whole foreground
    group, so tee dies with it and every later write to the console meets a pipe without a reader. The run
    still finishes its step, saves, exits 130, and its run.log holds the resume command. Before the fix the
    progress bar's next write raised BrokenPipeError: no checkpoint, exit code 1."""
    out, log = tmp_path / "run", tmp_path / "log"
    args = [*(a for a in SMALL if not a.startswith("logging.progress_bar")), f"output_dir={out}", "train.max_steps=200"]
    shell = {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}  # a user's: buffered
    run = subprocess.Popen([sys.executable, "-m", "dapo_train", "run", *args], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, process_group=0, env=shell)
    # Ctrl-C's default action, as a terminal's foreground job has it, whatever this test's process inherited
    tee = subprocess.Popen(["tee", str(log)], stdin=run.stdout, stdout=subprocess.DEVNULL, process_group=run.pid,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    run.stdout.close()  # tee is the pipe's only reader, as in the shell's pipeline
    deadline = time.time() + 240
    while time.time() < deadline and not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text():
        assert run.poll() is None, log.read_text()[-3000:]
        time.sleep(0.5)
    os.killpg(run.pid, signal.SIGINT)  # Ctrl-C: the run and tee together
    assert tee.wait(timeout=60) == -signal.SIGINT, (run.poll(), log.read_text()[-3000:])  # tee read to the end: why
    assert run.wait(timeout=240) == 128 + signal.SIGINT
    checkpoints = [p.name for p in out.iterdir() if p.name.startswith("checkpoint_")]
    assert checkpoints == [f"checkpoint_{read_metrics(out)[-1]['step']}"]  # the last logged step, saved
    run_log = (out / "run.log").read_text()
    assert run_log.strip().splitlines()[-1] == f"stopped early; resume with: dapo-train run --resume {out}", run_log


def test_non_finite_losses_skip_updates_then_abort_naming_the_last_good_checkpoint(tmp_path, monkeypatch, capsys):
    """Two clean steps (a checkpoint after each), then every loss NaN from step 3's second update on:
    steps 3 and 4 are skipped, step 3's checkpoint is not saved from the suspect weights (its first
    update applied), and train.max_bad_steps=2 stops the run at step 4 naming checkpoint_2; the summary
    says how it ended and counts the skipped steps."""
    _poison_calls(monkeypatch, set(range(6, 100)))
    out = tmp_path / "nan"
    with pytest.raises(TrainingAborted, match=rf"step 4: 2 non-finite steps since step 2.*the last good checkpoint is "
                                              rf"{out / 'checkpoint_2'} \(the weights since were not saved\)"):
        _run(out, "train.max_steps=50", "train.max_bad_steps=2", "dapo.dynamic_sampling=false",
             "checkpoint.every_steps=1")
    rows = read_metrics(out)
    assert [r["skipped_nonfinite"] for r in rows] == [0, 0, 1, 1]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint_")) == ["checkpoint_1", "checkpoint_2"]
    summary = capsys.readouterr().out
    assert f"aborted {out} at step 4 of 50" in summary
    assert "skipped steps: 2 non-finite (loss or grad norm), 0 without an informative group, of 4" in summary


def _poison_calls(monkeypatch, poisoned_calls: set[int], then=None) -> None:
    """The objective's loss is NaN at the given calls (1-based; 2 updates per step, one micro-batch
    each: calls 3 and 4 are step 2's), and `then` runs at the first of them. The out-of-memory guard's probe
    (train/update/out_of_memory.py, at step 1) is no call of the update's."""
    from dapo_train.train.update.out_of_memory import OutOfMemoryGuard

    real, calls, probing = objectives.policy_loss, [], []
    probe = OutOfMemoryGuard._probe

    def counted_probe(self, *args, **kwargs):
        probing.append(True)
        try:
            return probe(self, *args, **kwargs)
        finally:
            probing.pop()

    def poisoned(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        if probing:
            return loss, metrics
        calls.append(1)
        if len(calls) in poisoned_calls and then is not None and len(calls) == min(poisoned_calls):
            then()
        return (loss * float("nan") if len(calls) in poisoned_calls else loss), metrics

    monkeypatch.setattr(objectives, "policy_loss", poisoned)
    monkeypatch.setattr(OutOfMemoryGuard, "_probe", counted_probe)


def test_a_non_finite_first_update_leaves_clean_weights_that_are_saved_and_its_groups_untrained(tmp_path, monkeypatch):
    """Step 2's first mini-batch is NaN, so no optimizer step of it applied: the weights are step 1's,
    not suspect. The run reaches train.max_steps and saves them (it used to abort, saving nothing), and
    step 2's groups are recorded as skipped by the update, not trained."""
    _poison_calls(monkeypatch, {3})
    out = tmp_path / "first"
    _run(out, "train.max_steps=2", "dapo.dynamic_sampling=false", "checkpoint.every_steps=1")
    assert [row["skipped_nonfinite"] for row in read_metrics(out)] == [0, 1]
    first, last = (load_file(out / f"checkpoint_{step}" / "model.safetensors") for step in (1, 2))
    assert all(torch.equal(first[name], last[name]) for name in first)
    fates = {step: {json.loads(line)["fate"] for line in (out / "rollouts" / f"step_{step}.jsonl").open()}
             for step in (1, 2)}
    assert fates == {1: {"trained"}, 2: {"update_skipped"}}


def test_a_stop_after_suspect_weights_saves_none_and_keep_last_keeps_the_good_one(tmp_path, monkeypatch):
    """Step 2's first update applies and its second is NaN (the weights are suspect); a stop comes during
    it. Nothing is saved from them, so with checkpoint.keep_last=1 checkpoint_1 stays the result (the
    stop used to save checkpoint_2 and prune checkpoint_1)."""
    stop = StopRequested()
    _poison_calls(monkeypatch, {4}, then=lambda: stop.request(signal.SIGTERM))
    out = tmp_path / "suspect"
    cfg = load_config(None, [*SMALL, f"output_dir={out}", "train.max_steps=50", "dapo.dynamic_sampling=false",
                             "checkpoint.every_steps=1", "checkpoint.keep_last=1"])
    train(cfg, stop=stop)
    assert [row["step"] for row in read_metrics(out)] == [1, 2]
    assert [p.name for p in out.iterdir() if p.name.startswith("checkpoint_")] == ["checkpoint_1"]
    assert torch.load(out / "checkpoint_1" / "trainer_state.pt", weights_only=True)["good"] is True


def test_a_run_whose_model_answers_everything_stops_solved_with_exit_5_and_its_checkpoint(tmp_path, monkeypatch):
    """Every completion scored correct (and rewarded alike): no group is informative, every one all right,
    so after train.max_starved_steps=2 such steps the run stops solved (TaskSolved, exit code 5, never 3)
    and saves its weights as the result; the CLI maps it to exit code 5 and one line."""
    real = screen.score

    def all_correct(*args, **kwargs):
        scores = real(*args, **kwargs)
        return dataclasses.replace(scores, total=[1.0] * len(scores.total), correct=[True] * len(scores.correct))

    monkeypatch.setattr(screen, "score", all_correct)
    out = tmp_path / "solved"
    with pytest.raises(TaskSolved, match=rf"step 2: the model answers every prompt correctly: in the last 2 steps, "
                                         rf"all 4 completions of each of 4 groups were right.*the result is "
                                         rf"{out / 'checkpoint_2'}$") as raised:
        _run(out, "train.max_steps=50", "train.max_starved_steps=2", "dapo.max_gen_rounds=1")
    assert raised.value.exit_code == 5 and (out / "checkpoint_2" / "model.safetensors").is_file()
    monkeypatch.setattr(loop, "train", lambda *args, **kwargs: (_ for _ in ()).throw(raised.value))
    monkeypatch.setattr(sys, "argv", ["dapo-train", "run", f"output_dir={tmp_path / 'cli'}"])
    with pytest.raises(SystemExit) as exited:
        cli.main()
    assert exited.value.code == 5


def test_a_diverging_run_exits_3_within_the_bound_and_saves_none_of_it(tmp_path):
    """train.learning_rate=1e10: step 1's first update overflows the weights and its second is NaN, then every
    completion is truncated alike (no informative group). The run stops after train.max_starved_steps=2 starved
    steps with exit code 3 and one line saying there is no good checkpoint; nothing of it is saved."""
    out = tmp_path / "diverged"
    done = subprocess.run(
        [sys.executable, "-m", "dapo_train", "run", *SMALL, "train.learning_rate=1e10", "train.max_steps=50",
         "train.max_starved_steps=2", f"output_dir={out}"], capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 3, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("aborted: step 3: 2 steps in a row without an informative group"), last
    assert "after 1 non-finite step(s)" in last and "no checkpoint holds weights from before it" in last, last
    rows = read_metrics(out)
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert [row["rollout_tokens"] for row in rows[1:]] == [0, 0] and rows[2]["rollout_kl"] is None  # no update
    assert not any(p.name.startswith("checkpoint_") for p in out.iterdir())
    assert f"aborted {out} at step 3 of 50" in done.stdout
    assert "skipped steps: 1 non-finite (loss or grad norm), 2 without an informative group, of 3" in done.stdout


def test_a_short_seeded_demo_run_learns(tmp_path):
    """The tiny demo's settings for 10 steps: greedy accuracy on the 100 fixed eval items must rise
    by at least 5 points from the warm start (the full 40-step demo is measured in docs/benchmarks.md),
    and the end-of-run eval on all 500 test items must beat the warm start's 0.238 on them
    (build_info.json) by 3."""
    cfg = load_config(None, [f"output_dir={tmp_path / 'demo'}", "train.max_steps=10", "eval.every_steps=10",
                             "logging.progress_bar=false", "eval.print_samples=0"])
    run_dir = train(cfg)
    rows = [line.split(",") for line in (run_dir / "accuracy_losses.txt").read_text().split()]
    (step0, before), (step10, after) = [(int(s), float(a)) for s, a in rows]
    assert (step0, step10) == (0, 10)
    assert after >= before + 0.05, (before, after)
    last = read_metrics(run_dir)[-1]
    assert last["final/num_items"] == 500 and last["final_accuracy"] >= 0.238 + 0.03, last["final_accuracy"]


def test_a_run_with_the_tiny_verifier_trains_logs_its_reward_and_moves_other_weights(tmp_path, monkeypatch):
    """The rule rewards plus builtin:tiny-verifier: the verifier loads once, each step logs its mean and
    its seconds, the evals log its mean score on their items and keep each item's score, and the
    weights end elsewhere than the rule-only run's (same seed, same prompts)."""
    from transformers import AutoModelForSequenceClassification

    loads = []
    original = AutoModelForSequenceClassification.from_pretrained
    monkeypatch.setattr(AutoModelForSequenceClassification, "from_pretrained",
                        lambda *a, **k: loads.append(a[0]) or original(*a, **k))
    verifier = "{name: reward_model, weight: 2.0, args: {path: builtin:tiny-verifier, normalize: sigmoid}}"
    rules = "{name: accuracy}, {name: overlong, args: {cache_length: 16}}"
    schedule = ["train.max_steps=2", "eval.every_steps=2", "eval.num_items=4"]
    both = _run(tmp_path / "both", *schedule, f"rewards=[{rules}, {verifier}]")
    assert len(loads) == 1  # once per run, not per round or per eval
    rule_only = _run(tmp_path / "rules", *schedule)
    rows = read_metrics(both)
    steps = [row for row in rows if row["step"] > 0]
    assert all(0 < row["rewards/reward_model/mean"] < 1 and row["seconds_reward_model"] > 0 for row in steps)
    assert all(0 < row["eval/rewards/reward_model/mean"] < 1 for row in (rows[0], rows[-1]))
    items = (both / "eval_items" / "step_2.jsonl").read_text().splitlines()
    assert len(items) == 4 and all(0 < json.loads(line)["scores"]["reward_model"] < 1 for line in items)
    assert "rewards/reward_model/mean" not in read_metrics(rule_only)[-1]
    a = load_file(both / "checkpoint_2" / "model.safetensors")
    b = load_file(rule_only / "checkpoint_2" / "model.safetensors")
    assert any(not torch.equal(a[name], b[name]) for name in a)


# The run, with a real SIGTERM sent to itself as the end-of-run eval decodes its first chunk of items (the only
# eval of a run with eval.every_steps=0; the rollout decodes through its engine's own import); it prints whether
# the final checkpoint was on disk at that moment.
SIGTERM_IN_THE_FINAL_EVAL = """
import os, signal, sys
from pathlib import Path
from dapo_train import cli
from dapo_train.evaluation import generate

real_decode = generate.decode_loop
out = Path(sys.argv[-1].split("=", 1)[1])

def decode(*args, **kwargs):
    if not (out.parent / "sent").exists():
        (out.parent / "sent").write_text(str((out / "checkpoint_1").is_dir()))
        os.kill(os.getpid(), signal.SIGTERM)
    return real_decode(*args, **kwargs)

generate.decode_loop = decode
sys.argv = ["dapo-train", *sys.argv[1:]]
cli.main()
"""


def test_a_sigterm_during_the_final_eval_ends_it_after_the_checkpoint_and_points_at_the_eval_command(tmp_path):
    """The steps are all done and checkpoint_1 is saved before the whole-split eval starts (a scheduler's
    SIGKILL after its grace period keeps the weights); a SIGTERM during that eval ends it at the next chunk of
    items, records none of it, says the training finished, and names `dapo-train eval` of the checkpoint, not a
    resume; the exit status is still 143, the signal's (the eval it asked for was cut short). Before the fix the
    eval ran to its 500th item, the checkpoint came after it, and the run said `stopped ... at step 1 of 1` and
    `resume with`."""
    out = tmp_path / "run"
    args = ["run", *(a for a in SMALL if not a.startswith("eval.final_full")), "train.max_steps=1",
            "eval.batch_size=4", "logging.rollout_groups=0", f"output_dir={out}"]
    done = subprocess.run([sys.executable, "-c", SIGTERM_IN_THE_FINAL_EVAL, *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-3000:]
    assert (tmp_path / "sent").read_text() == "True"  # saved before the eval began
    assert (out / "checkpoint_1" / "model.safetensors").is_file()
    assert f"finished {out}: 1 steps" in done.stdout and "stopped" not in done.stdout
    assert "resume" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last == (f"SIGTERM: the training finished and its last checkpoint is {out / 'checkpoint_1'}; the final "
                    f"eval was stopped, nothing of it recorded; evaluate the checkpoint with: dapo-train eval "
                    f"{out / 'checkpoint_1'}"), last
    assert "SIGTERM received: ending the final eval" in done.stderr
    assert (out / "run.log").read_text().strip().splitlines()[-1] == last
    row = read_metrics(out)[-1]
    assert row["step"] == 1 and "final_accuracy" not in row  # no accuracy of a cut-short eval
    assert not (out / "eval_items" / "final_1.jsonl").exists()
