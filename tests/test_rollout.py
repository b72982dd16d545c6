"""Rollout masks, explicit sampling settings, and scoring that reproduces generation log-probs."""

import torch

from dapo_train.logprobs import collate, score_tokens
from dapo_train.rollout import SamplingSettings, completion_mask, eos_token_ids, generate_completions

from conftest import EOS2_ID, EOS_ID


def test_mask_includes_first_eos_and_excludes_padding_that_is_also_eos():
    generated = torch.tensor(
        [
            [5, 6, EOS_ID, EOS2_ID, EOS2_ID],  # EOS at t=2, then pad (= the second EOS id)
            [5, EOS2_ID, EOS2_ID, EOS2_ID, EOS2_ID],  # ends on the pad-valued EOS: only it counts
            [5, 6, 7, 8, 9],  # no EOS within the budget: truncated, every token valid
            [EOS_ID, 3, 3, 3, 3],  # an immediate EOS is a one-token completion
        ]
    )
    mask, truncated = completion_mask(generated, [EOS_ID, EOS2_ID])
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert truncated.tolist() == [False, False, True, False]


def test_eos_ids_come_from_generation_config_and_tokenizer(random_model, id_tokenizer):
    assert eos_token_ids(random_model, id_tokenizer) == [EOS_ID, EOS2_ID]


def test_rollout_ignores_the_checkpoints_sampling_defaults(random_model):
    """The model's generation_config has repetition_penalty 1.3, top_k 5, top_p 0.5: with explicit
    settings (temperature 0.7, no top-k/top-p) the processed scores must be raw logits / 0.7."""
    settings = SamplingSettings(max_new_tokens=6, temperature=0.7)
    torch.manual_seed(0)
    out = random_model.generate(
        input_ids=torch.tensor([[3, 4, 5, 6]]), attention_mask=torch.ones(1, 4, dtype=torch.long),
        eos_token_id=[EOS_ID, EOS2_ID], pad_token_id=EOS2_ID, return_dict_in_generate=True,
        output_logits=True, output_scores=True, **settings.generate_kwargs(),
    )
    for raw, processed in zip(out.logits, out.scores):
        assert torch.isfinite(processed).all()  # nothing filtered by top-k / top-p
        torch.testing.assert_close(processed, raw / 0.7)


def test_scoring_reproduces_generation_logprobs_with_left_padding(random_model, id_tokenizer):
    prompts = [[3, 4, 5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15]]  # different lengths -> left padding
    torch.manual_seed(1)
    settings = SamplingSettings(max_new_tokens=12, temperature=0.9)
    completions = generate_completions(
        random_model, id_tokenizer, [p for p in prompts for _ in range(3)], settings, batch_size=9, return_logprobs=True
    )
    batch = collate([c.prompt_ids for c in completions], [c.completion_ids for c in completions], pad_id=EOS2_ID)
    with torch.no_grad():
        logprobs, _ = score_tokens(random_model, batch, temperature=0.9, chunk_size=7)
    for row, c in enumerate(completions):
        assert c.length >= 1
        torch.testing.assert_close(logprobs[row, : c.length], c.generation_logprobs, atol=1e-4, rtol=0)
        assert batch.completion_mask[row].sum() == c.length  # EOS counted, padding not


def test_truncated_rows_are_flagged_and_keep_all_tokens(random_model, id_tokenizer):
    random_model.generation_config.eos_token_id = [EOS_ID]
    # Forbid both EOS ids so no row can stop early.
    random_model.lm_head.weight.data[EOS_ID] = -50.0
    random_model.lm_head.weight.data[EOS2_ID] = -50.0
    settings = SamplingSettings(max_new_tokens=5, do_sample=False)
    completions = generate_completions(random_model, id_tokenizer, [[3, 4], [5, 6, 7]], settings, batch_size=2)
    assert [c.truncated for c in completions] == [True, True]
    assert [c.length for c in completions] == [5, 5]
