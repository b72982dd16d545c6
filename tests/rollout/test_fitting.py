"""A generate call out of memory (rollout/fitting.py): its prompts decoded again in halves from the random state
the call began with, so the completions are the ones calls of the smaller size draw from the start, even when
the failed call had drawn tokens before it ran out; one group alone that does not fit stops (DoesNotFit)."""

import pytest
import torch

from dapo_train.errors import DoesNotFit
from dapo_train.rollout import sample_completions
from dapo_train.rollout.decoding import decode_loop
from dapo_train.rollout.fitting import GenerationRows
from dapo_train.rollout.sampling import SamplingSettings

PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11], [12]]
SETTINGS = SamplingSettings(6, temperature=1.0)


def _failing_over(rows: int):
    """decode_loop, but a call of more than `rows` rows draws from the global stream and then runs out of
    memory, as a call does that fails some tokens in."""
    def decode(model, prompts, group_size, *args, **kwargs):
        if len(prompts) * group_size > rows:
            torch.rand(1000)
            raise torch.OutOfMemoryError("a fault of this test")
        return decode_loop(model, prompts, group_size, *args, **kwargs)
    return decode


def _sample(model, tokenizer, batch_size, decode=decode_loop):
    torch.manual_seed(7)
    return [c.completion_ids.tolist() for c in sample_completions(model, tokenizer, PROMPTS, SETTINGS,
                                                                   batch_size=batch_size, group_size=2,
                                                                   decode=decode)]


def test_the_halves_draw_what_the_smaller_calls_draw_from_the_start(random_model, id_tokenizer, caplog):
    rows = GenerationRows(8)
    redone = _sample(random_model, id_tokenizer, rows, _failing_over(4))
    assert rows.limit == 4  # kept for the engine's later calls
    assert redone == _sample(random_model, id_tokenizer, 4)
    assert redone != _sample(random_model, id_tokenizer, 8)  # the draws do depend on the call's size
    assert len([r for r in caplog.records if "out of memory in a generate call of 8 rows" in r.getMessage()]) == 1


def test_one_group_that_does_not_fit_alone_stops(random_model, id_tokenizer):
    with pytest.raises(DoesNotFit, match="one group alone .2 rows. does not fit"):
        _sample(random_model, id_tokenizer, GenerationRows(8), _failing_over(1))
