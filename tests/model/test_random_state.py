"""The random streams a checkpoint holds (model/random_state.py): a round trip, and a resume that sees fewer or
more CUDA devices than the save, or none, restores the streams both have and says which it could not. The
devices are faked the way torch.cuda.set_rng_state reaches them: one generator per visible device, an
IndexError for a device past them (the error a resume on fewer GPUs raised)."""

import random

import numpy as np
import pytest
import torch

from dapo_train.model import random_state


def test_the_streams_round_trip(tmp_path):
    state = random_state.rng_state()
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    torch.save(state, tmp_path / "rng.pt")
    random_state.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected


class FakeGenerator:
    def __init__(self):
        self.state = None

    def set_state(self, state):
        self.state = state


@pytest.fixture
def visible(monkeypatch):
    """visible(n): n CUDA devices faked, each with its own generator (returned); 0 = no CUDA."""
    def fake(count: int) -> list[FakeGenerator]:
        generators = [FakeGenerator() for _ in range(count)]
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "default_generators", tuple(generators))
        monkeypatch.setattr(torch.cuda.random, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda.random, "_lazy_call", lambda callback, **kw: callback())
        return generators
    return fake


def saved_with(devices: int) -> dict:
    """The CPU streams now, and the CUDA streams of `devices` devices (bytes 0, 1, ...: told apart by value)."""
    state = random_state.rng_state()
    if devices:
        state["cuda"] = [torch.full((16,), index, dtype=torch.uint8) for index in range(devices)]
    return state


@pytest.mark.parametrize("saved, seen, restored, said", [
    (2, 2, 2, None),
    (2, 1, 1, "the checkpoint holds the CUDA random streams of 2 devices and this process sees 1: the first 1 "
              "restored, the other 1 saved not used"),
    (1, 2, 1, "the checkpoint holds the CUDA random streams of 1 device and this process sees 2: the first 1 "
              "restored, the other 1 start fresh"),
    (0, 1, 0, "the checkpoint holds no CUDA random streams (saved without CUDA) and this process sees 1: it "
              "starts fresh"),
    (2, 0, 0, "the checkpoint holds the CUDA random streams of 2 devices and this process sees none: they are not "
              "used"),
])
def test_a_resume_on_another_count_of_devices_restores_what_it_can_and_says_so(visible, caplog, saved, seen,
                                                                                 restored, said):
    state = saved_with(saved)
    generators = visible(seen)
    expected = random.random()
    random.seed(99)  # moved on: the restore must put Python's stream back
    random_state.set_rng_state(state)
    assert random.random() == expected
    got = [None if g.state is None else int(g.state[0]) for g in generators]
    assert got == [*range(restored), *[None] * (seen - restored)]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == ([] if said is None else [said])
