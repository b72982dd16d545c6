"""The tiny build's training maths (scripts/build/tiny_sft.py, used by make_tiny_model.py): the shortcuts it
takes for speed give the loss and gradient of the plain computation."""

import json

import pytest
import torch
from transformers import AutoTokenizer

from dapo_train.task.locations import TINY_DATA_DIR, TINY_MODEL_DIR

import tiny_sft


@pytest.fixture(scope="module")
def setup(build):
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    lines = (TINY_DATA_DIR / "train.jsonl").read_text(encoding="utf-8").splitlines()[:7]
    examples = build.encode_examples(tokenizer, [json.loads(line) for line in lines])
    torch.manual_seed(0)
    model = build.build_model(tokenizer)
    shared = tiny_sft.shared_prefix_length(examples)
    prefix = torch.tensor(examples[0][0][:shared])[None]
    rows = [(prompt[shared:], completion) for prompt, completion in examples]
    return model, tokenizer.pad_token_id, examples, prefix, rows


def grads(model):
    out = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


def test_the_shared_prefix_gives_the_full_forward_loss_and_gradient(setup):
    model, pad_id, examples, prefix, rows = setup
    input_ids, labels = tiny_sft._batch(examples, pad_id)
    plain = model(input_ids=input_ids, labels=labels).loss
    plain.backward()
    expected = grads(model)
    shortcut = tiny_sft.sft_loss(model, prefix, *tiny_sft._batch(rows, pad_id))
    shortcut.backward()
    assert torch.allclose(shortcut, plain, atol=1e-5)
    for got, want in zip(grads(model), expected):
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("pieces", [2, 3, 7, 20])
def test_micro_batches_give_the_whole_batch_loss_and_gradient(setup, pieces):
    model, pad_id, _, prefix, rows = setup
    whole = tiny_sft.accumulate_batch(model, prefix, rows, pad_id, micro_batches=1)
    expected = grads(model)
    split = tiny_sft.accumulate_batch(model, prefix, rows, pad_id, micro_batches=pieces)
    assert torch.allclose(split, whole, atol=1e-5)
    for got, want in zip(grads(model), expected):
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)


def test_masked_labels_train_only_the_unmasked_tokens(setup):
    """(prompt, completion, labels) rows, as make_tiny_tools_model.py masks its tool turns: the micro-batched
    loss is the mean over the labelled tokens, as one forward with those labels gives it."""
    model, pad_id, examples, prefix, rows = setup
    masked = [(prompt, completion, [-100 if i % 3 == 1 else t for i, t in enumerate(completion)])
              for prompt, completion in rows]
    input_ids, _ = tiny_sft._batch(rows, pad_id)
    labels = torch.full_like(input_ids, -100)
    for row, (prompt, completion, targets) in enumerate(masked):
        labels[row, len(prompt) : len(prompt) + len(completion)] = torch.tensor(targets)
    cache = model.model(input_ids=prefix, use_cache=True).cache
    cache.batch_repeat_interleave(len(rows))
    plain = model(input_ids=input_ids, labels=labels, cache=cache).loss
    plain.backward()
    expected = grads(model)
    split = tiny_sft.accumulate_batch(model, prefix, masked, pad_id, micro_batches=3)
    assert torch.allclose(split, plain, atol=1e-5)
    for got, want in zip(grads(model), expected):
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
    unmasked = tiny_sft.accumulate_batch(model, prefix, rows, pad_id, micro_batches=3)
    model.zero_grad(set_to_none=True)
    assert not torch.allclose(unmasked, split, atol=1e-3)


def test_the_shipped_model_is_what_the_default_build_makes(build):
    """build_info.json records the phase lengths and slip rate the shipped weights were built with."""
    info = json.loads((TINY_MODEL_DIR / "build_info.json").read_text(encoding="utf-8"))
    defaults = build.parse_args([])
    assert (info["sft_steps"], info["slip_steps"], info["slip_rate"]) == (
        defaults.steps, defaults.slip_steps, defaults.slip_rate)


def test_measure_writes_the_shipped_keys_and_greedy_examples(build, tmp_path):
    """measure() (dapo-train eval's prompts and evaluate_prompts) on the first test items gives the
    keys build_info.json holds and, greedy being deterministic, its example completions."""
    from transformers import Qwen2ForCausalLM

    info = json.loads((TINY_MODEL_DIR / "build_info.json").read_text(encoding="utf-8"))
    lines = (TINY_DATA_DIR / "test.jsonl").read_text(encoding="utf-8").splitlines()[:5]
    (tmp_path / "test.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    model = Qwen2ForCausalLM.from_pretrained(TINY_MODEL_DIR).eval()
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    measured = build.measure(model, tokenizer, tmp_path, n_sampled=2, k=8)
    keys = {"greedy_accuracy", "greedy_format_rate", "greedy_accuracy_on_sampled_items", "pass@8_T1",
            "mean_accuracy_T1", "informative_groups_T1", "example_greedy"}
    assert set(measured) == keys and keys <= set(info)
    assert measured["example_greedy"] == info["example_greedy"]
    assert measured["greedy_format_rate"] == 1.0 and measured["greedy_accuracy"] in {i / 5 for i in range(6)}
    assert 0 <= measured["informative_groups_T1"] <= measured["pass@8_T1"] <= 1
