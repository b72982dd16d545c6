"""The objectives and reductions in the trainer: the config reaches each objective's own bounds, every
bound moves its clip metric and the weights once the clip can act, micro-batches (the shared-prefix
layout included) add up to one batch, LoRA trains only adapters, and a short run of the shipped tiny
model trains other weights than clip with GSPO or CISPO."""

import copy

import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file

from dapo_train.config.load import load_config
from dapo_train.config.schema import Config
from dapo_train.errors import ConfigError
from dapo_train.model import lora
from dapo_train.rollout import Completion
from dapo_train.run.logs import read_metrics
from dapo_train.task.prompts import Prompt
from dapo_train.train import loop
from dapo_train.train.records import Group, StepBatch
from dapo_train.train.update.objective import inert_objective_keys, loss_settings
from dapo_train.train.update.old_policy import record_old_logprobs
from dapo_train.train.update.passes import Learner, update

from conftest import EOS2_ID, EOS_ID, make_random_model


def groups(n: int = 4, size: int = 4, seed: int = 0) -> list[Group]:
    """n groups of `size` completions sharing their group's prompt tensor, lengths 2-10 (some without
    EOS), advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(3, 60, (int(torch.randint(2, 10, (1,), generator=g)),), generator=g)
        completions = []
        for j in range(size):
            body = torch.randint(3, 60, (int(torch.randint(1, 10, (1,), generator=g)),), generator=g)
            completions.append(Completion(prompt, torch.cat([body, torch.tensor([EOS_ID])]) if j % 3 else body,
                                          False, ""))
        out.append(Group(prompt=Prompt(f"train:{i}", "q", "1", "p", tuple(prompt.tolist())), completions=completions,
                         rewards=torch.zeros(size), correct=torch.zeros(size, dtype=torch.bool),
                         advantages=torch.randn(size, generator=g)))
    return out


def train_once(model, overrides: list[str], batch: list[Group], lr: float = 5e-2) -> tuple[dict, Config]:
    """The trainer's steps 2-3 on `batch` (old log-probs recorded first when it makes several updates)."""
    cfg = load_config(None, ["train.prompts_per_step=4", "rollout.group_size=4", "train.micro_batch_size=3",
                             f"train.learning_rate={lr}", *overrides])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    learner = Learner.build(cfg, model, optimizer, Accelerator(cpu=True), EOS2_ID)
    if cfg.train.updates_per_step > 1:
        record_old_logprobs(learner.model, batch, learner.batching, learner.scorer)
    return update(learner, StepBatch(batch, [len(batch)], {}), cfg), cfg


def weights(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# --------------------------------------------------------------------------------------------
# The config: each objective reads its own keys; the others say they cannot act.


def test_each_objective_gets_its_own_clip_bounds_from_the_config():
    overrides = ["dapo.eps_low=0.1", "dapo.eps_high=0.5", "dapo.gspo_eps_low=1e-3", "dapo.gspo_eps_high=2e-3",
                 "dapo.cispo_eps_low=0.4", "dapo.cispo_eps_high=3"]
    bounds = {name: loss_settings(load_config(None, [*overrides, f"dapo.policy_loss={name}"]))
              for name in ("clip", "gspo", "cispo", "objective_plugin:reinforce")}
    assert {name: (s.eps_low, s.eps_high) for name, s in bounds.items()} == {
        "clip": (0.1, 0.5), "gspo": (1e-3, 2e-3), "cispo": (0.4, 3.0),
        "objective_plugin:reinforce": (0.1, 0.5),  # a plugin reads dapo.eps_low / eps_high
    }
    assert loss_settings(load_config(None, ["dapo.loss_reduction=constant"])).reduction == "constant"


def test_the_keys_of_another_objective_are_named_as_unable_to_act():
    def inert(*overrides):
        return inert_objective_keys(load_config(None, list(overrides)))

    assert inert() == [] and inert("dapo.policy_loss=gspo") == []
    assert inert("dapo.policy_loss=gspo", "dapo.eps_high=0.4", "dapo.clip_ratio_c=3", "dapo.gspo_eps_high=1e-3",
                 "dapo.cispo_eps_high=2") == ["dapo.eps_high", "dapo.clip_ratio_c", "dapo.cispo_eps_high"]
    assert inert("dapo.gspo_eps_low=1e-3") == ["dapo.gspo_eps_low"]  # clip does not read it
    assert inert("dapo.policy_loss=objective_plugin:reinforce", "dapo.gspo_eps_low=1e-3") == []  # a plugin may


@pytest.mark.parametrize(("override", "key"), [
    ("dapo.gspo_eps_low=1.0", "dapo.gspo_eps_low"), ("dapo.gspo_eps_high=-1e-4", "dapo.gspo_eps_high"),
    ("dapo.cispo_eps_low=1.5", "dapo.cispo_eps_low"), ("dapo.cispo_eps_high=-1", "dapo.cispo_eps_high"),
    ("dapo.loss_reduction=dr_grpo", "dapo.loss_reduction"),
])
def test_impossible_bounds_name_their_key(override, key):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert info.value.key == key


def test_the_policy_loss_help_names_every_built_in_objective():
    from dapo_train.config.keys import describe_keys

    [(_, default, text)] = [row for row in describe_keys() if row[0] == "dapo.policy_loss"]
    assert default == "'clip'" and all(f"{name} (" in text for name in ("clip", "gspo", "cispo"))


# --------------------------------------------------------------------------------------------
# Every bound moves its clip metric and the weights once the ratio can leave 1.

BOUNDS = [  # (objective, key, tight, loose, the metric it moves)
    ("gspo", "gspo_eps_high", 1e-5, 1.0, "clip_frac_high"),
    ("gspo", "gspo_eps_low", 1e-5, 0.9, "clip_frac_low"),
    ("cispo", "cispo_eps_high", 1e-3, 4.0, "clip_frac_high"),
    ("cispo", "cispo_eps_low", 1e-3, 1.0, "clip_frac_low"),
]


@pytest.mark.parametrize(("objective", "key", "tight", "loose", "metric"), BOUNDS)
def test_each_bound_moves_its_clip_metric_and_the_weights(objective, key, tight, loose, metric):
    """Two updates per rollout batch: the second trains after the policy moved, so the bound clips
    there (its metric > 0 when tight, 0 when loose) and changes the weights; with one on-policy
    update the ratio is 1, nothing clips and the bound changes nothing."""
    results = {}
    for updates in (1, 2):
        for bound in (tight, loose):
            model = make_random_model(seed=9).train()
            metrics, _ = train_once(model, [f"dapo.policy_loss={objective}", f"dapo.{key}={bound}",
                                        f"train.updates_per_step={updates}"], groups(seed=4))
            results[updates, bound] = metrics[metric], weights(model)
    assert results[2, tight][0] > 0.0 == results[2, loose][0]
    assert any(not torch.equal(a, b) for a, b in zip(results[2, tight][1], results[2, loose][1]))
    assert results[1, tight][0] == results[1, loose][0] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(results[1, tight][1], results[1, loose][1]))


# --------------------------------------------------------------------------------------------
# Exact over micro-batches in every layout; LoRA.

LOSSES = {
    "gspo, sample": ["dapo.policy_loss=gspo", "dapo.loss_reduction=sample"],
    "gspo, token": ["dapo.policy_loss=gspo"],
    "cispo": ["dapo.policy_loss=cispo", "dapo.cispo_eps_high=0.05"],
    "dr grpo": ["dapo.loss_reduction=constant", "rollout.max_new_tokens=12"],
}


@pytest.mark.parametrize("loss", LOSSES)
def test_micro_batches_and_the_shared_prefix_give_the_update_of_one_batch(loss):
    """Two optimizer steps of 8 completions each: one micro-batch per step, one row per completion,
    against micro-batches of 3 (cutting through groups of 4) scored with each group's prompt once."""
    base = make_random_model(seed=3).train()
    results = {}
    for layout in (["train.micro_batch_size=16", "train.shared_prefix=off"],
                   ["train.micro_batch_size=3", "train.shared_prefix=on"]):
        model = copy.deepcopy(base)
        metrics, _ = train_once(model, [*LOSSES[loss], "train.updates_per_step=2", *layout], groups(seed=1), lr=1e-3)
        results[layout[0]] = metrics, weights(model)
    (one, one_weights), (many, many_weights) = results.values()
    assert one["micro_batches"] == 2 and many["micro_batches"] == 6
    for a, b in zip(one_weights, many_weights):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    for key in ("loss", "clip_frac_high", "clip_frac_low", "ratio_mean"):
        assert many[key] == pytest.approx(one[key], rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("loss", LOSSES)
def test_overlong_filtering_trains_as_if_the_truncated_completions_were_not_there(loss):
    """dapo.overlong_filtering masks truncated completions out: the update equals the one of the same
    groups without them (their advantages as they were), under every objective and reduction."""
    base, batch = make_random_model(seed=6).train(), groups(seed=7)
    for group in batch:
        group.completions = [copy.copy(c) for c in group.completions]
        group.completions[0].truncated = True
    kept = copy.deepcopy(batch)
    for group in kept:
        group.completions, group.advantages = group.completions[1:], group.advantages[1:]
    results = []
    for settings, part in ((["dapo.overlong_filtering=true"], batch), ([], kept)):
        model = copy.deepcopy(base)
        metrics, _ = train_once(model, [*LOSSES[loss], "train.updates_per_step=2", *settings], part, lr=1e-3)
        results.append((metrics, weights(model)))
    (filtered, filtered_weights), (without, without_weights) = results
    assert filtered["num_tokens"] == without["num_tokens"]
    for a, b in zip(filtered_weights, without_weights):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("objective", ["gspo", "cispo"])
def test_with_lora_an_objective_trains_only_the_adapters(objective):
    """LoRA's adapters, not the frozen base, move under each objective, to other values than under clip."""
    adapters = {}
    for name in ("clip", objective):
        torch.manual_seed(0)
        cfg = load_config(None, ["model.lora.r=4"])
        model = lora.apply_lora(make_random_model(seed=5), cfg.model.lora, "random").train()
        before = {key: p.detach().clone() for key, p in model.named_parameters()}
        train_once(model, [f"dapo.policy_loss={name}", "train.updates_per_step=2"], groups(seed=2), lr=1e-2)
        after = {key: p.detach().clone() for key, p in model.named_parameters()}
        moved = {key for key in before if not torch.equal(before[key], after[key])}
        assert moved and all("lora_" in key for key in moved), moved
        adapters[name] = after
    assert any(not torch.equal(adapters["clip"][key], adapters[objective][key]) for key in adapters["clip"])


# --------------------------------------------------------------------------------------------
# End to end on the shipped tiny model.

SMALL = [
    "rollout.group_size=4", "rollout.max_new_tokens=48", "train.prompts_per_step=2", "train.micro_batch_size=4",
    "train.updates_per_step=2", "eval.every_steps=0", "train.deterministic=true", "train.num_threads=1",
    "train.max_steps=2", "logging.progress_bar=false", "eval.final_full=false",  # no test here reads an eval
]


def test_gspo_and_cispo_runs_train_other_weights_than_clip(tmp_path, caplog):
    """Same seed, two steps: the three objectives end at three different weights; every run logs its
    clip fractions; a clip key set under gspo is named at start as unable to act."""
    runs = {}
    for name, extra in {"clip": [], "gspo": ["dapo.eps_high=0.4"], "cispo": []}.items():
        cfg = load_config(None, [*SMALL, f"dapo.policy_loss={name}", f"output_dir={tmp_path / name}", *extra])
        runs[name] = loop.train(cfg)
        assert all("clip_frac_high" in row for row in read_metrics(runs[name]) if "loss" in row)
    final = {name: load_file(run / "checkpoint_2" / "model.safetensors") for name, run in runs.items()}
    for a, b in (("clip", "gspo"), ("clip", "cispo"), ("gspo", "cispo")):
        assert any(not torch.equal(final[a][key], final[b][key]) for key in final[a]), (a, b)
    assert "dapo.eps_high cannot act: dapo.policy_loss=gspo reads dapo.gspo_eps_low / dapo.gspo_eps_high" in caplog.text


# --------------------------------------------------------------------------------------------
# The comparison study (scripts/studies/policy_losses.py): its rows, and the command end to end.


def _study():
    import importlib
    import sys
    from pathlib import Path

    scripts = str(Path(__file__).resolve().parents[3] / "scripts" / "studies")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)  # the script imports its sibling ablation.py, as when it runs
    return importlib.import_module("policy_losses")


def test_each_study_row_is_the_demo_with_only_its_own_keys_changed():
    from dapo_train.run.folder import config_differences

    import ablation

    study = _study()

    def row(name):
        return ablation.row_config(study.TASKS["tiny"], study.ROWS_DIR / f"{name}.yaml", study.SCHEDULE)

    assert sorted(p.stem for p in study.ROWS_DIR.glob("*.yaml")) == sorted(study.ROWS)
    demo, dapo = load_config(str(study.TASKS["tiny"]), []), row("dapo")
    assert config_differences(demo, dapo, skip=("run_name", "output_dir", "eval.every_steps", "eval.num_items",
                                                "eval.print_samples")) == []
    assert (dapo.eval.every_steps, dapo.eval.num_items, dapo.eval.final_full) == (10, 0, True)  # all 500 items
    changed = {name: [key for key, _, _ in config_differences(dapo, row(name))] for name in study.ROWS}
    assert changed == {
        "dapo": [], "gspo": ["dapo.loss_reduction", "dapo.policy_loss"], "cispo": ["dapo.policy_loss"],
        "dr_grpo": ["dapo.advantage_std", "dapo.loss_reduction"],
    }


def test_the_study_runs_end_to_end_with_paired_differences(tmp_path):
    """Two rows, one seed, one step, on the shipped model with a 5-question eval split: the runs, the
    table (the second row paired with the first on the same 5 items) and the plot."""
    import json

    from small_task import write_small_task

    study = _study()
    task, out, png = write_small_task(tmp_path / "task"), tmp_path / "out", tmp_path / "study.png"
    code = study.main(["--rows", "dapo,gspo", "--seeds", "1", "--out", str(out), "--png", str(png),
                       "--set", "train.max_steps=1", "--set", f"data.path={task}", "--set", "train.prompts_per_step=2",
                       "--set", "rollout.group_size=4", "--set", "train.micro_batch_size=8"])
    assert code == 0 and png.is_file()
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["dapo_seed1", "gspo_seed1"]
    paired = json.loads((out / "policy_losses.json").read_text())["paired"]["gspo"]
    assert (paired["eval"], paired["items"]) == ("final", 5)
    table = (out / "policy_losses.md").read_text().splitlines()
    assert table[0].startswith("| row | seeds | final acc | Δ final vs dapo [95% CI] | best acc |")
    assert table[2].startswith("| dapo | 1 |") and table[3].startswith(f"| gspo | 1 | {paired['accuracy']:.3f} | "
                                                                      f"{paired['difference']:+.3f} [")
    with pytest.raises(SystemExit):
        study.main(["--rows", "dapo,grpo"])
