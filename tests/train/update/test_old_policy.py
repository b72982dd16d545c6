"""Sampling from what is scored, end to end: when the rollout is the training forward (train/update/old_policy.py),
the behaviour log-probs the CUDA-shaped paths record (a bf16 copy, the static cache, top-k) checked
by hand against the float32 scorer, and each new setting moving what it claims in a real run."""

import logging

import pytest
import torch
from safetensors.torch import load_file

from dapo_train.config.load import load_config
from dapo_train.rollout import Completion, EngineSetup, SamplingSettings, build_engine, engine_factory
from dapo_train.run.logs import read_metrics
from dapo_train.task.prompts import Prompt
from dapo_train.train.loop import train
from dapo_train.train.records import Group
from dapo_train.train.update.old_policy import log_behaviour, resolve, rollout_differences, truncation

from conftest import PROMPTS, full_distributions, make_random_model, top_k_logprobs


@pytest.mark.parametrize("overrides,differs", [
    ([], ()),
    (["rollout.dtype=bfloat16"], ("bfloat16 copy of the weights (rollout.dtype)",)),
    (["rollout.compile=on"], ("samples with StaticCacheEngine",)),
    (["rollout.engine=hf-generate"], ("samples with GenerateEngine",)),
    (["rollout.top_k=5", "rollout.top_p=0.9"], ()),  # truncation: not a difference of the forward (test_truncation)
    (["train.mixed_precision=bf16"], ("bf16 autocast (train.mixed_precision)",)),
    (["model.keep_dropout=true"], ()),  # the random model has no dropout: the forward is unchanged
])
def test_the_rollout_is_the_training_forward_only_without_any_difference(overrides, differs, id_tokenizer):
    model = make_random_model(seed=1)
    cfg = load_config(None, overrides)
    found = rollout_differences(cfg, build_engine(cfg.rollout, model, id_tokenizer), model, cuda=False)
    assert len(found) == len(differs) and all(part in text for part, text in zip(differs, found)), found
    behaviour = resolve(cfg, found)
    assert behaviour.old_from_rollout == (not differs)  # auto: the rollout's own log-probs exactly then
    assert behaviour.correction.mode == ("tis" if differs else "off")


def test_truncation_is_named_at_start_and_none_when_it_keeps_every_token(id_tokenizer, caplog):
    model = make_random_model(seed=1)  # vocabulary 64
    named = {tuple(overrides): truncation(load_config(None, overrides), model) for overrides in (
        [], ["rollout.top_k=5"], ["rollout.top_k=64"], ["rollout.top_k=1000", "rollout.top_p=1.0"],
        ["rollout.top_p=0.9"], ["rollout.top_k=63", "rollout.top_p=0.9"])}
    assert list(named.values()) == [None, "top-k 5 of 64", None, None, "top-p 0.9", "top-k 63 of 64 and top-p 0.9"]
    caplog.set_level(logging.INFO, logger="dapo_train.train.update.old_policy")
    cfg = load_config(None, ["rollout.top_k=5"])
    policy = resolve(cfg, (), truncation(cfg, model))
    assert policy.old_from_rollout and policy.correction.mode == "off"  # the untruncated log-probs are pi_old
    log_behaviour(policy, cfg, model)
    assert "samples after top-k 5 of 64 truncation" in caplog.text and "rollout_kl_truncation" in caplog.text


def test_the_choices_are_printed_at_start_and_inert_ones_warned(id_tokenizer, caplog):
    model = make_random_model(seed=1)
    caplog.set_level(logging.INFO, logger="dapo_train.train.update.old_policy")
    cfg = load_config(None, ["rollout.dtype=bfloat16"])
    log_behaviour(resolve(cfg, ("it samples from a bfloat16 copy",)), cfg, model)
    assert "not the training forward: it samples from a bfloat16 copy" in caplog.text
    assert "dapo.old_logprobs=auto -> recompute" in caplog.text and "dapo.rollout_correction=auto -> tis (cap 2)" \
        in caplog.text
    caplog.clear()
    cfg = load_config(None, ["dapo.old_logprobs=rollout", "dapo.rollout_correction=mis", "model.keep_dropout=true"])
    log_behaviour(resolve(cfg, ("it samples from a bfloat16 copy",)), cfg, model)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("taken against the behaviour policy" in w for w in warnings)
    assert any("dapo.rollout_correction=mis cannot act" in w for w in warnings)
    assert any("model.keep_dropout cannot act: the model has no dropout" in w for w in warnings)


@pytest.mark.parametrize("compile", ["off", "on"])
def test_a_bfloat16_copy_records_its_own_truncated_distribution(compile, id_tokenizer):
    """rollout.dtype=bfloat16 with top_k 8, through the decode loop and the bucketed static-cache path: the
    behaviour log-probs are log(p_i / top-8 mass) of the bf16 copy (by hand: most tokens to 1e-5; a few
    differ by a bf16 rounding of the logits between its incremental and full forwards), not of the
    float32 weights (at most a tenth match those), and the float32 scorer is off by more than rounding.
    The kept log-mass is log(top-8 mass) of the copy (to the same rounding), so behaviour + it is the copy's
    full softmax."""
    model = make_random_model(seed=0)
    engine = engine_factory("hf")(EngineSetup(model, id_tokenizer, 16, dtype="bfloat16", compile=compile))
    torch.manual_seed(1)
    completions = engine.generate(PROMPTS, SamplingSettings(12, temperature=0.9, top_k=8), group_size=3)
    copy_diff, float32_diff, scorer_diff, mass_diff = [], [], [], []
    for c in completions:
        for weights, out in ((engine.copy, copy_diff), (model, float32_diff)):
            by_hand = top_k_logprobs(full_distributions(weights, c, 0.9), c.completion_ids, 8)
            out.append((by_hand - c.behaviour_logprobs).abs())
        copy_full = full_distributions(engine.copy, c, 0.9)
        kept = torch.log(copy_full.exp().topk(8, dim=-1).values.sum(dim=-1))  # (L,) log(top-8 mass)
        mass_diff.append((kept - c.kept_log_mass).abs())
        full = full_distributions(model, c, 0.9).gather(-1, c.completion_ids[:, None])[:, 0]
        scorer_diff.append(top_k_logprobs(full_distributions(model, c, 0.9), c.completion_ids, 8) - full)
    copy_diff, float32_diff = torch.cat(copy_diff), torch.cat(float32_diff)
    assert (copy_diff < 1e-5).float().mean() > 2 / 3
    assert (float32_diff < 1e-5).float().mean() < 0.1 and float32_diff.median() > 1e-4
    assert (torch.cat(scorer_diff) > 1e-3).all()  # the full softmax: below the truncated one by log(top-8 mass)
    mass_diff = torch.cat(mass_diff)  # the same bf16 rounding between incremental and full forwards
    assert mass_diff.median() < 1e-5 and (mass_diff < 1e-3).float().mean() > 0.9


def test_groups_keep_their_behaviour_logprobs_through_a_checkpoint(tmp_path):
    prompt = Prompt("train:3", "q", "1", "p", (3, 4))
    completions = [Completion(torch.tensor([3, 4]), torch.tensor([5, 6]), False, "a", torch.tensor([-0.5, -1.5])),
                   Completion(torch.tensor([3, 4]), torch.tensor([7]), True, "b", torch.tensor([-2.0]))]
    group = Group(prompt, completions, torch.zeros(2), torch.zeros(2, dtype=torch.bool), torch.tensor([1.0, -1.0]))
    torch.save(group.to_state(), tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    back = Group.from_state(state, {prompt.uid: prompt})
    assert [c.behaviour_logprobs.tolist() for c in back.completions] == [[-0.5, -1.5], [-2.0]]
    del state["behaviour_logprobs"]  # a checkpoint written before groups kept them
    assert [c.behaviour_logprobs for c in Group.from_state(state, {prompt.uid: prompt}).completions] == [None, None]


# A short CPU run: 2 steps of 2 prompts x G=4, two updates per step (the clip acts, a pass is needed); no
# eval at all (the whole split's greedy eval at the end took ~90% of each run, and no test here reads it).
SMALL = [
    "rollout.group_size=4", "rollout.max_new_tokens=32", "train.prompts_per_step=2", "train.micro_batch_size=8",
    "train.updates_per_step=2", "train.max_steps=2", "eval.every_steps=0", "eval.final_full=false",
    "rewards=[{name: accuracy}]",
    "dapo.dynamic_sampling=false", "logging.progress_bar=false", "train.deterministic=true",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> (metrics rows, final weights) of SMALL runs that differ in one setting each."""
    settings = {
        "float32": [],
        "recompute": ["dapo.old_logprobs=recompute"],
        "bf16": ["rollout.dtype=bfloat16", "rollout.top_k=5"],
        "bf16 off": ["rollout.dtype=bfloat16", "rollout.top_k=5", "dapo.rollout_correction=off"],
        "bf16 cap": ["rollout.dtype=bfloat16", "rollout.top_k=5", "dapo.rollout_correction_cap=1.01"],
        "bf16 rollout": ["rollout.dtype=bfloat16", "rollout.top_k=5", "dapo.old_logprobs=rollout"],
        "top-k": ["rollout.top_k=5", "rollout.temperature=2.0"],
        "top-k recompute": ["rollout.top_k=5", "rollout.temperature=2.0", "dapo.old_logprobs=recompute"],
    }
    out = {}
    for name, extra in settings.items():
        run_dir = train(load_config(None, [*SMALL, *extra, f"output_dir={tmp_path_factory.mktemp('run')}"]))
        out[name] = (read_metrics(run_dir), load_file(run_dir / "checkpoint_2" / "model.safetensors"))
    return out


def _moved(a: dict, b: dict) -> bool:
    return any(not torch.equal(a[key], b[key]) for key in a)


def test_old_logprobs_from_the_rollout_agree_with_the_recomputed_ones_and_skip_the_pass(runs):
    """On the CPU demo's path (float32 decode loop) auto takes the rollout's log-probs: no pass, and the
    first step's update numbers equal those of the recomputed old log-probs to float rounding."""
    rollout, recompute = runs["float32"][0][0], runs["recompute"][0][0]
    assert rollout["old_logprob_rows"] == 0 and recompute["old_logprob_rows"] == 8
    for key in ("loss", "approx_kl", "ratio_mean", "clip_frac"):
        assert rollout[key] == pytest.approx(recompute[key], abs=1e-6), key
    assert recompute["rollout_logprob_diff_max"] < 1e-4  # decode loop vs scoring forward: rounding only


def test_truncation_alone_takes_the_old_logprobs_from_the_rollout(runs):
    """The float32 decode loop with top-k 5 at T = 2 (mass really cut): the untruncated log-probs it records
    are the training forward's, so auto takes them as the old ones (no pass) and the first step's numbers
    equal those of the recomputed old log-probs; the truncation is logged apart, the numeric gap is rounding."""
    rollout, recompute = runs["top-k"][0][0], runs["top-k recompute"][0][0]
    assert rollout["old_logprob_rows"] == 0 and recompute["old_logprob_rows"] == 8
    for key in ("loss", "approx_kl", "ratio_mean", "clip_frac"):
        assert rollout[key] == pytest.approx(recompute[key], abs=1e-6), key
    assert recompute["rollout_kl"] < 1e-9 and recompute["rollout_is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert rollout["rollout_kl_truncation"] > 0.05 and runs["float32"][0][0]["rollout_kl_truncation"] == 0.0


def test_a_bf16_top_k_rollout_is_measured_and_each_setting_moves_the_weights(runs):
    """rollout.dtype=bfloat16 with top_k 5: the numeric rollout_kl far above the float32 run's rounding, IS
    weights on both sides of 1 (mean 1 to 1e-2: the truncation is not in them), tis truncating more tokens
    at cap 1.01 than at 2; tis vs off and dapo.old_logprobs each give other weights."""
    float32, bf16 = runs["float32"][0][0], runs["bf16"][0][0]
    assert bf16["rollout_kl"] > 1e-7 and bf16["rollout_kl"] > 1e4 * float32["rollout_kl"]
    assert bf16["rollout_logprob_diff_max"] > 1e-3 and bf16["rollout_is_weight_mean"] == pytest.approx(1.0, abs=1e-2)
    assert bf16["rollout_kl_truncation"] > 0  # top-5 of the peaked tiny model at T = 1 cuts a little
    clipped = {name: max(row["rollout_is_clipped_frac"] for row in runs[name][0]) for name in ("bf16", "bf16 cap")}
    assert clipped["bf16 cap"] > clipped["bf16"]  # cap 1.01 truncates where cap 2 does not
    assert {"rollout_kl", "rollout_logprob_diff_mean", "rollout_logprob_diff_max", "rollout_is_weight_mean",
            "rollout_is_clipped_frac"} <= set(bf16)
    weights = {name: final for name, (_, final) in runs.items()}
    for other in ("bf16 off", "bf16 rollout"):  # the cap's weights: test_update (here it meets A = 0 rows only)
        assert _moved(weights["bf16"], weights[other]), other
    assert runs["bf16 rollout"][0][0]["old_logprob_rows"] == 0 < bf16["old_logprob_rows"]


ROLLOUT_FIELDS = ("rollout_kl", "rollout_logprob_diff_mean", "rollout_logprob_diff_max", "rollout_is_weight_mean",
                  "rollout_is_clipped_frac", "rollout_tokens", "rollout_kl_truncation", "rollout_exact")


def test_every_step_carries_the_mismatch_fields_with_the_tokens_they_cover(tmp_path):
    """The demo's first two steps (dapo.old_logprobs=rollout): the mismatch is measured on the rows an
    update trains at the weights that sampled them -- step 1's first mini-batch; step 2's first holds a
    group carried over from step 1 (at seed 1; seed 0's step 1 carries none since the CPU draw changed), so
    none. Step 2 still carries every field: rollout_tokens 0 and null figures, not a gap in the log;
    rollout_exact 1 says the gap is rounding by construction."""
    run_dir = train(load_config(None, ["train.max_steps=2", "seed=1", "eval.every_steps=0", "eval.final_full=false",
                                       "logging.progress_bar=false", f"output_dir={tmp_path / 'demo'}"]))
    first, second = read_metrics(run_dir)
    assert all(set(ROLLOUT_FIELDS) <= set(row) for row in (first, second))
    assert first["rollout_tokens"] > 0 and first["rollout_kl"] < 1e-9 and first["rollout_exact"] == 1
    assert second["groups_carried"] > 0 and second["rollout_tokens"] == 0 and second["rollout_kl"] is None
    assert first["rollout_kl_truncation"] == second["rollout_kl_truncation"] == 0.0  # the demo truncates nothing
