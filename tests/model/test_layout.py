"""How a micro-batch is laid out in rows (dapo_train.model.layout): packed rows sharing each group's
prompt under a block-diagonal mask, balanced, and no wider than the row limit a token budget sets.
That the packed layout scores as one row per completion does is tests/train/update/test_packing.py's."""

import torch

from dapo_train.model.layout import SHARED_ROW_LIMIT, collate, row_limit, shared_rows


def test_runs_share_rows_with_a_block_diagonal_mask_and_restarting_positions():
    prompts = [torch.tensor([5, 6, 7])] * 2 + [torch.tensor([8, 9])] + [torch.tensor([10])]
    completions = [torch.tensor([11, 12, 13, 14]), torch.tensor([15, 16]), torch.tensor([17, 18]), torch.tensor([19])]
    batch = collate(prompts, completions, 0, share_prefix=True)
    # Runs of 9, 4 and 2 tokens: the widest sets the row width, the other two share one row.
    assert batch.input_ids.tolist() == [[5, 6, 7, 11, 12, 13, 14, 15, 16], [8, 9, 17, 18, 10, 19, 0, 0, 0]]
    assert batch.position_ids[1].tolist()[:6] == [0, 1, 2, 3, 0, 1]
    assert batch.padding_tokens == 3 and batch.rows.tolist() == [0, 0, 1, 1]
    assert batch.positions[3, 0] == 4  # token 0 of the last completion is predicted by its own prompt's end
    mask = batch.attention_mask[1, 0]
    assert mask[5].tolist() == [False] * 4 + [True, True, False, False, False]  # sees its own run only
    assert mask[3].tolist() == [True] * 4 + [False] * 5
    assert batch.attention_mask[0, 0, 7].tolist() == [True] * 3 + [False] * 4 + [True, False]


def test_shared_rows_are_the_fewest_then_balanced_and_repeat_a_cut_runs_prompt():
    one_run = [True] + [False] * 6
    # greedy at 9 would give rows of 9 and 7 tokens; the balanced cut gives 8 and 8 (prompt 2 repeated)
    assert shared_rows([2] * 7, [6, 1, 1, 1, 1, 1, 1], one_run, 9) == [(0, 1, 8), (1, 7, 8)]
    assert shared_rows([3] * 4, [5] * 4, [True, False, False, False], 13) == [(0, 2, 13), (2, 4, 13)]
    assert shared_rows([3] * 4, [5] * 4, [True, False, True, False], 30) == [(0, 4, 26)]
    assert shared_rows([2, 2], [20, 1], [True, True], 9) == [(0, 1, 22), (1, 2, 3)]  # over the cap: alone


def test_the_row_limit_follows_the_budget_up_to_the_fixed_limit():
    assert row_limit(0) == 0  # no budget: rows as wide as the widest group
    assert row_limit(2048) == 1024 and row_limit(3) == 1
    assert row_limit(10 * SHARED_ROW_LIMIT) == SHARED_ROW_LIMIT


def test_rows_are_no_wider_than_the_limit_a_wider_group_is_cut_and_a_wider_sequence_is_alone():
    # One group: prompt of 3, completions of 4, 4, 4 and 9 tokens (a run of 24 tokens).
    prompts = [torch.tensor([5, 6, 7])] * 4
    completions = [torch.arange(10, 14), torch.arange(20, 24), torch.arange(30, 34), torch.arange(40, 49)]
    wide = collate(prompts, completions, 0, share_prefix=True)
    assert wide.input_ids.shape == (1, 24)
    # Limit 11: 3 + 4 + 4 fits, the prompt is repeated in the next row, the 3 + 9 = 12 sample is alone.
    narrow = collate(prompts, completions, 0, share_prefix=True, row_tokens=11)
    assert narrow.input_ids.tolist() == [[5, 6, 7, 10, 11, 12, 13, 20, 21, 22, 23, 0],
                                         [5, 6, 7, 30, 31, 32, 33, 0, 0, 0, 0, 0],
                                         [5, 6, 7, *range(40, 49)]]
    assert narrow.rows.tolist() == [0, 0, 1, 2] and narrow.padding_tokens == 1 + 5
    # the second completion sits at 7-10 of row 0: token 0 is predicted by the prompt's end, token t by 7 + t - 1
    assert narrow.positions[1, :4].tolist() == [2, 7, 8, 9]
    assert narrow.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 3, 4, 5, 6, 0]
