"""The card's memory per step (train/card_memory.py), with torch.cuda's counters faked: each step's peaks since
its start in metrics.jsonl, the first step's line with the start-time estimate beside the reserved peak, and on
a CPU nothing (no zeros)."""

import logging

import pytest
import torch

from dapo_train.config.load import load_config
from dapo_train.run.logs import read_metrics
from dapo_train.train import session
from dapo_train.train.card_memory import ALLOCATED, RESERVED, CardMemory
from dapo_train.train.loop import train

GIB = 2**30


class FakeCard:
    """torch.cuda's memory counters: reset at a step's start, then at `work` (allocated, reserved bytes), as the
    step's work would leave them (nothing on a CPU allocates on a card)."""

    def __init__(self, monkeypatch) -> None:
        self.allocated = self.reserved = 0
        self.work = (0, 0)
        self.resets = 0
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self.reset)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * GIB, 80 * GIB))

    def reset(self, device=None) -> None:
        self.resets += 1
        self.allocated, self.reserved = self.work


def test_each_step_records_its_own_peaks_and_the_first_sets_the_estimate_beside_them(monkeypatch, caplog):
    card = FakeCard(monkeypatch)
    memory = CardMemory.start(torch.device("cuda", 0), estimate=int(30.25 * GIB))
    caplog.set_level(logging.INFO, logger="dapo_train")
    rows = []
    for step, (allocated, reserved) in enumerate([(28.5, 31.5), (12.0, 14.0)], 1):
        card.work = (int(allocated * GIB), int(reserved * GIB))
        memory.begin_step()
        rows.append(memory.step_metrics(step))
    assert rows == [{ALLOCATED: 28.5, RESERVED: 31.5}, {ALLOCATED: 12.0, RESERVED: 14.0}] and card.resets == 2
    said = [r.getMessage() for r in caplog.records if "the card's peak" in r.getMessage()]
    # 30.25 GiB estimated, 31.5 reserved: the line shows both to 0.1 GiB, and the card's 80.
    assert said == ["step 1: the card's peak 31.5 GiB reserved (30.2 GiB estimated at start; 28.5 GiB allocated) of "
                    "80.0 GiB"]
    without = CardMemory.start(torch.device("cuda", 0), estimate=None)
    without.begin_step()
    without.step_metrics(1)
    assert "(no estimate at start; 12.0 GiB allocated)" in caplog.records[-1].getMessage()


def test_on_a_cpu_nothing_is_measured_or_recorded(monkeypatch):
    def touched(*args, **kwargs):
        pytest.fail("a CUDA counter was read on a CPU")

    for name in ("reset_peak_memory_stats", "max_memory_allocated", "max_memory_reserved", "mem_get_info"):
        monkeypatch.setattr(torch.cuda, name, touched)
    memory = CardMemory.start(torch.device("cpu"), estimate=None)
    memory.begin_step()
    assert memory.step_metrics(1) == {}


def test_a_run_records_the_peaks_in_every_steps_metrics_row(tmp_path, monkeypatch, caplog):
    """Two steps of a short CPU run with the run's device taken for a card (its counters faked): every step's
    row holds both peaks, and only the first step says its line; the CPU run beside it records none."""
    card = FakeCard(monkeypatch)
    real_start = CardMemory.start
    monkeypatch.setattr(session.CardMemory, "start",
                        classmethod(lambda cls, device, estimate: real_start(torch.device("cuda", 0), 5 * GIB)))
    card.work = (3 * GIB, 4 * GIB)
    small = ["rollout.group_size=4", "rollout.max_new_tokens=48", "train.prompts_per_step=2", "train.max_steps=2",
             "train.micro_batch_size=4", "train.updates_per_step=1", "eval.every_steps=0", "eval.final_full=false",
             "rewards=[{name: accuracy}, {name: overlong, args: {cache_length: 16}}]", "logging.progress_bar=false",
             "train.num_threads=1"]
    caplog.set_level(logging.INFO, logger="dapo_train")
    rows = read_metrics(train(load_config(None, [*small, f"output_dir={tmp_path / 'card'}"])))
    assert [(row["step"], row[ALLOCATED], row[RESERVED]) for row in rows] == [(1, 3.0, 4.0), (2, 3.0, 4.0)]
    assert sum("the card's peak" in r.getMessage() for r in caplog.records) == 1
    monkeypatch.undo()
    rows = read_metrics(train(load_config(None, [*small, f"output_dir={tmp_path / 'cpu'}"])))
    assert rows and not any(ALLOCATED in row or RESERVED in row for row in rows)
