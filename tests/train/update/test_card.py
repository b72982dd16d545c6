"""The update's budget at start on this run's card (train/update/card.py): auto on a CPU, auto on 24, 48 and 80 GB
cards with the Qwen shapes (their config.json, no weights), the vLLM share's check, the line about several
processes; and the refusals: one line naming the moment that does not fit, advising only what fits by the same
estimate (issue 59 item 4)."""

import logging
import re
from pathlib import Path

import pytest
import torch

from dapo_train.config.load import load_config
from dapo_train.errors import ConfigError
from dapo_train.train.update.card import estimated_peak, resolve_budget

import qwen_offline

ROOT = Path(__file__).resolve().parents[3]


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
    qwen_offline.write_model_configs(tmp_path, "1.5b")
    cfg = load_config(str(ROOT / "configs" / config), [f"model.name_or_path={tmp_path}", *overrides])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, free))
    return resolve_budget(cfg, _Accelerator("cuda"), [211])  # a device object only: nothing runs on it


def test_auto_on_a_card_follows_its_free_memory_and_logs_its_numbers(tmp_path, monkeypatch, caplog):
    """qwen1.5b-paper.yaml (a 64 x 512-token mini-batch, 33,792 tokens at most): on 80 GB the whole mini-batch,
    on 48 GB less, on 24 GB nothing (the weights, AdamW state and generation alone are over): refused in one line."""
    with caplog.at_level(logging.INFO, logger="dapo_train"):
        on_48 = _qwen_on_a_card(tmp_path, monkeypatch, "qwen1.5b-paper.yaml", 48 * 10**9)
        on_80 = _qwen_on_a_card(tmp_path, monkeypatch, "qwen1.5b-paper.yaml", 80 * 10**9)
    assert on_80 == 33 * 1024 and 0 < on_48 < on_80 and on_48 % 1024 == 0
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("train.micro_batch_tokens=auto")]
    assert said[0].startswith(f"train.micro_batch_tokens=auto: {on_48}, ") and "44.7 GiB free" in said[0]
    assert "10% margin (40.2 GiB)" in said[0] and "\n" not in said[0] and "whole mini-batch" in said[1]
    with pytest.raises(ConfigError, match="train.micro_batch_tokens.*the generate moment alone"):
        _qwen_on_a_card(tmp_path, monkeypatch, "qwen1.5b-paper.yaml", 24 * 10**9)


def test_a_vllm_share_that_does_not_fit_beside_training_is_refused_at_start(tmp_path, monkeypatch):
    # a whole mini-batch fits beside vLLM's 0.3: 2 groups x (8 x 512 + a prompt of 211) = 8,614 -> 9,216 tokens
    assert _qwen_on_a_card(tmp_path, monkeypatch, "qwen1.5b-vllm.yaml", 48 * 10**9) == 9216
    with pytest.raises(ConfigError, match=r"rollout.vllm_memory.*set it to at most 0\.[0-9]+$") as refused:
        _qwen_on_a_card(tmp_path, monkeypatch, "qwen1.5b-vllm.yaml", 48 * 10**9, "rollout.vllm_memory=0.6")
    most = re.search(r"at most (0\.[0-9]+)$", str(refused.value))[1]  # what it advises fits
    assert _qwen_on_a_card(tmp_path, monkeypatch, "qwen1.5b-vllm.yaml", 48 * 10**9, f"rollout.vllm_memory={most}")
    # a number, not auto: the share is still checked
    with pytest.raises(ConfigError, match="rollout.vllm_memory"):
        _qwen_on_a_card(tmp_path, monkeypatch, "qwen1.5b-vllm.yaml", 24 * 10**9, "train.micro_batch_tokens=1024")


def test_several_processes_say_at_start_that_an_out_of_memory_update_ends_the_run(monkeypatch, caplog):
    from dapo_train.train.update import card as budget

    monkeypatch.setattr(budget.distributed, "world_size", lambda: 4)
    with caplog.at_level(logging.INFO, logger="dapo_train"):
        assert resolve_budget(load_config(None, ["train.micro_batch_tokens=512"]), _Accelerator("cpu"), [100]) is None
    said = [r.getMessage() for r in caplog.records if "out-of-memory update" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("4 processes: an out-of-memory update is not redone")
    caplog.clear()
    monkeypatch.setattr(budget.distributed, "world_size", lambda: 1)
    resolve_budget(load_config(None, ["train.micro_batch_tokens=512"]), _Accelerator("cpu"), [100])
    assert not [r for r in caplog.records if "out-of-memory update" in r.getMessage()]


@pytest.mark.parametrize(("setting", "device", "card_line"), [
    ("512", "cpu", False),  # issue 59 (item 16): torchrun on a CPU spoke of auto, which nothing asked for
    ("auto", "cpu", False),  # on a CPU auto is micro_batch_size's count: no card sizes anything
    ("512", "cuda", False),
    ("auto", "cuda", True),
])
def test_the_several_processes_line_speaks_of_auto_only_where_auto_sizes_from_the_cards(
        tmp_path, monkeypatch, caplog, setting, device, card_line):
    from dapo_train.train.update import card as budget

    monkeypatch.setattr(budget.distributed, "world_size", lambda: 2)
    with caplog.at_level(logging.INFO, logger="dapo_train"):
        if device == "cuda":
            _qwen_on_a_card(tmp_path, monkeypatch, "qwen1.5b.yaml", 48 * 10**9, f"train.micro_batch_tokens={setting}")
        else:
            resolve_budget(load_config(None, [f"train.micro_batch_tokens={setting}"]), _Accelerator("cpu"), [100])
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("2 processes")]
    assert len(said) == 1 and "an out-of-memory update is not redone" in said[0]
    assert ("auto" in said[0]) == card_line
    assert ("sizes the budget from the card with the least free memory" in said[0]) == card_line


def _refusal(tmp_path, monkeypatch, config: str, free: int, *overrides: str) -> str:
    with pytest.raises(ConfigError) as refused:
        _qwen_on_a_card(tmp_path, monkeypatch, config, free, *overrides)
    message = str(refused.value)
    assert "\n" not in message
    return message


LORA = ("model.lora.r=32", "model.dtype=bfloat16")  # configs/qwen1.5b-lora.yaml's adapters and frozen base
LORA_ADVICE = r"LoRA \(model\.lora\.r=32, model\.dtype=bfloat16: auto would choose ([0-9,]+)\)"


def test_on_24_gb_auto_refuses_naming_the_fixed_moment_and_advises_only_what_fits(tmp_path, monkeypatch):
    """Issue 59 item 4. qwen1.5b-paper.yaml: its largest fixed moment is generation (one process on a card steps
    AdamW fused, so the optimizer step holds 4 + 4 + 8 + 2 = 18 bytes a parameter, 25.9 GiB): the float32 weights
    (4 bytes a parameter), AdamW's two moments (8) and the bf16 rollout copy (2), 14 x 1,543,714,304 = 21.61e9
    bytes; the static cache's 256 rows x (256 prompt + 512) positions x 28,672 KV bytes a position (2 x 28 layers
    x 2 heads x 128 x 2 bytes) = 5.64e9; their prefill, 65,536 positions x (3 x 8,960 + 4 x 1,536) x 2 bytes =
    4.33e9: 31.58e9 bytes = 29.4 GiB whatever the budget, over 24e9 x 0.9 = 21.6e9 usable. The refusal advised
    settings that cannot lower it (gradient checkpointing, rollout.generation_batch_size, rollout.max_new_tokens, a
    number). What can: LoRA, named with the budget auto then chooses (the one a run with those settings gets), and
    a model of at most 21.6e9 / (31.58e9 / 1.544e9 = 20.5 bytes a parameter) = 1.06e9 parameters."""
    message = _refusal(tmp_path, monkeypatch, "qwen1.5b-paper.yaml", 24 * 10**9)
    assert message.startswith("config key 'train.micro_batch_tokens': auto: no budget fits the 22.4 GiB free")
    assert "(the generate moment alone: 29.4 GiB)" in message
    for cannot in ("gradient_checkpointing", "generation_batch_size", "max_new_tokens", "try anyway"):
        assert cannot not in message, message
    lora = re.search(LORA_ADVICE, message)
    assert lora, message
    chosen = _qwen_on_a_card(tmp_path, monkeypatch, "qwen1.5b-paper.yaml", 24 * 10**9, *LORA)
    assert chosen == int(lora[1].replace(",", ""))
    assert "a model of at most about 1.06B parameters (the generate moment's 20 bytes a parameter)" in message


def test_on_24_gb_no_vllm_share_is_advised_that_cannot_hold_vllm(tmp_path, monkeypatch):
    """Issue 59 item 4. qwen1.5b-vllm.yaml: the refusal said "set it to at most 0.12", less than vLLM's own bfloat16
    weights (2 x 1,543,714,304 = 3.09e9 bytes, 0.129 of 24e9), while the training state alone is over the card: the
    optimizer step moment (vLLM asleep then) holds the float32 weights, AdamW's moments and the gradients (the
    fused step of one process on a card allocates nothing more), 16 bytes x 1,543,714,304 = 24.7e9 bytes = 23.0 GiB,
    over 21.6e9 usable whatever vLLM's share. No share is advised; the moment is named; LoRA fits (and is what a
    run with it gets)."""
    message = _refusal(tmp_path, monkeypatch, "qwen1.5b-vllm.yaml", 24 * 10**9)
    assert message.startswith("config key 'rollout.vllm_memory': ")
    assert "set it to at most" not in message and "rollout.vllm_memory=" not in message, message
    assert "the optimizer step moment alone: 23.0 GiB" in message
    assert "less than vLLM's bfloat16 weights and one sequence's KV cache need (0.13 of the card)" in message
    lora = re.search(LORA_ADVICE, message)
    assert lora, message
    assert _qwen_on_a_card(tmp_path, monkeypatch, "qwen1.5b-vllm.yaml", 24 * 10**9, *LORA) == \
        int(lora[1].replace(",", ""))


@pytest.mark.parametrize(("card", "chosen"), [(48 * 10**9, 9216), (80 * 10**9, 9216)])
def test_on_48_and_80_gb_auto_takes_a_whole_mini_batch_and_says_so(tmp_path, monkeypatch, caplog, card, chosen):
    """qwen1.5b.yaml: a mini-batch is 2 groups x (8 x 512 + a prompt of 211) = 8,614 tokens, rounded up to 9 x
    1,024 = 9,216; the optimizer step moment (25.9 GiB) fits 48e9 x 0.9 = 43.2e9 usable."""
    with caplog.at_level(logging.INFO, logger="dapo_train"):
        assert _qwen_on_a_card(tmp_path, monkeypatch, "qwen1.5b.yaml", card) == chosen
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("train.micro_batch_tokens=auto")]
    assert len(said) == 1 and said[0].endswith("; a whole mini-batch")


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
