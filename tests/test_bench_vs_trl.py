"""scripts/bench/bench_vs_trl.py: the rehearsal shape gives both sides the same prompt ids, stop ids and sampling,
and --trl-compact changes which positions TRL's fused LM head scores, not what it returns. TRL is a dev
dependency (tests/test_trl_parity.py pins it), so these fail without it rather than skip."""

import argparse

import bench_vs_trl
import pytest
import torch
import trl.trainer.utils
from datasets import Dataset
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
from trl import GRPOTrainer
from trl.trainer.utils import add_fused_lm_head

QWEN_STOPS = [151_645, 151_643]  # <|im_end|> (the tokenizer's EOS), <|endoftext|> (also the pad)


def bench_args() -> argparse.Namespace:
    """The parsed options of a small rehearsal run."""
    return argparse.Namespace(shape="rehearsal", steps=3, prompts=2, group_size=2, max_new_tokens=4, micro_batch=2,
                              lr=1e-6, threads=1, seed=0, gsm8k=bench_vs_trl.GSM8K, trl_compact=False, ours=[], data=[])


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    """The rehearsal model and data folder, the bench's prompts through Qwen's tokenizer, and that tokenizer."""
    args = bench_args()
    args.model_path, args.data = bench_vs_trl.rehearsal_shape(args, tmp_path_factory.mktemp("bench"))
    return args, bench_vs_trl.fixed_prompts(args), AutoTokenizer.from_pretrained(args.model_path)


def test_rehearsal_prompts_are_qwen_chat_ids_of_gsm8k_questions(rehearsal):
    args, prompts, tokenizer = rehearsal
    assert len(prompts) == args.steps * args.prompts == 6
    assert prompts[0].question.startswith("Janet’s ducks lay 16 eggs per day.")  # GSM8K test row 0, in file order
    assert prompts[0].gold == "18"
    assert prompts[0].input_ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert prompts[0].text.endswith("<|im_start|>assistant\n")
    # What TRL's _tokenize_prompts does with a plain-string prompt gives the same ids (run_trl checks it too).
    assert all(tokenizer(p.text)["input_ids"] == list(p.input_ids) for p in prompts)
    assert 90 < len(prompts[0].input_ids) < 200  # real lengths: system prompt + a GSM8K question


def test_trl_stops_at_both_qwen_eos_ids_and_samples_plainly(rehearsal):
    args, prompts, tokenizer = rehearsal
    dataset = Dataset.from_list([{"prompt": p.text} for p in prompts])
    trainer = GRPOTrainer(model=args.model_path, reward_funcs=lambda completions, **_: [0.0] * len(completions),
                          args=bench_vs_trl.trl_config(args), train_dataset=dataset, processing_class=tokenizer)
    assert sorted(bench_vs_trl.check_trl_sampling(trainer, tokenizer)) == sorted(QWEN_STOPS)
    # The checks can fail: TRL stopping at the tokenizer's EOS only, or a field left to Qwen's generation_config
    # (top_k 20 there) would each change the work.
    trainer.eos_token_ids = [tokenizer.eos_token_id]
    with pytest.raises(SystemExit, match="TRL stops at"):
        bench_vs_trl.check_trl_sampling(trainer, tokenizer)
    trainer.eos_token_ids = QWEN_STOPS
    trainer.generation_config.top_k = None
    with pytest.raises(SystemExit, match="'top_k': 20"):
        bench_vs_trl.check_trl_sampling(trainer, tokenizer)


def scored_rows(model, input_ids, labels) -> tuple[int, torch.Tensor]:
    """How many positions TRL's chunked head computes logits for, and the log-probs it returns."""
    seen = []
    apply = trl.trainer.utils._ChunkedLogProbFunction.apply

    def counting(hidden, *rest):
        seen.append(hidden.shape[0])
        return apply(hidden, *rest)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trl.trainer.utils._ChunkedLogProbFunction, "apply", counting)
        out = model(input_ids=input_ids, labels=labels, fused_lm_head=True)
    return sum(seen), out.log_probs


def test_trl_compact_scores_only_the_labelled_positions(monkeypatch):
    monkeypatch.setattr(trl.trainer.utils, "_use_triton", trl.trainer.utils._use_triton)  # undone after the test
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    model = Qwen2ForCausalLM(config).eval()
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    input_ids = torch.randint(0, 96, (2, 10))
    labels = input_ids.clone()
    labels[:, :7] = -100  # a 7-token prompt, 3 completion tokens per row: 2 x 3 positions to score
    every, stock = scored_rows(model, input_ids, labels)
    bench_vs_trl.score_completions_only()
    compact, patched = scored_rows(model, input_ids, labels)
    assert every == 2 * 9  # CPU fallback: every shifted position, the prompt's included
    assert compact == 2 * 3
    torch.testing.assert_close(patched, stock)  # the same log-probs either way, zeros at the prompt


def test_bad_options_stop_before_any_model(capsys):
    cases = [(["--micro-batch", "3"], "--micro-batch must divide"), (["--steps", "2"], "--steps must be at least 3"),
             (["--shape", "huge"], "--shape huge: choose tiny, rehearsal or one of"),
             (["--shape", "rehearsal", "--gsm8k", "/nonexistent.jsonl"], "no such file"),
             (["--ours-b", "train.micro_batch_tokenz=0"], "--ours-b: config key 'train.micro_batch_tokenz'"),
             (["--ours", "train.micro_batch_tokens=-1"], "--ours: config key 'train.micro_batch_tokens'")]
    for argv, message in cases:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("sys.argv", ["bench_vs_trl.py", *argv])
            patch.setattr(bench_vs_trl, "run_side", None)  # a run started would fail the test
            with pytest.raises(SystemExit) as stop:
                bench_vs_trl.main()
        assert stop.value.code == 2
        assert message in capsys.readouterr().err


def test_summary_pairs_runs_by_repeat():
    def run(side, completions, tokens, rss):
        return {"side": side, "seconds_per_step": 1.0, "completions_per_s": completions, "tokens_per_s": tokens,
                "mean_completion_tokens": tokens / completions, "peak_rss_gib": rss}

    # dapo-train's work over two steps: 1,000 + 500 positions (100 + 50 padding), 300 + 100 head rows for
    # 200 + 100 trained tokens -> 5.00 forward, 10.0% padding, 1.33 head per trained token.
    from dapo_train.train.summary import update_work

    work = update_work([{"update_forward_tokens": 1000, "update_padding_tokens": 100, "update_head_tokens": 300,
                               "update_trained_tokens": 200},
                              {"update_forward_tokens": 500, "update_padding_tokens": 50, "update_head_tokens": 100,
                               "update_trained_tokens": 100}])
    work = {key: work[key] for key in ("forward_per_token", "padding_frac", "head_per_token")}
    runs = {"ours": [{**run("dapo-train", 4.0, 40.0, 1.0), **work}, {**run("dapo-train", 2.0, 30.0, 1.2), **work}],
            "trl": [run("TRL", 1.0, 20.0, 3.0), run("TRL", 2.0, 10.0, 2.0)]}
    lines = bench_vs_trl.summary(runs)
    assert "peak RSS 1.10 GiB (1.00-1.20)" in lines[0] and "peak RSS 2.50 GiB (2.00-3.00)" in lines[1]
    assert lines[0].endswith(", update per trained token: 5.00 forward positions (10.0% padding), 1.33 scored by "
                             "the head") and "per trained token" not in lines[1]
    # Paired: repeat 1 4/1 = 4, repeat 2 2/2 = 1 -> median 2.5; the ratio of medians would be 3/1.5 = 2.
    assert lines[-1].startswith("ratio dapo-train/TRL completions/s: 2.50 (3.0/s vs 1.5/s, median of 2, "
                                "paired ratios 1.00-4.00)")
    assert lines[-2].startswith("ratio dapo-train/TRL tokens/s: 2.50 (35.0/s vs 15.0/s, median of 2, "
                                "paired ratios 2.00-3.00)")  # 40/20 = 2, 30/10 = 3


def test_rehearsal_model_stops_at_each_eos_id_under_the_bench_sampling(rehearsal):
    """Built for the bench's sampling (temperature 1, no truncation), not Qwen's shipped one (0.7, top-k 20,
    under which a 151,936-way near-uniform draw would need a far smaller EOS weight)."""
    args, prompts, _ = rehearsal
    model = Qwen2ForCausalLM.from_pretrained(args.model_path).eval()
    assert model.generation_config.eos_token_id == QWEN_STOPS
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompts[0].input_ids])).logits[0, -1]  # (V,)
    probs = logits.softmax(-1)[QWEN_STOPS]
    assert logits.shape == (151_936,)
    assert ((0.01 < probs) & (probs < 0.04)).all(), probs  # rehearsal.EOS_RATE = 0.02 each, on average


def test_a_second_dapo_train_side_is_paired_with_each_other_side():
    """--ours-b: its line after TRL's; its ratios to TRL and to the first dapo-train side, paired by repeat,
    before the dapo-train/TRL lines, which stay last."""
    def run(side, completions):
        return {"side": side, "seconds_per_step": 1.0, "completions_per_s": completions,
                "tokens_per_s": 10 * completions, "mean_completion_tokens": 10.0, "peak_rss_gib": 1.0}

    runs = {"ours": [run("dapo-train", 4.0), run("dapo-train", 2.0)], "trl": [run("TRL", 1.0), run("TRL", 2.0)],
            "ours-b": [run("dapo-train[b]", 2.0), run("dapo-train[b]", 3.0)]}
    lines = bench_vs_trl.summary(runs)
    assert [line.split(":")[0] for line in lines[:3]] == ["dapo-train", "TRL", "dapo-train[b]"]
    # b/TRL: 2/1 = 2 and 3/2 = 1.5 -> 1.75; b/ours: 2/4 = 0.5 and 3/2 = 1.5 -> 1.0; ours/TRL: 4 and 1 -> 2.5.
    assert lines[4].startswith("ratio dapo-train[b]/TRL completions/s: 1.75 (2.5/s vs 1.5/s, median of 2, "
                               "paired ratios 1.50-2.00)")
    assert lines[6].startswith("ratio dapo-train[b]/dapo-train completions/s: 1.00 (2.5/s vs 3.0/s, median of 2, "
                               "paired ratios 0.50-1.50)")
    assert lines[-1].startswith("ratio dapo-train/TRL completions/s: 2.50") and len(lines) == 9


def test_dapo_trains_the_fixed_prompts_in_order(monkeypatch):
    """dapo-train's side on the shipped tiny model, 3 short steps: the prompts go in file order through a
    sampler whose state the trainer reads (the stand-in once lacked it and the side crashed)."""
    from dapo_train.task.locations import TINY_MODEL_DIR

    args = argparse.Namespace(**{**vars(bench_args()), "shape": "tiny", "model_path": str(TINY_MODEL_DIR),
                                 "group_size": 2, "ours_b": ["train.micro_batch_tokens=512"]})
    prompts = bench_vs_trl.fixed_prompts(args)
    sampler = bench_vs_trl.fixed_order(prompts)
    assert sampler.next_batch(4) == prompts[:4] and sampler.state_dict()["position"] == 4
    drawn = []
    original = bench_vs_trl.fixed_order
    monkeypatch.setattr(bench_vs_trl, "fixed_order", lambda prompts: drawn.append(original(prompts)) or drawn[-1])
    result = bench_vs_trl.run_ours(args, "dapo-train[b]", tuple(args.ours_b))
    assert result["side"] == "dapo-train[b]" and result["completions_per_s"] > 0
    assert drawn[0].state_dict()["position"] == 6  # 3 steps x 2 prompts, in order
