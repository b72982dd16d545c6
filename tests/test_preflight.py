"""`dapo-train preflight` on every shipped Qwen config, offline: Qwen2.5-Instruct's real tokenizer rebuilt
from its BPE ranks and its config files (scripts/build/qwen_offline.py, no weights), and a parquet folder shaped
like swulling/gsm8k_chinese. Each rehearsal must end "ready" having run an update with a non-zero
gradient, evals, a checkpoint, a resume and an export; bad input must end in one line naming it."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dapo_train.config.load import load_config
from dapo_train.errors import UserError
from dapo_train.model.loading import cpu_has_bf16_units
from dapo_train.preflight.command import preflight

import qwen_offline

ROOT = Path(__file__).resolve().parent.parent
GSM8K = ROOT / "data" / "gsm8k" / "test.jsonl"


@pytest.fixture(scope="module")
def offline(tmp_path_factory, qwen_folder):
    """(Qwen2.5-1.5B-Instruct folder, Qwen2.5-7B-Instruct folder, GSM8K-zh-shaped data folder)."""
    root = tmp_path_factory.mktemp("offline")
    small = qwen_folder
    large = root / "Qwen2.5-7B-Instruct"
    shutil.copytree(small, large)
    qwen_offline.write_model_configs(large, "7b")  # the same tokenizer, the 7B's config.json
    return small, large, qwen_offline.build_gsm8k_zh_folder(root / "gsm8k_chinese", GSM8K)


@pytest.fixture
def threads():
    """preflight sets torch's threads as a run would (1 for the rehearsal on a CPU): put them back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _config(name: str, model: Path, data: Path, *overrides: str):
    return load_config(str(ROOT / "configs" / f"{name}.yaml"), [f"model.name_or_path={model}", f"data.path={data}",
                                                               *overrides])


def _rows(text: str) -> dict[str, str]:
    """The report's rows from its "preflight" row on: label -> its text, wrapped lines joined by spaces."""
    lines = text.splitlines()
    rows: dict[str, str] = {}
    for line in lines[next(i for i, line in enumerate(lines) if line.startswith("preflight ")):]:
        if line.strip() and not line.startswith(" "):
            label, _, rest = line.partition("  ")
            assert label not in rows, f"row {label!r} twice"
            rows[label] = rest.strip()
        elif line.strip():
            rows[label] += " " + line.strip()
    return rows


def _assert_ready(text: str, embeddings: str) -> None:
    """Each finding in the row that reports it: the phases in order, ending "ready"; both EOS ids read and both
    ending completions; three steps, one or more with a non-zero gradient, the resume; the data's counts."""
    rows = _rows(text)
    order = ["preflight", "model", "data", "prompt", "rehearsal", "rollout", "train", "memory", "phases", "ready"]
    assert [label for label in rows if label in order] == order and list(rows)[-1] == "ready", text
    assert f"vocabulary 151,936 (tokenizer 151,665), {embeddings} embeddings" in rows["model"], rows["model"]
    assert "EOS 151645 <|im_end|>, 151643 <|endoftext|>;" in rows["model"], rows["model"]
    assert "test: 319 rows, 318 prompts kept" in rows["data"] and "1 too long" in rows["data"], rows["data"]
    assert "<|im_start|>assistant" in rows["prompt"], rows["prompt"]
    ended = re.search(r"ended by <\|im_end\|> (\d+), <\|endoftext\|> (\d+)", rows["rollout"])
    assert ended and min(map(int, ended.groups())) > 0, rows["rollout"]  # both EOS ids stop completions
    trained = re.match(r"(\d+) steps \((\d+) with a non-zero gradient, grad norm ([^)]+)\)", rows["train"])
    assert trained and trained[1] == "3" and 1 <= int(trained[2]) <= 3 and float(trained[3]) > 0, rows["train"]
    assert "checkpoint_2 resumed to step 3" in rows["train"], rows["train"]
    peak = re.search(r"estimated peak on [^:]+: ([\d.]+) GiB", rows["memory"])
    assert peak and float(peak[1]) > 0, rows["memory"]
    timed = dict(re.findall(r"([a-z ]+) ([\d.]+)s(?:, |$)", rows["phases"]))
    assert {"read", "data", "rehearsal model", "rollout check", "train", "resume", "export"} <= set(timed), timed


def test_the_shipped_qwen_job_is_ready_from_the_command_line(offline, tmp_path):
    model, _, data = offline
    result = subprocess.run(
        [sys.executable, "-m", "dapo_train", "preflight", str(ROOT / "configs" / "qwen1.5b.yaml"),
         f"model.name_or_path={model}", f"data.path={data}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr
    _assert_ready(result.stdout + "\n", "tied")
    flat = " ".join(result.stdout.split())
    assert "train.max_steps 150 -> 2" in flat and "rollout.max_new_tokens 512 -> 16" in flat
    assert "disk one checkpoint about 18.5 GB" in flat and "3 at once" in flat  # the real model's, not the rehearsal's
    # auto on each card: 24 GB holds no budget (float32 weights, gradients, AdamW state and the bf16 rollout copy, 18
    # bytes x 1.54e9 parameters = 25.9 GiB, are over 24e9 x 0.9; AdamW's fused step adds nothing); 48 and 80 GB
    # hold the whole mini-batch: 2 groups x (8 x 512 + a prompt of at most 256) = at most 8,704 tokens, rounded up
    # to 9,216
    assert "train.micro_batch_tokens=auto would choose" in flat and "24 GB none fits (the optimizer step moment " \
        "alone: 25.9 GiB), 48 GB 9,216 (a whole mini-batch), 80 GB 9,216 (a whole mini-batch)" in flat
    assert "at train.micro_batch_tokens=9216 (auto on a 48 GB card)" in flat
    # the rehearsal's own 16-token budget cuts its random model's answers: no advice to raise the real budget
    assert "the token budget cut" not in flat and "raise rollout.max_new_tokens" not in flat
    # nor about its own 2 steps on 4 eval items, where the real run's regression stop could not act
    assert "eval.stop_on_regression True -> False" in flat and "stop_on_regression cannot act" not in flat
    assert not list(tmp_path.glob("dapo-preflight-*"))  # the rehearsal's folder is removed afterwards


@pytest.mark.parametrize("name", ["qwen1.5b-seed", "qwen1.5b-lora", "qwen1.5b-paper"])
def test_each_qwen_config_is_ready(offline, tmp_path, threads, name):
    model, _, data = offline
    report = preflight(_config(name, model, data), name, keep=str(tmp_path / "kept"))
    _assert_ready(report.render() + "\n", "tied")
    kept = tmp_path / "kept"
    assert (kept / "run" / "checkpoint_3").is_dir() and (kept / "preflight.log").is_file()
    exported = {path.name for path in (kept / "export").iterdir()}
    assert "model.safetensors" in exported and "adapter_model.safetensors" not in exported  # LoRA: merged
    if name.endswith("lora"):  # a bf16 base on a CPU: kept where the CPU has bf16 units, said so either way
        flat = " ".join(report.render().split())
        assert ("model.dtype=bfloat16 on a CPU (it has bf16 units" in flat if cpu_has_bf16_units() else
                "model.dtype bfloat16 -> float32" in flat), flat


def test_the_fsdp_config_is_ready_under_two_processes(offline, tmp_path):
    _, model, data = offline
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "dapo_train", "preflight",
         str(ROOT / "configs" / "qwen7b-fsdp.yaml"), f"model.name_or_path={model}", f"data.path={data}",
         "--shards", "8"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_ready(result.stdout + "\n", "untied")
    assert "2 process(es)" in result.stdout and "each of 8 CUDA cards" in " ".join(result.stdout.split())


def test_bad_input_is_one_line_naming_it(offline, tmp_path, threads, monkeypatch):
    model, _, data = offline
    (tmp_path / "raising.py").write_text("def boom(completions, answers, **kw):\n    raise ValueError('no')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cases = [
        ("qwen1.5b", ["data.prompt_field=question_fr"], "preflight data: data.prompt_field 'question_fr' is not a "
         "column"),
        ("qwen1.5b", ["data.max_prompt_length=40"], "raise data.max_prompt_length=40 (the longest prompt has 211"),
        ("qwen1.5b", ["rewards=[{name: 'raising:boom'}]"], "preflight rollout check: reward 'boom'"),
        ("qwen1.5b-lora", ["model.lora.target_modules=[nothing_here]"], "model.lora.target_modules"),
    ]
    for name, overrides, needle in cases:
        with pytest.raises(UserError) as caught:
            preflight(_config(name, model, data, *overrides), name)
        message = str(caught.value)
        assert needle in message and "\n" not in message, message
