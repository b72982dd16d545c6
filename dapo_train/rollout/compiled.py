"""Compiled decoding and its eager fallback: what a compiled decode step needs at run time, and what its failure
is, for the engines that compile one on CUDA (hf's static-cache engine, vLLM's CUDA graphs).

torch.compile's Inductor backend writes Triton kernels on CUDA, and Triton builds their launchers with a C
compiler at run time (CC, else gcc or clang on PATH): on a slim image without one the first rollout failed, and
nothing fell back. So:
- at start (`compiles`), a CUDA engine asked to compile on a machine with no C compiler decodes eagerly, and
  says so in one line;
- at the first generate call, a compile that fails all the same (another missing piece: Triton itself, a card
  too old for it, a broken toolchain) is caught by the types torch raises for a failed compile, and no other
  (`compile_failure`): the engine falls back to eager decoding once, saying why in one line.
"""

from __future__ import annotations

import logging
import os
import shutil

logger = logging.getLogger(__name__)


def c_compiler() -> str | None:
    """The C compiler Triton would build with: CC, else gcc, else clang on PATH (None: none)."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")


def compiles(wanted: bool, cuda: bool, engine: str) -> bool:
    """Whether `engine` compiles its decode step: `wanted` (rollout.compile resolved), unless on CUDA no C
    compiler is found (one warning line; a CPU compiles nothing that needs one here)."""
    if not (wanted and cuda) or c_compiler() is not None:
        return wanted
    logger.warning("rollout.compile: no C compiler (CC unset, no gcc or clang on PATH), which Triton needs to build "
                   "a compiled decode step: %s decodes eagerly (install gcc, or set CC, to compile)", engine)
    return False


def compile_failure_types() -> tuple[type[BaseException], ...]:
    """The exceptions torch raises for a compile that failed: the backend's (Inductor's InductorError is one:
    a missing C or C++ compiler, a broken toolchain), Triton not installed, a card too old for Triton."""
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.exc import GPUTooOldForTriton, TritonMissing

    return BackendCompilerFailed, TritonMissing, GPUTooOldForTriton


def compile_failure(error: BaseException) -> BaseException | None:
    """The failed compile behind `error` (itself, or what it was raised from or during: vLLM's start may wrap
    it), or None when it is something else."""
    kinds, seen = compile_failure_types(), set()
    while error is not None and id(error) not in seen:
        if isinstance(error, kinds):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def say_fallback(engine: str, failure: BaseException) -> None:
    """The one line an engine says when its compile failed and it decodes eagerly from now on: the error behind
    the backend's (BackendCompilerFailed and InductorError carry it), in its first line."""
    cause = getattr(failure, "inner_exception", None) or failure
    said = f"{type(cause).__name__}: {(str(cause).strip().splitlines() or [''])[0]}"
    logger.warning("rollout: compiling the decode step failed (%s): %s decodes eagerly from now on, over the same "
                   "weights (rollout.compile=off skips the attempt)", said, engine)
