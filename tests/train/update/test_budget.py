"""train.micro_batch_tokens=auto's arithmetic (train/update/budget.py): the choice is arithmetic on the estimate's
lines, the free memory and the margin, checked here by hand at 24, 48 and 80 GB; the lines agree with the estimate;
the vLLM share's room; what a card's choice is called; Batching.halved, the retry's smaller budget; and no stage
of a step calls across ranks itself. The choice at start on a card: test_card.py."""


import pytest
import torch
from transformers import Qwen2Config

from dapo_train.config.load import load_config
from dapo_train.train.memory import ModelShape, Setting, estimate
from dapo_train.train.update.batching import Batching
from dapo_train.train.update.budget import Line, Need, budget_lines, choose_budget, describe_choice, vllm_room

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


@pytest.mark.parametrize(("card", "need", "said"), [
    (80 * 10**9, NEED, "32,768"),  # 32 x 1,024 (above), under the cap of 65,536
    (80 * 10**9, Need(600, 16384), "16,384 (a whole mini-batch)"),  # the cap: a larger budget changes nothing
    # generation's fixed 14e9 bytes = 13.04 GiB over 15e9 x 0.9 = 13.5e9: no budget can lower it
    (15 * 10**9, NEED, "none fits (the generate moment alone: 13.0 GiB)"),
    # every fixed line fits 21.6e9, but one sequence of 8,000 tokens peaks at the recomputing branch:
    # 6e9 + 2e6 x 8,000 = 22e9 bytes = 20.5 GiB (the backward: 10e9 + 1e6 x 8,000 = 18e9)
    (24 * 10**9, Need(8000, 64 * 1024), "none fits (one sequence of 8,000 tokens alone: 20.5 GiB at the backward, "
                                        "recomputing a layer)"),
])
def test_a_cards_choice_says_why_none_fits_and_when_it_is_a_whole_mini_batch(card, need, said):
    """Issue 59 (item 16): preflight's "24 GB none fits" gave no reason, and its 80 GB 9216 did not say it was a
    whole mini-batch."""
    assert describe_choice(LINES, need, card) == said


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


def test_the_steps_stages_make_no_collective_call_of_their_own():
    """Ranks cross only through train/ranks.py (its docstring): no module under train/update/ or train/collect/
    calls distributed's collectives itself (update/budget.py all-reduced the cards' free memory)."""
    import ast
    from pathlib import Path

    collectives = {"all_reduce", "gather", "broadcast", "barrier"}
    package = Path(__file__).resolve().parents[3] / "dapo_train" / "train"
    calls = []
    for path in sorted([*(package / "update").glob("*.py"), *(package / "collect").glob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in collectives \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in ("distributed", "dist"):
                calls.append(f"{path.name}:{node.lineno}")
    assert calls == []
