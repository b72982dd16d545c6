"""preflight's data phase reads the prompts as `run` builds them: with rollout.tools, each lists the tools
(its prompt lengths are then the run's), and a chat template that cannot carry them is refused there."""

from __future__ import annotations

from pathlib import Path

import pytest
from small_task import write_small_task
from transformers import AutoTokenizer

from dapo_train.config.load import load_config
from dapo_train.errors import ConfigError
from dapo_train.preflight.real_run import load_splits

ROOT = Path(__file__).resolve().parents[2]
TINY_MODEL = ROOT / "dapo_train" / "assets" / "tiny" / "model"


def test_the_data_phase_lists_the_tools_in_every_prompt_and_checks_the_template(tmp_path):
    task = write_small_task(tmp_path / "task", train=3, test=2)
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    settings = [f"data.path={task}", "data.max_prompt_length=1500"]
    plain = load_splits(load_config(None, settings), tokenizer)
    with pytest.raises(ConfigError, match="ignores tools="):
        load_splits(load_config(None, [*settings, "rollout.tools=[calculator]"]), tokenizer)
    tokenizer.chat_template = (ROOT / "tests" / "fixtures" / "chatml_tools.jinja").read_text(encoding="utf-8")
    listed = load_splits(load_config(None, [*settings, "rollout.tools=[calculator]"]), tokenizer)
    for split in ("train", "test"):
        assert all('"name": "calculator"' in prompt.text for prompt in listed[split][0])
        assert min(listed[split][1].lengths) > max(plain[split][1].lengths)  # the tool list counts in the lengths
