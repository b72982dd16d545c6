"""What setup says and refuses about the data before the model loads (issue 38): fewer usable prompts
than one generation round draws, how much of the data the run will see, and whether the eval split
the end-of-run summary points at exists."""

import json
import logging
import warnings

import pytest

from dapo_train.config.load import load_config
from dapo_train.errors import ConfigError
from dapo_train.train.session import _warn_inert_settings, check_data_use, missing_split, setup, start_accelerator


def test_fewer_usable_prompts_than_a_step_draws_is_refused():
    cfg = load_config(None, ["train.prompts_per_step=8", "data.path=three.jsonl"])
    with pytest.raises(ConfigError, match=r"'train.prompts_per_step': a step needs 8 different prompts, but three"
                                          r".jsonl \[train\] has 3 usable; set train.prompts_per_step to at most 3"):
        check_data_use(cfg, 3)
    check_data_use(cfg, 8)  # exactly one round's worth is enough


def test_fewer_usable_prompts_than_a_sized_round_draws_is_refused():
    """Issue 52, item 6: under dapo.max_round_prompts=64 a round draws up to 64 prompts, so 40 usable ones
    would have a round draw 24 of them twice (both groups of a prompt could train in one step); it was
    compared with train.prompts_per_step (8) alone and accepted. Without dynamic sampling the key sizes
    nothing (every round draws train.prompts_per_step) and 40 is enough; 64 usable are enough either way."""
    sized = ["train.prompts_per_step=8", "dapo.max_round_prompts=64", "data.path=forty.jsonl"]
    with pytest.raises(ConfigError, match=r"'dapo.max_round_prompts': a generation round draws up to 64 prompts, "
                                          r"but forty.jsonl \[train\] has 40 usable, so a round would draw 24 of "
                                          r"them twice; set dapo.max_round_prompts to at most 40"):
        check_data_use(load_config(None, sized), 40)
    check_data_use(load_config(None, sized), 64)
    check_data_use(load_config(None, [*sized, "dapo.dynamic_sampling=false"]), 40)


def test_the_run_says_how_many_epochs_it_will_cover(caplog):
    caplog.set_level("INFO")
    check_data_use(load_config(None, ["train.prompts_per_step=2", "train.max_steps=3",
                                      "dapo.dynamic_sampling=false"]), 10)
    # One round a step without dynamic sampling: 2 x 3 = 6 prompts of 10 = 0.6 epochs.
    assert "the run draws 2 prompts per step x 3 steps = 6 prompts, 0.6 epochs of the 10 usable training prompts" \
        in caplog.text
    caplog.clear()
    check_data_use(load_config(None, ["train.prompts_per_step=8", "train.max_steps=40", "dapo.max_gen_rounds=4"]),
                   4000)
    # 8 x 40 = 320 prompts (0.08 of 4000) if each step fills in one round; 4 rounds a step at most: 1280 (0.32).
    assert "8 prompts per generation round x 40 steps = 320 prompts, 0.08 epochs of the 4000 usable training " \
        "prompts (an estimate: dynamic sampling runs 1 to 4 rounds a step, so up to 1280 prompts, 0.32 epochs)" \
        in caplog.text


def test_the_data_line_counts_rounds_sized_by_max_round_prompts(caplog):
    """Issue 49, point 4: under dapo.max_round_prompts a round draws up to that many prompts, not
    train.prompts_per_step, and the line said the latter's range."""
    caplog.set_level("INFO")
    check_data_use(load_config(None, ["train.prompts_per_step=8", "train.max_steps=40", "dapo.max_gen_rounds=4",
                                      "dapo.max_round_prompts=32"]), 4000)
    # 8 groups a step x 40 steps: 320 prompts (0.08 of 4000) if every drawn group is kept; at most 4 rounds of
    # 32 prompts a step: 32 x 4 x 40 = 5120 prompts (1.28 epochs).
    assert "the run trains 8 prompts' groups per step x 40 steps, so it draws at least about 320 prompts, 0.08 " \
        "epochs of the 4000 usable training prompts (an estimate: dapo.max_round_prompts sizes each generation " \
        "round by the keep rate, up to 32 prompts, 1 to 4 rounds a step, so up to 5120 prompts, 1.28 epochs)" \
        in caplog.text, caplog.text


def test_skip_history_says_at_start_when_the_run_never_comes_back_to_a_prompt(caplog):
    """A prompt's history needs it drawn twice: 2 prompts x 3 steps x at most 4 rounds = 24 draws at most,
    within 24 usable prompts (one epoch) it cannot act; within 23 a prompt comes back and it can; off, no word."""
    def warned(overrides, usable):
        caplog.clear()
        check_data_use(load_config(None, ["train.prompts_per_step=2", "train.max_steps=3", "dapo.max_gen_rounds=4",
                                          *overrides]), usable)
        return "dapo.skip_history cannot act: the run draws at most 24 prompts" in caplog.text

    assert warned(["dapo.skip_history=true"], 24)
    assert not warned(["dapo.skip_history=true"], 23)
    assert not warned([], 24)


def test_tool_format_says_at_start_when_no_tool_is_named(caplog):
    """tool_format scores calls: without rollout.tools every completion gets 0, and the run says so; with the
    calculator, or without the reward, no word."""
    from dapo_train.train.session import _warn_inert_settings

    def warned(overrides):
        caplog.clear()
        _warn_inert_settings(load_config(None, overrides))
        return "the reward tool_format cannot act: rollout.tools names no tool" in caplog.text

    reward = "rewards=[{name: accuracy}, {name: tool_format}]"
    assert warned([reward])
    assert not warned([reward, "rollout.tools=[calculator]"])
    assert not warned([])


def test_a_missing_eval_split_is_found_without_reading_it_as_prompts(tmp_path):
    (tmp_path / "train.jsonl").write_text(json.dumps({"question": "1+1?", "answer": 2}) + "\n")
    data = load_config(None, [f"data.path={tmp_path / 'train.jsonl'}"]).data
    assert missing_split(data, "test").startswith(f"split 'test' not found in {tmp_path / 'train.jsonl'}; splits: "
                                                  "train")
    assert missing_split(data, "train") is None


def test_one_process_may_train_again_with_another_mixed_precision(tmp_path):
    """Preflight rehearses bf16 autocast in the process that ran an earlier float32 run (and a sweep's points
    may differ in train.mixed_precision): accelerate keeps one state per process and refused the change."""
    for precision in ("no", "bf16"):
        cfg = load_config(None, [f"train.mixed_precision='{precision}'"])
        assert start_accelerator(cfg, False, tmp_path).mixed_precision == precision


def test_activation_checkpointing_turns_on_without_a_deprecation_warning(tmp_path):
    """model.gradient_checkpointing=on (what preflight rehearses for a card) through transformers' current
    call: gradient_checkpointing_enable printed its FutureWarning on every run and every preflight."""
    cfg = load_config(None, ["model.gradient_checkpointing=on", f"output_dir={tmp_path}", "eval.final_full=false"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = setup(cfg, tmp_path, None)
    assert not [str(w.message) for w in caught if "checkpointing" in str(w.message)]
    layers = [m for m in run.model.modules() if hasattr(m, "gradient_checkpointing")]
    assert layers and all(m.gradient_checkpointing for m in layers)


@pytest.mark.parametrize("overrides, said", [
    (["eval.every_steps=0"], "checkpoint.keep_best cannot act: eval.every_steps=0, no periodic eval ranks the "
                             "checkpoints"),
    (["checkpoint.every_steps=0"], "checkpoint.keep_best cannot act: checkpoint_40 is the only checkpoint saved at "
                                   "an eval step"),
    (["checkpoint.every_steps=15"], "checkpoint.keep_best ranks only the checkpoints saved at an eval step "
                                    "(eval.every_steps=10): 2 of 3 (checkpoint_15 is not)"),
    (["checkpoint.every_steps=20"], None),
    (["checkpoint.every_steps=20", "checkpoint.keep_best=false"], None),
])
def test_keep_best_says_at_start_when_it_cannot_rank_the_checkpoints(overrides, said, caplog):
    """The demo evaluates every 10 of its 40 steps: checkpoints every 20 are all ranked; every 15 (15, 30, 40),
    one is not; only the last (every_steps 0) leaves nothing to choose; without evals nothing ranks them."""
    cfg = load_config(None, ["checkpoint.keep_best=true", *overrides])
    with caplog.at_level(logging.WARNING):
        _warn_inert_settings(cfg)
    keep_best = [r.getMessage() for r in caplog.records if "keep_best" in r.getMessage()]
    assert keep_best == ([] if said is None else [keep_best[0]]) and (said is None or said in keep_best[0]), keep_best
