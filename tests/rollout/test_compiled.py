"""Compiled decoding that cannot compile (rollout/compiled.py): a compile made to fail at the first generate
call (torch's own BackendCompilerFailed, from a backend that finds no compiler, as Triton's does on a slim
image) falls back once to the decode loop over the same weights, from the same random state, with one line; an
error that is no compile failure is not swallowed; with no C compiler on a CUDA machine the engines decode
eagerly from the start."""

import logging

import pytest
import torch
from torch._inductor.exc import InductorError, InvalidCxxCompiler

from dapo_train.rollout import SamplingSettings, StaticCacheEngine, compiled, hf_engines
from dapo_train.rollout.compiled import compile_failure, compiles

from conftest import make_engine, shipped_tiny


@pytest.fixture(scope="module")
def tiny():
    return shipped_tiny()


def no_compiler(graph, inputs):
    raise InvalidCxxCompiler()  # what Inductor raises without a working compiler


def failed_compile() -> BaseException:
    """What torch raises when a compiled function's backend fails: a real BackendCompilerFailed."""
    try:
        torch.compile(lambda x: x + 1, backend=no_compiler)(torch.ones(1))
    except Exception as error:  # noqa: BLE001 (its type is what the test is about)
        return error
    raise AssertionError("the compile did not fail")


def test_a_compile_that_fails_falls_back_to_the_decode_loop_once(tiny, monkeypatch, caplog):
    model, tokenizer, prompts = tiny
    failure, attempts = failed_compile(), []

    def failing_generate(*args, **kwargs):
        attempts.append(1)
        torch.rand(7)  # a draw before the failure (transformers' prefill samples before the compiled step runs)
        raise failure

    monkeypatch.setattr(hf_engines, "generate_rows", failing_generate)
    engine = make_engine("static-cache", model, tokenizer)
    assert isinstance(engine, StaticCacheEngine)
    settings = SamplingSettings(24, temperature=1.0)
    torch.manual_seed(0)
    ours = [engine.generate(prompts[:3], settings, group_size=2) for _ in range(2)]
    torch.manual_seed(0)
    loop = make_engine("loop", model, tokenizer)
    theirs = [loop.generate(prompts[:3], settings, group_size=2) for _ in range(2)]
    assert [[c.completion_ids.tolist() for c in call] for call in ours] == \
        [[c.completion_ids.tolist() for c in call] for call in theirs]  # the decode loop's, draw for draw
    assert len(attempts) == 1  # tried once, not at every call
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 1 and said[0].startswith("rollout: compiling the decode step failed (InvalidCxxCompiler: No "
                                                 "working C++ compiler found"), said
    assert said[0].endswith("): the static-cache engine decodes eagerly from now on, over the same weights "
                            "(rollout.compile=off skips the attempt)"), said


def test_an_error_that_is_not_a_failed_compile_is_raised(tiny, monkeypatch):
    model, tokenizer, prompts = tiny

    def broken_generate(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(hf_engines, "generate_rows", broken_generate)
    engine = make_engine("static-cache", model, tokenizer)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        engine.generate(prompts[:1], SamplingSettings(8), group_size=2)


def test_a_failed_compile_is_found_behind_what_wraps_it():
    inductor = InductorError(InvalidCxxCompiler(), None)
    try:
        try:
            raise inductor
        except InductorError as error:
            raise RuntimeError("Engine core initialization failed") from error
    except RuntimeError as wrapped:
        assert compile_failure(wrapped) is inductor
    assert isinstance(compile_failure(failed_compile()), torch._dynamo.exc.BackendCompilerFailed)
    assert compile_failure(RuntimeError("Failed to find C compiler")) is None  # a bare RuntimeError is no proof
    assert compile_failure(ValueError("bad")) is None


def test_without_a_c_compiler_a_cuda_engine_decodes_eagerly_from_the_start(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no gcc, no clang
    assert compiled.c_compiler() is None
    assert compiles(True, cuda=True, engine="hf") is False
    assert caplog.records[-1].getMessage().startswith("rollout.compile: no C compiler (CC unset, no gcc or clang on "
                                                      "PATH), which Triton needs")
    caplog.clear()
    assert compiles(True, cuda=False, engine="hf") is True  # a CPU compiles nothing that needs one here
    assert compiles(False, cuda=True, engine="hf") is False
    monkeypatch.setenv("CC", "/opt/cc")
    assert compiles(True, cuda=True, engine="hf") is True
    assert not caplog.records
