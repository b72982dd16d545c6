"""The weight casts a card would pay, counted on a CPU under the card's settings: bf16 autocast over the float32
master weights with the bf16 rollout copy (train.mixed_precision=bf16 rollout.dtype=bfloat16, what `auto` gives on
CUDA). A cast of a float32 weight to bf16 is a read of 4 bytes and a write of 2 per element; repeated per decode
step or per LM-head chunk it is most of a step's memory traffic on a card.

    python scripts/bench/bench_casts.py                                   # the demo, 2 steps, an eval at each
    python scripts/bench/bench_casts.py --set train.logprob_chunk_mib=0.05   # more LM-head chunks per call
    python scripts/bench/bench_casts.py --check      # exit 1 when a decode or the head casts more than it should

Prints, per phase of the run (rollout, old log-probs, update, eval), the model's forwards, the casts of its weights
(all of them, then the projection weights' share: 8 per layer-pair of the tiny model) and the casts per forward,
then the LM head's casts per update call (one call = one micro-batch's forward and backward). The last line is JSON.

CastCounter is also the CI test's instrument (tests/model/test_weight_casts.py): a TorchDispatchMode that sees
every `_to_copy` below autocast, so a cast the autocast cache serves is not counted and one it makes is.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[2]
CARD_SETTINGS = ["train.mixed_precision=bf16", "rollout.dtype=bfloat16"]
PHASES = ("rollout", "old_logprobs", "update", "sync", "eval")


class CastCounter(TorchDispatchMode):
    """Counts casts of the given float32 weights to a lower precision, by phase (set with `phase`), and the
    forwards of `models` by phase, of which prefills (more than one position a row: a generate call's first forward,
    or an update's). weights: name -> parameter (its storage identifies it in any view)."""

    def __init__(self, weights: dict[str, torch.Tensor], models: tuple[torch.nn.Module, ...] = ()) -> None:
        super().__init__()
        self.names = {w.untyped_storage().data_ptr(): name for name, w in weights.items() if w.dtype == torch.float32}
        self.current = "other"
        self.casts: Counter = Counter()  # (phase, weight name) -> casts
        self.forwards: Counter = Counter()  # phase -> forwards of the models
        self.calls: Counter = Counter()  # phase -> prefills among them
        for model in models:
            model.register_forward_pre_hook(self._forward, with_kwargs=True)

    def _forward(self, module, args, kwargs) -> None:
        self.forwards[self.current] += 1
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and ids.shape[-1] > 1:
            self.calls[self.current] += 1

    @contextlib.contextmanager
    def phase(self, name: str):
        before, self.current = self.current, name
        try:
            yield
        finally:
            self.current = before

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") in (torch.bfloat16, torch.float16):
            source = args[0]
            if source.dtype == torch.float32:
                name = self.names.get(source.untyped_storage().data_ptr())
                if name is not None:
                    self.casts[(self.current, name)] += 1
        return func(*args, **kwargs)

    def count(self, phase: str, names=None) -> int:
        """Casts in `phase` of the weights whose name passes `names` (a predicate; None: all)."""
        return sum(n for (p, name), n in self.casts.items() if p == phase and (names is None or names(name)))


def run_counted(overrides: list[str], run_dir: Path) -> tuple[CastCounter, int]:
    """A short demo run under `overrides`, every weight cast counted by phase. -> (the counter, the LM head's
    update calls: micro-batch forwards in the update)."""
    from dapo_train.config.load import load_config
    from dapo_train.train import loop

    cfg = load_config(None, [f"output_dir={run_dir}", *overrides])
    counters: list[CastCounter] = []
    setup = loop.setup

    def counted_setup(*args, **kwargs):  # the counter needs the loaded model's weights
        run = setup(*args, **kwargs)
        model = run.accelerator.unwrap_model(run.model)
        copy = getattr(run.engine, "copy", None)  # the rollout's copy in rollout.dtype, when there is one
        counter = CastCounter(dict(model.named_parameters()), (model,) if copy is None else (model, copy))
        counters.append(counter)
        return run

    loop.setup = counted_setup
    try:
        with _counting(counters):
            loop.train(cfg)
    finally:
        loop.setup = setup
    counter = counters[0]
    return counter, counter.forwards["update"]


@contextlib.contextmanager
def _counting(counters: list[CastCounter]):
    """Enter the counter's dispatch mode once setup has made it, with the stages patched to name their phase."""
    from dapo_train.train import evals, loop
    from dapo_train.train.update.out_of_memory import OutOfMemoryGuard

    saved = {(loop, "collect"): loop.collect, (loop, "score_old_logprobs"): loop.score_old_logprobs,
             (OutOfMemoryGuard, "update"): OutOfMemoryGuard.update, (loop, "sync_weights"): loop.sync_weights,
             (evals, "evaluate"): evals.evaluate}
    phases = {"collect": "rollout", "score_old_logprobs": "old_logprobs", "update": "update",
              "sync_weights": "sync", "evaluate": "eval"}
    entered: list = []

    def staged(function, phase):
        def counted(*args, **kwargs):
            counter = counters[0]
            if not entered:
                counter.__enter__()
                entered.append(counter)
            with counter.phase(phase):
                return function(*args, **kwargs)
        return counted

    for (owner, name), function in saved.items():
        setattr(owner, name, staged(function, phases[name]))
    try:
        yield
    finally:
        for (owner, name), function in saved.items():
            setattr(owner, name, function)
        for counter in entered:
            counter.__exit__(None, None, None)


def report(counter: CastCounter, head: str) -> dict:
    """Per phase: forwards, generate calls (prefills), casts of every weight, of the projections, per forward; the
    head's per update call; the float32 weights a forward under autocast may cast."""
    rows = {"float32_weights": len(counter.names)}
    for phase in PHASES:
        forwards = counter.forwards[phase]
        casts = counter.count(phase)
        rows[phase] = {"forwards": forwards, "calls": counter.calls[phase], "weight_casts": casts,
                       "projection_casts": counter.count(phase, lambda name: name.endswith("proj.weight")),
                       "casts_per_forward": round(casts / forwards, 2) if forwards else None}
    calls = counter.forwards["update"]
    head_casts = counter.count("update", lambda name: name == head)
    rows["head_casts_per_update_call"] = round(head_casts / calls, 2) if calls else None
    return rows


def failures(rows: dict) -> list[str]:
    """What a card must not pay (issue 58), from report's rows: a decode (rollout, eval) casting a weight more than
    once per generate call, the LM head casting its weight more than once per update call."""
    found = []
    for phase in ("rollout", "eval"):
        row = rows[phase]
        if row["weight_casts"] > rows["float32_weights"] * row["calls"]:
            found.append(f"{phase}: {row['weight_casts']} weight casts over {row['calls']} generate calls of "
                         f"{rows['float32_weights']} float32 weights (at most one each a call)")
    head = rows["head_casts_per_update_call"]
    if head is not None and head > 1:
        found.append(f"the LM head: {head} casts per update call (at most 1)")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--set", nargs="*", default=[], help="more KEY=VALUE overrides")
    parser.add_argument("--check", action="store_true", help="exit 1 when failures() finds a cast too many")
    args = parser.parse_args()
    overrides = [*CARD_SETTINGS, f"train.max_steps={args.steps}", "eval.every_steps=1", "eval.final_full=false",
                 "logging.progress_bar=false", *args.set]
    with tempfile.TemporaryDirectory() as folder:
        counter, _ = run_counted(overrides, Path(folder) / "run")
    tied = not any(name == "lm_head.weight" for _, name in counter.casts)
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    rows = report(counter, head)
    for phase in PHASES:
        row = rows[phase]
        print(f"{phase:>13}: {row['forwards']:5d} forwards in {row['calls']} calls, {row['weight_casts']:6d} weight "
              f"casts ({row['projection_casts']} of projections), {row['casts_per_forward']} per forward")
    print(f"LM head ({head}): {rows['head_casts_per_update_call']} casts per update call")
    found = failures(rows)
    for line in found:
        print(f"too many casts: {line}")
    print(json.dumps({"overrides": overrides, **rows}))
    return 1 if args.check and found else 0


if __name__ == "__main__":
    sys.exit(main())
