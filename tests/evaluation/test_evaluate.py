"""Evaluation: pass@k / maj@k / interval maths by hand, determinism and `dapo-train eval` on the
tiny shipped model (16 items, short completions, so the file stays fast on a 2-core CPU)."""

import dataclasses
import itertools
import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from dapo_train.config.load import load_config, save_config
from dapo_train.config.schema import ModelConfig
from dapo_train.errors import UserError
from dapo_train.evaluation import command as eval_command
from dapo_train.evaluation.command import EvalOptions, run_eval
from dapo_train.evaluation.generate import completion_records, evaluate_prompts
from dapo_train.evaluation.settings import result_name
from dapo_train.evaluation.stats import majority_answer, mean_stderr, pass_at_k, summarize_records, wilson_interval
from dapo_train.model.loading import load_model, load_tokenizer
from dapo_train.rollout import Completion
from dapo_train.task.prompts import Prompt, fixed_eval_subset, load_prompts

STABLE_KEYS = {
    "accuracy", "accuracy_stderr", "accuracy_ci95_low", "accuracy_ci95_high", "answer_accuracy", "format_gap",
    "format_rate",
    "completion_length_mean", "completion_length_max", "truncated_rate", "num_items",
}
RECORD_KEYS = {"question", "gold", "completion", "extracted", "correct", "answer_correct"}
ITEMS, NEW_TOKENS = 16, 12


# --------------------------------------------------------------------------------------------
# Pure statistics.


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (5, 2, 2, 1 - 3 / 10),  # C(3,2)=3 all-wrong pairs of C(5,2)=10
        (10, 3, 5, 1 - 21 / 252),  # C(7,5)=21, C(10,5)=252
        (8, 3, 1, 3 / 8),  # pass@1 is the plain fraction correct
        (4, 0, 4, 0.0),  # n = k, nothing correct
        (4, 1, 4, 1.0),  # n = k: the only 4-subset holds the correct one
        (3, 3, 2, 1.0),  # c = n
        (6, 0, 1, 0.0),  # c = 0
        (6, 5, 2, 1.0),  # n - c = 1 < k: every pair holds a correct one
    ],
)
def test_pass_at_k_matches_the_formula(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_is_the_chance_a_random_k_subset_holds_a_correct_sample():
    # Brute force over all k-subsets of n samples whose first c are correct.
    for n in range(1, 7):
        for c in range(n + 1):
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(range(n), k))
                hits = sum(any(i < c for i in subset) for subset in subsets)
                assert pass_at_k(n, c, k) == pytest.approx(hits / len(subsets), abs=1e-12), (n, c, k)


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


@pytest.mark.parametrize(
    "answers, expected",
    [
        (["3", "5", "5"], "5"),  # plain majority
        (["7", "3", "3", "7"], "7"),  # 2-2 tie: "7" was voted first
        (["3", "7", "7", "3"], "3"),  # same votes, other order: the first-seen wins again
        ([None, None, "4"], "4"),  # no answer is not a vote
        ([None, None], None),  # nobody answered
        (["1", "2", "3"], "1"),  # three-way tie of single votes
    ],
)
def test_majority_answer_and_its_tie_rule(answers, expected):
    assert majority_answer(answers) == expected


def test_wilson_interval_by_hand():
    # z = 1.96, z^2 = 3.8415; n = 16: 1 + z^2/n = 1.24010.
    # p = 0.5: centre stays 0.5; half = z * sqrt(0.25/16 + z^2/1024) / 1.24010 = 0.22001.
    low, high = wilson_interval(0.5, 16)
    assert (low, high) == pytest.approx((0.5 - 0.22001, 0.5 + 0.22001), abs=1e-4)
    # p = 0: centre = (z^2/32) / 1.24010 = 0.096806 and half the same, so [0, 0.19361]:
    # unlike mean +- 1.96 stderr it does not collapse to a point.
    assert wilson_interval(0.0, 16) == pytest.approx((0.0, 0.19361), abs=1e-4)


def test_mean_stderr_is_the_binomial_one_for_bits():
    mean, stderr = mean_stderr([1.0] * 4 + [0.0] * 12)
    assert mean == 0.25
    assert stderr == pytest.approx(math.sqrt(0.25 * 0.75 / 16))  # sqrt(p (1 - p) / N)


def _record(gold, extracted, length=10, truncated=False, format_ok=True):
    return {
        "gold": gold, "extracted": extracted, "correct": extracted == gold, "answer_correct": extracted == gold,
        "length": length, "truncated": truncated, "format_ok": format_ok,
    }


# Five completions whose strict grading (the last <answer> block, as the reward reads it) and answer grading
# (the block, else the last \boxed{}, else the last number) differ: (gold, text, strict, answer).
GRADED_TWICE = [
    ("12", "<think>3 × 4 = 12</think>\n<answer>\n12\n</answer>", True, True),
    ("7", "3 + 4 = 7", False, True),  # no block: the last number
    ("30", "The total is \\boxed{30}, checked on 2 cases.", False, True),  # \boxed{} before the last number
    ("5", "<answer>\n4\n</answer> or maybe 5", False, False),  # a block is the answer, whatever follows
    ("5", "6 apples", False, False),  # wrong either way
]


def test_strict_and_answer_accuracy_of_completions_graded_differently():
    prompts = [Prompt(f"test:{i}", "q", gold, "p", (3,)) for i, (gold, *_) in enumerate(GRADED_TWICE)]
    completions = [Completion(torch.tensor([3]), torch.tensor([4, 2]), False, text) for _, text, *_ in GRADED_TWICE]
    records = completion_records(prompts, completions, 1)
    assert [r["correct"] for r in records] == [strict for *_, strict, _ in GRADED_TWICE]
    assert [r["answer_correct"] for r in records] == [answer for *_, answer in GRADED_TWICE]
    metrics = summarize_records(records, samples=1)
    # strict: item 1 of 5; answer: items 1-3 of 5; the gap, 0.6 - 0.2, is the answers' format.
    assert (metrics["accuracy"], metrics["answer_accuracy"]) == pytest.approx((0.2, 0.6))
    assert metrics["format_gap"] == pytest.approx(0.4)


def test_summary_of_greedy_records():
    # 16 items, the first 8 correct; lengths 1..16, the last 4 truncated, 12 well formatted.
    records = [
        _record("1", "1" if i < 8 else "2", length=i + 1, truncated=i >= 12, format_ok=i % 4 != 0)
        for i in range(16)
    ]
    metrics = summarize_records(records, samples=1)
    assert STABLE_KEYS <= set(metrics)
    assert metrics["accuracy"] == 0.5
    assert metrics["accuracy_stderr"] == pytest.approx(0.125)  # sqrt(0.5 * 0.5 / 16)
    assert (metrics["accuracy_ci95_low"], metrics["accuracy_ci95_high"]) == pytest.approx((0.27999, 0.72001), abs=1e-4)
    assert metrics["format_rate"] == 12 / 16
    assert metrics["completion_length_mean"] == 8.5  # mean of 1..16
    assert metrics["completion_length_max"] == 16
    assert metrics["truncated_rate"] == 4 / 16
    assert metrics["num_items"] == 16
    assert "pass@1" not in metrics


def test_summary_of_sampled_records():
    # 4 items x K = 4 samples, gold "1" everywhere.
    items = [
        ["2", "2", None, "3"],  # c = 0; majority "2" wrong
        ["1", "2", "2", None],  # c = 1; majority "2" wrong
        ["1", "1", "1", "1"],  # c = 4; majority right
        ["2", "1", "1", "2"],  # c = 2; 2-2 tie, "2" voted first: wrong by the tie rule
    ]
    records = [_record("1", answer) for item in items for answer in item]
    metrics = summarize_records(records, samples=4)
    # pass@1 = mean c / K = (0 + 1 + 4 + 2) / 16; pass@4 = share of items with c > 0 = 3/4.
    assert metrics["pass@1"] == pytest.approx(7 / 16)
    assert metrics["accuracy"] == pytest.approx(7 / 16)
    assert metrics["pass@4"] == pytest.approx(3 / 4)
    assert metrics["maj@4"] == pytest.approx(1 / 4)
    # per-item scores 0, .25, 1, .5 around their mean .4375: squared deviations .19140625,
    # .03515625, .31640625, .00390625 sum to .546875; population variance .13671875 over 4 items.
    assert metrics["accuracy_stderr"] == pytest.approx(math.sqrt(0.13671875 / 4))
    assert metrics["num_items"] == 4


# --------------------------------------------------------------------------------------------
# The tiny model.


@pytest.fixture(scope="module")
def tiny():
    # One intra-op thread: on a busy 2-core machine, thread spin-waits make the tiny model's
    # generation about 30x slower than a single thread.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model_cfg = ModelConfig()
    tokenizer = load_tokenizer(model_cfg)
    model = load_model(model_cfg, torch.device("cpu"))
    prompts, _ = load_prompts(load_config(None, []).data, tokenizer, "test")
    yield model, tokenizer, fixed_eval_subset(prompts, ITEMS)
    torch.set_num_threads(threads)


def test_greedy_eval_is_deterministic_and_restores_train_mode(tiny):
    model, tokenizer, prompts = tiny
    model.train()
    first = evaluate_prompts(model, tokenizer, prompts, max_new_tokens=NEW_TOKENS, batch_size=8)
    assert model.training  # switched to eval for generation, back to train afterwards
    second = evaluate_prompts(model, tokenizer, prompts, max_new_tokens=NEW_TOKENS, batch_size=8)
    assert first.metrics == second.metrics
    assert first.records == second.records
    assert STABLE_KEYS <= set(first.metrics) and first.metrics["num_items"] == ITEMS
    assert len(first.records) == ITEMS and RECORD_KEYS <= set(first.records[0])
    assert [r["gold"] for r in first.records] == [p.gold for p in prompts]
    assert all(0 < r["length"] <= NEW_TOKENS for r in first.records)


def test_sampled_eval_is_reproducible_and_leaves_the_callers_rng_alone(tiny):
    model, tokenizer, prompts = tiny
    before = torch.get_rng_state()
    runs = [
        evaluate_prompts(
            model, tokenizer, prompts[:4], max_new_tokens=8, batch_size=8, samples=3, temperature=1.0, seed=7
        )
        for _ in range(2)
    ]
    assert torch.equal(torch.get_rng_state(), before)
    assert runs[0].records == runs[1].records
    assert [r["sample"] for r in runs[0].records[:3]] == [0, 1, 2]
    assert {"pass@1", "pass@3", "maj@3"} <= set(runs[0].metrics)
    assert len(runs[0].records) == 4 * 3


# --------------------------------------------------------------------------------------------
# `dapo-train eval`: targets, files, comparison, errors.

EVAL_OPTIONS = EvalOptions(limit=ITEMS, batch_size=8, max_new_tokens=NEW_TOKENS)
NAME = f"test_limit{ITEMS}_len{NEW_TOKENS}"  # what EVAL_OPTIONS evaluates: 16 of 500 items, 12-token budget


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory, tiny):
    """outputs/run/checkpoint_{1,2}: the tiny model, then with perturbed weights; cwd-relative."""
    model, tokenizer, _ = tiny
    root = tmp_path_factory.mktemp("evalrun")
    run = root / "outputs" / "run"
    cfg = load_config(None, [f"output_dir={run}"])
    original = {name: p.detach().clone() for name, p in model.named_parameters()}
    generator = torch.Generator().manual_seed(0)
    for step in (1, 2):
        folder = run / f"checkpoint_{step}"
        if step == 2:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(p.std() * torch.randn(p.shape, generator=generator))  # noise as large as the weights
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        save_config(cfg, folder / "config.yaml")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(original[name])
    return root


def test_two_checkpoints_compared_in_one_call(run_folder, tiny, monkeypatch, capsys):
    monkeypatch.chdir(run_folder)
    first = "outputs/run/checkpoint_1"
    results = run_eval([first, "checkpoint_2"], EVAL_OPTIONS)  # bare name: the latest run's
    assert len(results) == 2 and all(STABLE_KEYS <= set(m) for m in results)
    printed = capsys.readouterr()
    table = printed.out
    # Each checkpoint's progress on stderr: a bar over its 16 items (2 generate calls of 8), left at the end
    # with the rate (tqdm shows s/item below one item a second).
    bars = printed.err.split("eval:   0%|")[1:]
    assert len(bars) == 2, printed.err
    assert all(re.search(r"eval: 100%\|[^|]*\| 16/16 \[[^]]*(item/s|s/item)\]", bar) for bar in bars), printed.err
    assert first in table and "outputs/run/checkpoint_2" in table and "95% CI" in table  # bare name resolved
    completions = []
    for step, metrics in zip((1, 2), results):
        folder = run_folder / "outputs" / "run" / f"checkpoint_{step}"
        saved = json.loads((folder / f"eval_{NAME}.json").read_text())
        assert saved["metrics"] == metrics
        assert saved["checkpoint"] == str(folder.relative_to(run_folder))
        assert saved["split"] == "test" and saved["time"]
        assert saved["config"]["model"]["name_or_path"] == saved["checkpoint"]
        lines = (folder / f"completions_{NAME}.jsonl").read_text().splitlines()
        assert len(lines) == ITEMS and RECORD_KEYS <= set(json.loads(lines[0]))
        completions.append([json.loads(line)["completion"] for line in lines])
    assert completions[0] != completions[1]  # the perturbed weights really are another model
    # The command evaluates exactly what evaluate_prompts does on the same items.
    model, tokenizer, prompts = tiny
    direct = evaluate_prompts(model, tokenizer, prompts, max_new_tokens=NEW_TOKENS, batch_size=8)
    assert results[0] == direct.metrics


def test_config_only_evaluates_the_configs_model_and_writes_beside_output_dir(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text("output_dir: out\n")  # model and data: the shipped defaults
    options = dataclasses.replace(EVAL_OPTIONS, config_path="tiny.yaml", limit=4, max_new_tokens=4, split="train")
    (metrics,) = run_eval([], options)
    saved = json.loads((tmp_path / "out.eval" / "builtin-tiny" / "eval_train_limit4_len4.json").read_text())
    assert saved["metrics"] == metrics and metrics["num_items"] == 4
    assert saved["split"] == "train" and saved["settings"]["max_new_tokens"] == 4
    printed = capsys.readouterr().out
    assert "builtin:tiny (--config)" in printed and "out.eval/builtin-tiny/eval_train_limit4_len4.json" in printed


def _no_model(monkeypatch):
    """Make any model load fail the test: errors must come before the first model loads."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was validated")

    monkeypatch.setattr(eval_command, "load_model", refuse)


def test_missing_checkpoint_lists_the_folder_before_any_model_loads(run_folder, monkeypatch):
    monkeypatch.chdir(run_folder)
    _no_model(monkeypatch)
    with pytest.raises(
        UserError, match=r"not found: outputs/run/checkpoint_9; outputs/run holds: checkpoint_1/, checkpoint_2/"
    ):
        run_eval(["outputs/run/checkpoint_1", "outputs/run/checkpoint_9"], EVAL_OPTIONS)
    with pytest.raises(
        UserError, match=r"checkpoint_9 not found in the latest run, outputs/run \(trained last\); its checkpoints: "
        r"checkpoint_1, checkpoint_2"
    ):
        run_eval(["checkpoint_9"], EVAL_OPTIONS)
    with pytest.raises(UserError, match=r"run folder, its checkpoints: checkpoint_1, checkpoint_2"):
        run_eval(["outputs/run"], EVAL_OPTIONS)


def test_checkpoint_without_saved_config_asks_for_config(tmp_path, tiny, monkeypatch):
    model, tokenizer, _ = tiny
    folder = tmp_path / "checkpoint_5"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    _no_model(monkeypatch)
    with pytest.raises(UserError, match=r"checkpoint has no saved config.yaml; pass --config CONFIG"):
        run_eval([str(folder)], EVAL_OPTIONS)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"samples": 0}, "--samples must be >= 1"),
        ({"samples": 4, "temperature": 0.0}, "--temperature must be > 0"),
        ({"batch_size": 0}, "--batch-size must be >= 1"),
        ({"split": "nope"}, "split 'nope' not found"),
        ({"overrides": ("eval.batchsize=3",)}, "did you mean 'eval.batch_size'"),
    ],
)
def test_bad_options_fail_before_any_model_loads(run_folder, monkeypatch, change, message):
    monkeypatch.chdir(run_folder)
    _no_model(monkeypatch)
    with pytest.raises(UserError, match=message):
        run_eval(["outputs/run/checkpoint_1"], dataclasses.replace(EVAL_OPTIONS, **change))


def test_nothing_to_evaluate():
    with pytest.raises(UserError, match="nothing to evaluate"):
        run_eval([], EVAL_OPTIONS)


def test_an_old_checkpoint_with_a_retired_key_still_evaluates_and_resumes(run_folder, tmp_path, caplog):
    """checkpoint.save_optimizer is retired; old checkpoints still hold it."""
    from dapo_train.run.config_changes import warn_config_changes

    old = tmp_path / "old_run" / "checkpoint_5"
    shutil.copytree(run_folder / "outputs" / "run" / "checkpoint_1", old)
    saved = (old / "config.yaml").read_text()
    (old / "config.yaml").write_text(saved.replace("checkpoint:\n", "checkpoint:\n  save_optimizer: true\n"))
    results = run_eval([str(old)], EVAL_OPTIONS)
    assert len(results) == 1 and (old / f"eval_{NAME}.json").is_file()
    assert "config key 'checkpoint.save_optimizer' is retired and ignored" in caplog.text
    caplog.clear()
    warn_config_changes(load_config(None, [f"output_dir={run_folder / 'outputs' / 'run'}"]), old)  # --resume's check
    assert "retired and ignored" in caplog.text and "settings changed" not in caplog.text


# --------------------------------------------------------------------------------------------
# Result files are named by what was evaluated; the latest run is the one that trained last.


@pytest.mark.parametrize(
    "args, name",
    [
        (("test", None, 1, 1.0, None), "test"),  # the whole split, greedy, the config's budget
        (("test", 100, 1, 1.0, None), "test_limit100"),
        (("test", None, 8, 0.9, None), "test_k8_t0.9"),
        (("train", 100, 4, 1.0, 64), "train_limit100_k4_t1_len64"),
        (("test", None, 1, 1.0, None, True), "test_tools"),  # with the config's rollout.tools
    ],
)
def test_result_names_say_what_was_evaluated(args, name):
    assert result_name(*args) == name


def test_evals_of_different_kinds_coexist(run_folder, monkeypatch):
    """A --limit or sampled eval of a checkpoint leaves its other evals in place."""
    monkeypatch.chdir(run_folder)
    folder = run_folder / "outputs" / "run" / "checkpoint_1"
    run_eval([str(folder)], EVAL_OPTIONS)
    first = (folder / f"eval_{NAME}.json").read_text()
    run_eval([str(folder)], dataclasses.replace(EVAL_OPTIONS, limit=4))
    run_eval([str(folder)], dataclasses.replace(EVAL_OPTIONS, limit=4, samples=2, temperature=0.9))
    assert (folder / f"eval_{NAME}.json").read_text() == first
    for name, items in ((f"test_limit4_len{NEW_TOKENS}", 4), (f"test_limit4_k2_t0.9_len{NEW_TOKENS}", 4)):
        assert json.loads((folder / f"eval_{name}.json").read_text())["metrics"]["num_items"] == items
        assert (folder / f"completions_{name}.jsonl").is_file()


def _trained_run(root, name, step, when):
    """A run folder as training leaves it, its training files dated `when` (seconds since the epoch)."""
    run = root / "outputs" / name
    checkpoint = run / f"checkpoint_{step}"
    checkpoint.mkdir(parents=True)
    for path in (run / "metrics.jsonl", checkpoint / "config.json", checkpoint / "trainer_state.pt"):
        path.write_text("{}\n")
        os.utime(path, (when, when))
    return checkpoint


def test_the_latest_run_is_the_one_that_trained_last_and_eval_does_not_change_it(tmp_path, monkeypatch):
    from dapo_train.run.folder import latest_run

    monkeypatch.chdir(tmp_path)
    older = _trained_run(tmp_path, "a", 4, when=1_000_000)
    _trained_run(tmp_path, "b", 2, when=2_000_000)
    (older / "eval_test.json").write_text("{}\n")  # evaluating run a now touches its checkpoint folder
    assert latest_run() == Path("outputs/b")
    _no_model(monkeypatch)
    with pytest.raises(UserError) as error:
        run_eval(["checkpoint_4"], EVAL_OPTIONS)
    assert str(error.value) == (
        "checkpoint_4 not found in the latest run, outputs/b (trained last); its checkpoints: checkpoint_2; runs "
        "under outputs/, latest first: outputs/b (checkpoint_2), outputs/a (checkpoint_4); choose with --run-dir"
    )
