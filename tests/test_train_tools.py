"""End to end with a tool: `rollout.tools=[calculator]` through the trainer, on a copy of the shipped tiny
model whose chat template is the tests' tool template (tests/fixtures/chatml_tools.jinja; the tool list
makes the prompts longer than the model's 512 positions, so the copy allows more: rotary needs no other
change). The tiny model never learned to call a tool, so its draws are scripted: every completion calls
the calculator once, reads its answer and ends. What is checked is the wiring: the prompts list the tool,
the engine runs it, the metrics, the rollout records and `show` carry the calls, and what trains is the
policy's tokens. Then builtin:tiny-tools, which calls the calculator unscripted: a short run, `show`, and a
resume that gives the same next step."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from small_task import write_small_task
from transformers import AutoTokenizer

from dapo_train.config.load import load_config
from dapo_train.rollout import decoding, hf_engines
from dapo_train.run.logs import read_metrics
from dapo_train.run.rollouts import read_rollouts
from dapo_train.study.show import show
from dapo_train.tools import resolve_tools
from dapo_train.tools.turns import ToolTurns
from dapo_train.train.loop import train

ROOT = Path(__file__).resolve().parents[1]
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call><|im_end|>'
ANSWER = "<answer>\n42\n</answer><|im_end|>"


def tool_model(folder: Path) -> Path:
    shutil.copytree(ROOT / "dapo_train" / "assets" / "tiny" / "model", folder)
    shutil.copy(ROOT / "tests" / "fixtures" / "chatml_tools.jinja", folder / "chat_template.jinja")
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 2048
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_run_with_the_calculator_calls_it_logs_the_calls_and_trains_the_policys_tokens(tmp_path, monkeypatch):
    model = tool_model(tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(model)
    call, answer = (tokenizer(text, add_special_tokens=False)["input_ids"] for text in (CALL, ANSWER))
    tool_turn = ToolTurns(tokenizer, resolve_tools(["calculator"]), 4).answer(call, 0).forced_ids
    script = call + [0] * len(tool_turn) + answer  # the tool turn's place: the engine's own tokens go there
    real_loop = hf_engines.decode_loop

    def scripted_loop(*args, **kwargs):  # each decode call replays the script from its first step
        steps = iter(range(10**6))
        monkeypatch.setattr(decoding, "draw_tokens", lambda distribution, top_k=0, generators=None: torch.full(
            (distribution.shape[0],), script[min(next(steps), len(script) - 1)], dtype=torch.long))
        return real_loop(*args, **kwargs)

    monkeypatch.setattr(hf_engines, "decode_loop", scripted_loop)
    cfg = load_config(None, [
        f"model.name_or_path={model}", f"data.path={write_small_task(tmp_path / 'task')}",
        "data.max_prompt_length=1500", "rollout.tools=[calculator]",
        "rollout.group_size=2", "rollout.max_new_tokens=160", "train.prompts_per_step=2", "train.max_steps=1",
        "train.updates_per_step=1", "train.micro_batch_size=4", "dapo.dynamic_sampling=false", "eval.every_steps=0",
        "eval.final_full=false",
        "logging.progress_bar=false", "logging.rollout_groups=-1", "rewards=[{name: accuracy}]",
        f"output_dir={tmp_path / 'run'}"])
    run_dir = train(cfg)

    assert len(script) < 160  # room for the whole transcript
    (row,) = [row for row in read_metrics(run_dir) if row["step"] > 0]
    assert (row["tool_calls"], row["tool_errors"], row["tool_use_ratio"]) == (4, 0, 1.0)
    assert row["tool_tokens"] == 4 * len(tool_turn)
    assert row["generated_tokens"] == 4 * len(script) and row["trained_tokens"] == 4 * (len(call) + len(answer))
    assert row["num_tokens"] == 4 * (len(call) + len(answer))  # Eq. 12's count: the policy's tokens
    records = read_rollouts(run_dir / "rollouts" / "step_1.jsonl")
    assert len(records) == 4 and all(
        [(c["name"], c["result"], c["error"]) for c in record["tool_calls"]] == [("calculator", "42", False)]
        and record["extracted"] == "42" for record in records)
    shown = show(str(run_dir))
    assert '    call calculator: {"name": "calculator", "arguments": {"expression": "6 * 7"}} -> 42' in shown


# builtin:tiny-tools, which calls the calculator on its own: short, float32, deterministic steps.
TINY_TOOLS = [
    "model.name_or_path=builtin:tiny-tools", "rollout.tools=[calculator]", "data.max_prompt_length=512",
    "rollout.group_size=4", "rollout.max_new_tokens=96", "train.prompts_per_step=2", "train.updates_per_step=2",
    "train.micro_batch_size=4", "train.deterministic=true", "train.num_threads=1", "dapo.dynamic_sampling=false",
    "eval.every_steps=0", "eval.final_full=false", "logging.progress_bar=false", "logging.rollout_groups=-1",
    "rewards=[{name: accuracy}, {name: overlong, args: {cache_length: 32}}]", "checkpoint.every_steps=1",
]


def test_the_tool_calling_tiny_model_calls_the_calculator_trains_shows_the_calls_and_resumes_exactly(tmp_path):
    settings = [*TINY_TOOLS, f"data.path={write_small_task(tmp_path / 'task')}", "train.max_steps=2",
                f"output_dir={tmp_path / 'run'}"]
    run_dir = train(load_config(None, settings))
    rows = [row for row in read_metrics(run_dir) if row["step"] > 0]
    assert all(row["tool_calls"] > 0 and row["tool_tokens"] > 0 and row["tool_use_ratio"] > 0 for row in rows), rows
    assert any(row["groups_kept"] > 0 and row["loss"] != 0 for row in rows), rows  # real updates to reproduce
    records = read_rollouts(run_dir / "rollouts" / "step_2.jsonl")
    calls = [call for record in records for call in record["tool_calls"]]
    assert calls and all(call["name"] == "calculator" for call in calls)
    shown = show(str(run_dir))
    assert f"    call calculator: {calls[0]['text']} -> {calls[0]['result']}" in shown, shown

    straight = load_file(run_dir / "checkpoint_2" / "model.safetensors")  # in memory: the resume rewrites it
    train(load_config(None, settings), resume=run_dir / "checkpoint_1")
    resumed = [row for row in read_metrics(run_dir) if row["step"] > 0]
    assert [row["step"] for row in resumed] == [1, 2]
    for key in ("loss", "reward_mean", "tool_calls", "tool_errors", "tool_tokens", "completion_length_mean"):
        assert resumed[1][key] == pytest.approx(rows[1][key], abs=1e-6), key
    again = load_file(run_dir / "checkpoint_2" / "model.safetensors")
    for name, tensor in straight.items():
        torch.testing.assert_close(again[name], tensor, atol=1e-5, rtol=0)
