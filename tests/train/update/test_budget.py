"""train.micro_batch_tokens=auto (train/update/budget.py): the choice is arithmetic on the estimate's lines, the free
memory and the margin, checked here by hand at 24, 48 and 80 GB; the lines agree with the estimate; the vLLM
share check; the CPU's resolution; and Batching.halved, the retry's smaller budget."""

import logging
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config

from dapo_train.config.load import load_config
from dapo_train.errors import ConfigError
from dapo_train.train.memory import ModelShape, Setting, estimate
from dapo_train.train.update.batching import Batching
from dapo_train.train.update.budget import (
    Line,
    Need,
    budget_lines,
    choose_budget,
    estimated_peak,
    resolve_budget,
    vllm_room,
)

import qwen_offline

# Bytes: generation and the optimizer step do not grow with the micro-batch; the backward's two branches do,
# 1 MB and 2 MB per token (the second with a smaller fixed part, as the recomputed layer's).
LINES = [Line("generate", 14 * 10**9, 0), Line("backward", 10 * 10**9, 10**6),
         Line("backward, recomputing a layer", 6 * 10**9, 2 * 10**6), Line("optimizer step", 12 * 10**9, 0)]
NEED = Need(floor=600, cap=64 * 1024)


@pytest.mark.parametrize(("card", "expected"), [
    # usable 24e9 x 0.9 = 21.6e9: backward (21.6 - 10)e9 / 1e6 = 11,600 tokens, recomputing (21.6 - 6)e9 / 2e6 =
    # 7,800: the least, 7,800, down to a multiple of 1,024 = 7 x 1,024
    (24 * 10**9, 7 * 1024),
    # usable 43.2e9: 33,200 and 18,600 -> 18 x 1,024
    (48 * 10**9, 18 * 1024),
    # usable 72e9: 62,000 and 33,000 -> 32 x 1,024
    (80 * 10**9, 32 * 1024),
    # usable 14.4e9: 4,400 and 4,200 -> 4 x 1,024
    (16 * 10**9, 4096),
    # usable 13.5e9 < generation's 14e9: no budget helps
    (15 * 10**9, None),
])
def test_auto_is_the_largest_multiple_of_1024_whose_every_moment_fits_the_free_memory_less_the_margin(card, expected):
    assert choose_budget(LINES, NEED, card, margin=0.1) == expected


def test_the_margin_the_floor_and_the_cap_move_the_choice():
    # no margin on 24e9: 12,000 and 9,000 -> 8 x 1,024 (a 10% margin gave 7 x 1,024)
    assert choose_budget(LINES, NEED, 24 * 10**9, margin=0.0) == 8 * 1024
    # one sequence of 7,500 tokens: the card holds 7,800, so 7,500 (over the 7,168 multiple); of 8,000: none
    assert choose_budget(LINES, Need(7500, 64 * 1024), 24 * 10**9, margin=0.1) == 7500
    assert choose_budget(LINES, Need(8000, 64 * 1024), 24 * 10**9, margin=0.1) is None
    # a mini-batch of at most 16,384 tokens: a larger budget changes nothing
    assert choose_budget(LINES, Need(600, 16384), 80 * 10**9, margin=0.1) == 16384


def test_the_lines_are_the_estimate_at_every_budget_whose_rows_are_as_wide_as_the_largest():
    """At 8,192 tokens and more the packed rows are 4,096 wide, as at the cap, so the lines are the estimate
    itself; below, the lines hold the rows at 4,096 and are over the estimate, never under."""
    shape = ModelShape.from_config(Qwen2Config(vocab_size=4096, hidden_size=64, intermediate_size=256,
                                               num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=4))
    cfg = load_config(None, ["train.prompts_per_step=64", "rollout.group_size=16", "train.updates_per_step=1"])
    lines, need = budget_lines(shape, cfg, 128)
    assert need.floor == 128 + cfg.rollout.max_new_tokens

    def peak(budget: int) -> int:
        budgeted = load_config(None, ["train.prompts_per_step=64", "rollout.group_size=16",
                                      "train.updates_per_step=1", f"train.micro_batch_tokens={budget}"])
        return estimate(shape, Setting.from_config(budgeted, cuda=True, prompt_tokens=128)).peak

    for budget in (8192, 9216, 20480):
        assert max(line.at(budget) for line in lines) == peak(budget)
    assert max(line.at(2048) for line in lines) > peak(2048)
    assert choose_budget(lines, need, peak(9216), margin=0.0) == 9216
    assert choose_budget(lines, need, peak(9216) - 1, margin=0.0) == 8192
    # no more than a mini-batch holds: 2 groups x (16 x 512 + 128) = 16,640 tokens, rounded up to 17 x 1,024
    few = load_config(None, ["train.prompts_per_step=2", "rollout.group_size=16", "train.updates_per_step=1",
                             "rollout.max_new_tokens=512"])
    few_lines, few_need = budget_lines(shape, few, 128)
    assert few_need.cap == 17 * 1024 and choose_budget(few_lines, few_need, 10**15) == 17 * 1024


def test_the_vllm_share_is_refused_when_it_does_not_fit_beside_the_training_state():
    # 0.3 of an 80e9 card = 24e9 for vLLM; the training state beside it 18e9 at generation, 17e9 at the eval
    lines = [Line("generate", 42 * 10**9, 0), Line("eval", 41 * 10**9, 0), Line("backward", 20 * 10**9, 10**6)]
    # 79e9 free x 0.9 = 71.1e9; less 18e9 = 53.1e9, of 80e9 = 0.66375
    assert vllm_room(lines, 0.3, 80 * 10**9, 79 * 10**9) == pytest.approx(0.66375)
    # 30e9 free x 0.9 = 27e9; less 18e9 = 9e9, of 80e9 = 0.1125: 0.3 does not fit
    assert vllm_room(lines, 0.3, 80 * 10**9, 30 * 10**9) == pytest.approx(0.1125)


@pytest.mark.parametrize(("batching", "failed", "expected"), [
    (Batching(0, torch.device("cpu"), True, 4, max_tokens=1024), (4, 235), (117, 4)),  # half the micro-batch
    (Batching(0, torch.device("cpu"), True, 4, max_tokens=100), (3, 300), (50, 4)),  # half the budget, the less
    (Batching(0, torch.device("cpu"), True, 4), (4, 900), (0, 2)),  # no token budget: half the count
    (Batching(0, torch.device("cpu"), True, 16), (3, 900), (0, 1)),
    (Batching(0, torch.device("cpu"), True, 4, max_tokens=1024), (1, 900), None),  # one completion: nothing
    (Batching(0, torch.device("cpu"), True, 1), (1, 900), None),
])
def test_an_out_of_memory_micro_batch_halves_the_budget_from_its_own_size(batching, failed, expected):
    smaller = batching.halved(*failed)
    assert (None if smaller is None else (smaller.max_tokens, smaller.max_count)) == expected


class _Accelerator:
    def __init__(self, device: str) -> None:
        self.device = torch.device(device)
        self.distributed_type = "NO"


def test_auto_on_a_cpu_is_micro_batch_size_and_says_so_once(caplog):
    cfg = load_config(None, ["train.micro_batch_tokens=auto", "train.micro_batch_size=4"])
    with caplog.at_level(logging.INFO, logger="dapo_train"):
        assert resolve_budget(cfg, _Accelerator("cpu"), [100]) == 0
    said = [r.getMessage() for r in caplog.records if "micro_batch_tokens=auto" in r.getMessage()]
    assert len(said) == 1 and "micro_batch_size=4" in said[0] and "CPU" in said[0]
    assert resolve_budget(load_config(None, ["train.micro_batch_tokens=512"]), _Accelerator("cpu"), [100]) is None


def _qwen_on_a_card(tmp_path, monkeypatch, config: str, free: int, *overrides: str):
    """A shipped Qwen config's model config (no weights), resolved as on a card of `free` bytes, all free."""
    from pathlib import Path

    qwen_offline.write_model_configs(tmp_path, "1.5b")
    root = Path(__file__).resolve().parents[3]
    cfg = load_config(str(root / "configs" / config), [f"model.name_or_path={tmp_path}", *overrides])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, free))
    return resolve_budget(cfg, _Accelerator("cuda"), [211])  # a device object only: nothing runs on it


def test_auto_on_a_card_follows_its_free_memory_and_logs_its_numbers(tmp_path, monkeypatch, caplog):
    """qwen1.5b-paper.yaml (a 64 x 512-token mini-batch, 33,792 tokens at most): on 80 GB the whole mini-batch,
    on 48 GB less, on 24 GB nothing (float32 weights and AdamW state alone are over): refused in one line."""
    with caplog.at_level(logging.INFO, logger="dapo_train"):
        on_48 = _qwen_on_a_card(tmp_path, monkeypatch, "qwen1.5b-paper.yaml", 48 * 10**9)
        on_80 = _qwen_on_a_card(tmp_path, monkeypatch, "qwen1.5b-paper.yaml", 80 * 10**9)
    assert on_80 == 33 * 1024 and 0 < on_48 < on_80 and on_48 % 1024 == 0
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("train.micro_batch_tokens=auto")]
    assert said[0].startswith(f"train.micro_batch_tokens=auto: {on_48}, ") and "44.7 GiB free" in said[0]
    assert "10% margin (40.2 GiB)" in said[0] and "\n" not in said[0] and "whole mini-batch" in said[1]
    with pytest.raises(ConfigError, match="train.micro_batch_tokens.*optimizer step moment alone"):
        _qwen_on_a_card(tmp_path, monkeypatch, "qwen1.5b-paper.yaml", 24 * 10**9)


def test_a_vllm_share_that_does_not_fit_beside_training_is_refused_at_start(tmp_path, monkeypatch):
    # a whole mini-batch fits beside vLLM's 0.3: 2 groups x (8 x 512 + a prompt of 211) = 8,614 -> 9,216 tokens
    assert _qwen_on_a_card(tmp_path, monkeypatch, "qwen1.5b-vllm.yaml", 48 * 10**9) == 9216
    with pytest.raises(ConfigError, match=r"rollout.vllm_memory.*set it to at most 0\.[0-9]+$"):
        _qwen_on_a_card(tmp_path, monkeypatch, "qwen1.5b-vllm.yaml", 48 * 10**9, "rollout.vllm_memory=0.6")
    # a number, not auto: the share is still checked
    with pytest.raises(ConfigError, match="rollout.vllm_memory"):
        _qwen_on_a_card(tmp_path, monkeypatch, "qwen1.5b-vllm.yaml", 24 * 10**9, "train.micro_batch_tokens=1024")


def test_several_processes_say_at_start_that_an_out_of_memory_update_ends_the_run(monkeypatch, caplog):
    from dapo_train.train.update import budget as budget

    monkeypatch.setattr(budget.distributed, "world_size", lambda: 4)
    with caplog.at_level(logging.INFO, logger="dapo_train"):
        assert resolve_budget(load_config(None, ["train.micro_batch_tokens=512"]), _Accelerator("cpu"), [100]) is None
    said = [r.getMessage() for r in caplog.records if "out-of-memory update" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("4 processes: an out-of-memory update is not redone")
    caplog.clear()
    monkeypatch.setattr(budget.distributed, "world_size", lambda: 1)
    resolve_budget(load_config(None, ["train.micro_batch_tokens=512"]), _Accelerator("cpu"), [100])
    assert not [r for r in caplog.records if "out-of-memory update" in r.getMessage()]


def test_the_estimate_beside_the_first_steps_peak_is_the_one_auto_said(tmp_path, monkeypatch, caplog):
    """estimated_peak (the first step's line, train/card_memory.py): under auto the peak auto's line gave, at its
    budget; a fixed budget or micro-batches by count read off the same lines, larger as they hold more; None on a
    CPU (no card to estimate for)."""
    def estimate(config: str, *overrides: str) -> tuple[int, float | None]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="dapo_train"):
            budget = _qwen_on_a_card(tmp_path, monkeypatch, config, 48 * 10**9, *overrides)
        root = Path(__file__).resolve().parents[3]
        cfg = load_config(str(root / "configs" / config), [f"model.name_or_path={tmp_path}", *overrides])
        said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("train.micro_batch_tokens=auto")]
        logged = float(said[0].split("estimated peak (")[1].split(" GiB")[0]) if said else None
        return estimated_peak(cfg, _Accelerator("cuda"), [211], budget), logged

    auto, logged = estimate("qwen1.5b-paper.yaml")
    assert round(auto / 2**30, 1) == logged  # the same number, to the line's 0.1 GiB
    fixed = [estimate("qwen1.5b-paper.yaml", f"train.micro_batch_tokens={n}")[0] for n in (2048, 8192)]
    counted = [estimate("qwen1.5b-paper.yaml", "train.micro_batch_tokens=0", f"train.micro_batch_size={n}")[0]
               for n in (2, 8)]
    assert fixed[0] < fixed[1] <= auto and counted[0] < counted[1]
    cfg = load_config(None, [])
    assert estimated_peak(cfg, _Accelerator("cpu"), [100], None) is None
    from transformers import GPT2Config

    GPT2Config(n_layer=2, n_embd=64, n_head=2).save_pretrained(tmp_path / "gpt2")  # no intermediate_size to read
    gpt2 = load_config(None, [f"model.name_or_path={tmp_path / 'gpt2'}", "train.micro_batch_tokens=2048"])
    assert estimated_peak(gpt2, _Accelerator("cuda"), [100], None) is None  # no estimate, and no crash at start
