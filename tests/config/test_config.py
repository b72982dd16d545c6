"""Config loading: defaults <- YAML <- KEY=VALUE, strict keys and types, clear errors."""

import os

import pytest

from dapo_train.config.keys import describe_keys
from dapo_train.config.load import config_from_dict, load_config, read_yaml, save_config
from dapo_train.config.schema import Config
from dapo_train.errors import ConfigError, UserError


def test_defaults_are_valid_and_name_the_run():
    cfg = load_config(None, [])
    assert isinstance(cfg, Config)
    assert cfg.run_name == "tiny-cpu"
    assert cfg.output_dir == "outputs/tiny-cpu"


def test_yaml_then_override(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("dapo:\n  eps_high: 0.3\nrollout:\n  group_size: 4\n")
    cfg = load_config(str(path), ["dapo.eps_high=0.4", "train.max_steps=7"])
    assert cfg.dapo.eps_high == 0.4  # override wins over the file
    assert cfg.rollout.group_size == 4  # file wins over the default
    assert cfg.dapo.eps_low == 0.2  # untouched default
    assert cfg.train.max_steps == 7
    assert cfg.run_name == "exp_eps_high=0.4_max_steps=7"


def test_a_dotted_key_in_a_yaml_file_is_told_to_nest(tmp_path):
    """Issue 49, point 4: `train.max_steps: 5` got "unknown key 'train.max_steps'; did you mean
    'train.max_steps'?". A YAML file nests its keys; the dotted form is KEY=VALUE's."""
    path = tmp_path / "exp.yaml"
    for text, key, nested in (("train.max_steps: 5\n", "train.max_steps", "write 'train:' and under it 'max_steps: "),
                              ("model:\n  lora.r: 8\n", "model.lora.r", "write 'model:' and under it 'lora:' and "
                                                                          "under it 'r: ")):
        path.write_text(text)
        with pytest.raises(ConfigError) as error:
            load_config(str(path), [])
        assert f"'{key}': a YAML file nests its keys: {nested}" in str(error.value), str(error.value)
        assert "did you mean" not in str(error.value)


def test_a_config_path_that_is_not_a_file_says_what_it_is(tmp_path):
    """Issue 49, point 4: /dev/null was "config file not found"."""
    with pytest.raises(UserError, match="config file /dev/null is not a file but a character device"):
        load_config("/dev/null", [])
    with pytest.raises(UserError, match="config file not found"):
        load_config(str(tmp_path / "nope.yaml"), [])


def test_int_is_accepted_for_float_but_not_the_reverse():
    assert load_config(None, ["train.learning_rate=1"]).train.learning_rate == 1.0
    with pytest.raises(ConfigError, match="train.max_steps.*expected int"):
        load_config(None, ["train.max_steps=1.5"])


def test_unknown_key_names_the_closest_valid_key():
    with pytest.raises(ConfigError, match="did you mean 'dapo.eps_high'"):
        load_config(None, ["dapo.eps_hihg=0.3"])
    with pytest.raises(ConfigError, match="did you mean 'rollout'"):
        load_config(None, ["rollot.group_size=2"])


def test_an_invisible_character_in_a_key_is_shown_and_named(tmp_path):
    """Issue 59 item 15: a byte-order mark in a key printed invisibly: "config key 'train.max_steps': unknown key;
    did you mean 'train.max_steps'?"."""
    with pytest.raises(ConfigError) as error:
        load_config(None, ["\ufefftrain.max_steps=3"])
    assert str(error.value) == ("config key '\\ufefftrain': unknown key: it holds an invisible U+FEFF "
                                "(a byte-order mark, ZERO WIDTH NO-BREAK SPACE); delete it: 'train'")
    path = tmp_path / "bom.yaml"
    path.write_text("train:\n  max_steps: 2\n  warm\u200bup_steps: 1\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"^config key 'train.warm\\u200bup_steps': unknown key: it holds an "
                                          r"invisible U\+200B \(ZERO WIDTH SPACE\); delete it: "
                                          r"'train.warmup_steps'$"):
        load_config(str(path), [])
    with pytest.raises(ConfigError, match=r"^config key 'train.max_ste\\u200bpz': unknown key; did you mean"):
        load_config(None, ["train.max_ste\u200bpz=3"])  # not a key even without it: the usual hint, shown


@pytest.mark.parametrize(
    "override, key",
    [
        ("dapo.eps_low=1.0", "dapo.eps_low"),
        ("dapo.eps_low=-0.1", "dapo.eps_low"),
        ("dapo.eps_high=-0.01", "dapo.eps_high"),
        ("rollout.group_size=1", "rollout.group_size"),
        ("train.micro_batch_size=1000", "train.micro_batch_size"),
        ("dapo.loss_reduction=mean", "dapo.loss_reduction"),
        ("dapo.dynamic_sampling=maybe", "dapo.dynamic_sampling"),
    ],
)
def test_impossible_values_name_their_key(override, key):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert info.value.key == key


def test_invalid_yaml_reports_line_and_column(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("dapo:\n  eps_low: 0.2\n   eps_high: [0.3\n")
    with pytest.raises(UserError, match=r"bad.yaml:\d+:\d+"):
        read_yaml(path)


def test_a_yaml_merge_key_is_read_and_still_refuses_a_key_given_twice(tmp_path):
    """Issue 52, item 13: `<<: *anchor` (YAML's merge key) copies the anchored mapping's keys, and the
    mapping's own keys override them; it was refused with PyYAML's internal `could not determine a
    constructor for the tag 'tag:yaml.org,2002:merge'`. A key the mapping itself gives twice is still an error."""
    path = tmp_path / "merge.yaml"
    path.write_text("rewards:\n  - &rule {name: accuracy, weight: 2.0}\n  - <<: *rule\n    name: hard_format\n"
                    "  - <<: [*rule]\n    weight: 0.5\n")
    assert read_yaml(path)["rewards"] == [{"name": "accuracy", "weight": 2.0}, {"name": "hard_format", "weight": 2.0},
                                          {"name": "accuracy", "weight": 0.5}]
    cfg = load_config(str(path), [])
    assert [(r.name, r.weight) for r in cfg.rewards] == [("accuracy", 2.0), ("hard_format", 2.0), ("accuracy", 0.5)]
    path.write_text("rewards:\n  - &rule {name: accuracy}\n  - <<: *rule\n    weight: 1.0\n    weight: 2.0\n")
    with pytest.raises(UserError, match=r"merge.yaml:5:5: key 'weight' is given twice \(first on line 4\)"):
        read_yaml(path)


def test_override_without_equals_is_rejected():
    with pytest.raises(UserError, match="KEY=VALUE"):
        load_config(None, ["dapo.eps_high"])


def test_saved_config_round_trips(tmp_path):
    cfg = load_config(None, ["dapo.eps_high=0.5", "rewards=[{name: accuracy, weight: 2.0}]"])
    save_config(cfg, tmp_path / "config.yaml")
    again = config_from_dict(read_yaml(tmp_path / "config.yaml"))
    assert again == cfg
    assert again.rewards[0].weight == 2.0 and len(again.rewards) == 1


def test_every_key_is_documented():
    rows = describe_keys()
    assert len(rows) > 40
    assert all(text for _, _, text in rows), [k for k, _, t in rows if not t]


def test_exponent_floats_are_read_as_numbers(tmp_path):
    """YAML 1.1 reads 1e-6 (no dot) as a string; the config takes it as the float the user meant."""
    path = tmp_path / "lr.yaml"
    path.write_text("train:\n  learning_rate: 3e-5\n")
    assert load_config(str(path), []).train.learning_rate == 3e-5
    assert load_config(None, ["train.learning_rate=1e-6"]).train.learning_rate == 1e-6
    with pytest.raises(ConfigError, match="train.learning_rate"):
        load_config(None, ["train.learning_rate=fast"])


def test_shipped_configs_load_and_the_tiny_one_is_the_default():
    import dataclasses

    from dapo_train.train.update.old_policy import clip_can_act
    from dapo_train.train.update.optim import total_optimizer_steps

    root = __import__("pathlib").Path(__file__).resolve().parents[2] / "configs"
    assert load_config(str(root / "tiny-cpu.yaml"), []) == load_config(None, [])
    seed = load_config(str(root / "qwen1.5b-seed.yaml"), [])
    assert seed.model.name_or_path == "Qwen/Qwen2.5-1.5B-Instruct"
    assert (seed.rollout.group_size, seed.dapo.eps_low, seed.dapo.eps_high, seed.train.learning_rate) == (
        4, 0.2, 0.28, 1e-6,
    )
    assert (seed.rollout.max_new_tokens, seed.rollout.temperature, seed.rollout.top_k, seed.dapo.beta) == (
        128, 0.9, 50, 0.0,
    )
    # The seed trainer's optimizer step (docs/peers.md): 2 prompts x G=4 in 2 accumulated micro-batches, 300 of them.
    per_update = seed.train.prompts_per_step // seed.train.updates_per_step * seed.rollout.group_size
    assert (per_update, per_update // seed.train.micro_batch_size, total_optimizer_steps(seed)) == (8, 2, 300)
    # qwen1.5b.yaml: the field's settings (docs/training.md, The Qwen configs and the evidence), the seed's
    # schedule: 150 steps of 4 prompts x G=8 as 2 updates of 2 x 8 = 16 sequences, 300 optimizer steps.
    qwen = load_config(str(root / "qwen1.5b.yaml"), [])
    assert (qwen.rollout.group_size, qwen.rollout.max_new_tokens, qwen.rollout.temperature, qwen.rollout.top_p,
            qwen.rollout.top_k, qwen.dapo.eps_low, qwen.dapo.eps_high, qwen.dapo.beta, qwen.train.learning_rate) == (
        8, 512, 1.0, 1.0, 0, 0.2, 0.28, 0.0, 1e-6,
    )
    per_update = qwen.train.prompts_per_step // qwen.train.updates_per_step * qwen.rollout.group_size
    assert (per_update, total_optimizer_steps(qwen)) == (16, 300)
    assert qwen.rewards[-1].name == "overlong" and qwen.rewards[-1].args == {"cache_length": 0.25}  # 128 of 512
    # Only the sampling and its budget (and the overlong comment's numbers) move from the seed's settings.
    changed = {"group_size", "max_new_tokens", "temperature", "top_k"}
    assert {k for k in dataclasses.asdict(seed.rollout) if getattr(seed.rollout, k) != getattr(qwen.rollout, k)} \
        == changed
    assert (seed.dapo, seed.rewards) == (qwen.dapo, qwen.rewards)
    # and the budget from the card, and a run that gets worse stops (the strong-start study, docs/studies.md)
    assert (seed.train.micro_batch_tokens, qwen.train.micro_batch_tokens) == (2048, "auto")
    assert dataclasses.replace(qwen.train, micro_batch_tokens=2048) == seed.train
    assert (seed.eval.stop_on_regression, qwen.eval.stop_on_regression) == (False, True)
    assert dataclasses.replace(qwen.eval, stop_on_regression=False) == seed.eval
    vllm = load_config(str(root / "qwen1.5b-vllm.yaml"), [])
    assert dataclasses.replace(vllm.rollout, engine=qwen.rollout.engine, vllm_memory=qwen.rollout.vllm_memory) \
        == qwen.rollout and (vllm.dapo, vllm.train) == (qwen.dapo, qwen.train)
    paper = load_config(str(root / "qwen1.5b-paper.yaml"), [])
    assert (paper.rollout.group_size, paper.train.updates_per_step, paper.train.learning_rate) == (16, 16, 1e-6)
    lora = load_config(str(root / "qwen1.5b-lora.yaml"), [])
    # verl's LoRA recipe (docs/advance/ppo_lora.rst): rank 32, alpha 32, lr 3e-5; its GSM8K example's KL 1e-3.
    assert (lora.model.lora.r, lora.model.lora.alpha, lora.model.dtype, lora.rollout.group_size,
            lora.train.learning_rate, lora.dapo.beta) == (32, 32.0, "bfloat16", 16, 3e-5, 1e-3)
    # The qwen1.5b.yaml settings but LoRA, the learning rate, the group size (and what the group changes) and beta.
    lora_only = {"model", "rollout", "train", "dapo", "run_name", "output_dir"}
    assert {k for k in dataclasses.asdict(qwen) if getattr(qwen, k) != getattr(lora, k)} <= lora_only
    assert dataclasses.replace(lora.dapo, beta=qwen.dapo.beta) == qwen.dapo
    assert dataclasses.replace(lora.rollout, group_size=qwen.rollout.group_size) == qwen.rollout
    assert all(clip_can_act(cfg) for cfg in (load_config(None, []), seed, qwen, paper, lora))  # eps_high acts in all


def test_every_choice_list_is_its_registrys_keys():
    """A variant is added to one registry; the schema's choice list must follow, and this says so."""
    import dataclasses

    from dapo_train.algo import LOSS_REDUCTIONS
    from dapo_train.algo.advantages import ADVANTAGE_STDS
    from dapo_train.algo.correction import ROLLOUT_CORRECTIONS
    from dapo_train.config.schema import Config
    from dapo_train.model.loading import ATTENTION_KERNELS, AUTOCAST_DTYPES, DTYPES, GRADIENT_CHECKPOINTING
    from dapo_train.rollout.hf_engines import ROLLOUT_DTYPES
    from dapo_train.run.trackers import TRACKERS
    from dapo_train.train.collect.screen import SCREEN_FATES
    from dapo_train.train.update.optim import LR_SCHEDULES

    registries = {
        "dapo.loss_reduction": set(LOSS_REDUCTIONS),
        "dapo.advantage_std": set(ADVANTAGE_STDS),
        "train.lr_scheduler": set(LR_SCHEDULES),
        "logging.trackers": set(TRACKERS),
        "model.dtype": {"auto", *DTYPES},  # auto = float32 master weights
        "model.gradient_checkpointing": set(GRADIENT_CHECKPOINTING),
        "model.attn_implementation": {None, *ATTENTION_KERNELS},  # null = transformers' default
        "train.mixed_precision": {"auto", *AUTOCAST_DTYPES},  # auto = modeling.mixed_precision's pick
        "rollout.dtype": {"auto", *ROLLOUT_DTYPES},
        "train.shared_prefix": {"auto", "on", "off"},  # switches: auto = when the attention kernel allows
        "rollout.compile": {"auto", "on", "off"},
        "dapo.screen_drop": set(SCREEN_FATES),
        "dapo.rollout_correction": {"auto", *ROLLOUT_CORRECTIONS},  # auto = behaviour.resolve's pick
        "dapo.old_logprobs": {"auto", "recompute", "rollout"},  # a switch: auto = when the rollout is the forward
    }
    choices = {}
    defaults = Config()
    for section in dataclasses.fields(defaults):
        value = getattr(defaults, section.name)
        for f in dataclasses.fields(value) if dataclasses.is_dataclass(value) else ():
            if f.metadata.get("choices"):
                choices[f"{section.name}.{f.name}"] = set(f.metadata["choices"])
    assert choices == registries


def test_a_bare_on_or_off_reads_as_the_switch_value(tmp_path):
    """YAML 1.1 reads `on` / `off` as booleans; a switch setting takes them as the words."""
    (tmp_path / "c.yaml").write_text("train:\n  shared_prefix: off\nrollout:\n  compile: on\n")
    cfg = load_config(tmp_path / "c.yaml", ["model.gradient_checkpointing=off"])
    assert (cfg.train.shared_prefix, cfg.rollout.compile, cfg.model.gradient_checkpointing) == ("off", "on", "off")
    with pytest.raises(ConfigError, match="rollout.top_p"):
        load_config(None, ["rollout.top_p=on"])  # not a switch: still a type error


RETIRED_NOTICE = "config key 'checkpoint.save_optimizer' is retired and ignored"


def test_a_retired_key_in_an_old_runs_config_is_read_with_a_notice(tmp_path, caplog):
    """Old run folders hold checkpoint.save_optimizer (removed: never read); eval and --resume
    read such a config.yaml as a base, a YAML file or an override, one notice each."""
    cfg = load_config(None, ["dapo.eps_high=0.4"])
    save_config(cfg, tmp_path / "config.yaml")
    text = (tmp_path / "config.yaml").read_text().replace("checkpoint:\n", "checkpoint:\n  save_optimizer: true\n")
    (tmp_path / "config.yaml").write_text(text)
    assert "save_optimizer: true" in text
    assert load_config(None, [], base=read_yaml(tmp_path / "config.yaml")) == cfg
    assert f"saved config: {RETIRED_NOTICE}" in caplog.text
    caplog.clear()
    assert load_config(str(tmp_path / "config.yaml"), []).dapo.eps_high == 0.4
    assert f"config.yaml: {RETIRED_NOTICE}" in caplog.text
    caplog.clear()
    assert load_config(None, ["checkpoint.save_optimizer=false"]).checkpoint == load_config(None, []).checkpoint
    assert f"KEY=VALUE: {RETIRED_NOTICE}" in caplog.text
    with pytest.raises(ConfigError, match="checkpoint.save_optimiser"):  # a typo is still an unknown key
        load_config(None, ["checkpoint.save_optimiser=false"])
    caplog.clear()
    assert load_config(None, ["train.logprob_chunk_size=1024"]).train == load_config(None, []).train  # MiB now
    assert "config key 'train.logprob_chunk_size' is retired and ignored: replaced by train.logprob_chunk_mib" \
        in caplog.text


def test_a_nested_section_and_list_values_from_yaml_and_overrides(tmp_path):
    """model.lora is a section inside a section; target_modules and logging.trackers are lists of
    names, set whole (`=[a, b]`), by index (`.1=x`) or as one name alone (a list of one)."""
    from dapo_train.config.load import config_to_dict, flatten_config

    path = tmp_path / "lora.yaml"
    path.write_text(
        "model:\n  lora:\n    r: 8\n    target_modules: [q_proj, v_proj]\nlogging:\n  trackers: [tensorboard]\n"
    )
    cfg = load_config(str(path), ["model.lora.alpha=32", "model.lora.target_modules.1=o_proj"])
    assert (cfg.model.lora.r, cfg.model.lora.alpha, cfg.model.lora.target_modules) == (8, 32.0, ["q_proj", "o_proj"])
    assert cfg.model.name_or_path == "builtin:tiny"  # the rest of the section keeps its defaults
    assert cfg.logging.trackers == ["tensorboard"]
    assert load_config(None, ["logging.trackers=tensorboard"]).logging.trackers == ["tensorboard"]
    assert load_config(None, ["model.lora.target_modules=[gate_proj, up_proj]"]).model.lora.target_modules == [
        "gate_proj", "up_proj",
    ]
    flat = flatten_config(config_to_dict(cfg))
    assert (flat["model.lora.r"], flat["model.lora.target_modules.1"], flat["logging.trackers.0"]) == (
        8, "o_proj", "tensorboard",
    )
    save_config(cfg, tmp_path / "saved.yaml")
    assert config_from_dict(read_yaml(tmp_path / "saved.yaml")) == cfg
    assert load_config(None, []).model.lora.target_modules is not Config().model.lora.target_modules  # no sharing


@pytest.mark.parametrize(
    "override, key, message",
    [
        ("model.lora.target_modules=[1]", "model.lora.target_modules.0", "expected str"),
        ("model.lora.target_modules=[]", "model.lora.target_modules", "at least one layer"),
        ("model.lora.target_modules={a: 1}", "model.lora.target_modules", "expected a list"),
        ("model.lora.alpah=8", "model.lora.alpah", "did you mean 'model.lora.alpha'"),
        ("model.lora=8", "model.lora", "is a section, not a value; set its keys, e.g. model.lora.r=..."),
        ("model.lora.r=-1", "model.lora.r", ">= 0"),
        ("model.lora.alpha=0", "model.lora.alpha", "> 0"),
        ("model.lora.dropout=1.0", "model.lora.dropout", "[0, 1)"),
        ("logging.trackers=[tensorbord]", "logging.trackers", "allowed: tensorboard, wandb"),
        ("logging.trackers=[wandb, wandb]", "logging.trackers", "named twice"),
        ("eval.regression_alpha=0", "eval.regression_alpha", "must be in (0, 1)"),
        ("eval.regression_alpha=1.0", "eval.regression_alpha", "must be in (0, 1)"),
    ],
)
def test_bad_nested_and_list_values_name_their_key(override, key, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert info.value.key == key and message in str(info.value)


def test_the_old_logging_tracker_key_is_read_as_trackers_with_a_notice(tmp_path, caplog):
    """logging.tracker (one name or none) reads as logging.trackers (a list): an old run folder's
    config.yaml, a file and an override all still work, one notice each."""
    cfg = load_config(None, [])
    save_config(cfg, tmp_path / "config.yaml")
    old = (tmp_path / "config.yaml").read_text().replace("  trackers: []\n", "  tracker: tensorboard\n")
    (tmp_path / "config.yaml").write_text(old)
    assert "tracker: tensorboard" in old and "trackers" not in old
    assert load_config(None, [], base=read_yaml(tmp_path / "config.yaml")).logging.trackers == ["tensorboard"]
    assert "config key 'logging.tracker' is now 'logging.trackers'" in caplog.text
    assert load_config(str(tmp_path / "config.yaml"), []).logging.trackers == ["tensorboard"]
    (tmp_path / "config.yaml").write_text(old.replace("tracker: tensorboard", "tracker: none"))
    assert load_config(None, [], base=read_yaml(tmp_path / "config.yaml")).logging.trackers == []
    caplog.clear()
    assert load_config(None, ["logging.tracker=tensorboard"]).logging.trackers == ["tensorboard"]
    assert caplog.text.count("is now 'logging.trackers'") == 1


def test_float16_weights_under_fp16_mixed_precision_are_refused_when_the_config_is_read():
    """fp16's loss scaler unscales float32 master gradients only: over float16 weights the first optimizer step
    raised (torch's GradScaler: "Attempting to unscale FP16 gradients"), after the model and a rollout. Each
    setting alone, and fp16 over bfloat16 weights, stay valid."""
    with pytest.raises(ConfigError) as info:
        load_config(None, ["model.dtype=float16", "train.mixed_precision=fp16"])
    assert info.value.key == "train.mixed_precision" and "model.dtype=float16" in str(info.value)
    assert "\n" not in str(info.value)
    for fine in (["model.dtype=float16"], ["train.mixed_precision=fp16"],
                 ["model.dtype=bfloat16", "train.mixed_precision=fp16"]):
        load_config(None, fine)


# --------------------------------------------------------------------------------------------
# Issue 59, item 12: what a run derives inside its folder stays there, and a leading ~ is the home folder.


# Paths that climb out are built from os.pardir: the text of one in a test's strings is what
# tests/test_self_contained.py looks for to find reads outside the repository, and these are refused, never read.
@pytest.mark.parametrize("name", [os.path.join(os.pardir, "escape"), os.path.join("a", os.pardir, os.pardir, "escape"),
                                  "/tmp/escape", "~/escape"])
def test_a_run_name_that_leaves_outputs_is_refused(name):
    """run_name=<parent>/escape wrote the run beside outputs/, not in it (output_dir, the user's own choice, may be
    anywhere; the name only picks a folder under outputs/)."""
    with pytest.raises(ConfigError) as caught:
        load_config(None, [f"run_name={name}"])
    assert caught.value.key == "run_name" and "outputs/" in str(caught.value) and "\n" not in str(caught.value)


def test_a_run_name_with_a_subfolder_stays_under_outputs():
    assert load_config(None, ["run_name=study/seed1"]).output_dir == "outputs/study/seed1"


@pytest.mark.parametrize("project", [os.path.join(os.pardir, "x"), os.path.join("a", os.pardir, os.pardir, "x"),
                                     "/tmp/x", "~/x"])
def test_a_logging_project_that_leaves_the_run_folder_is_refused(project):
    """TensorBoard writes its folder at <output_dir>/<logging.project>: <parent>/x or an absolute path put it
    outside the run, where the run's checks and --overwrite never look."""
    with pytest.raises(ConfigError) as caught:
        load_config(None, [f"logging.project={project}"])
    assert caught.value.key == "logging.project" and "run folder" in str(caught.value)


# key -> (the override that sets it to a path under ~, that path below the home folder)
HOME_PATHS = {
    "output_dir": ("output_dir=~/runs/a", "runs/a"),
    "data.path": ("data.path=~/data/gsm8k", "data/gsm8k"),
    "model.name_or_path": ("model.name_or_path=~/models/qwen", "models/qwen"),
    "rewards.0.args.path": ("rewards=[{name: reward_model, args: {path: ~/rm, tokenizer_path: ~/rm_tok}}]", "rm"),
}


@pytest.mark.parametrize("key", list(HOME_PATHS))
def test_a_leading_tilde_is_the_home_folder_in_every_path_key(key, tmp_path, monkeypatch):
    """'output_dir=~/x' (quoted, so no shell expanded it) made a folder named ~ in the current folder; every key
    that holds a path now reads a leading ~ as the shell does."""
    monkeypatch.setenv("HOME", str(tmp_path))
    override, below_home = HOME_PATHS[key]
    cfg = load_config(None, [override])
    values = {"output_dir": cfg.output_dir, "data.path": cfg.data.path, "model.name_or_path": cfg.model.name_or_path,
              "rewards.0.args.path": cfg.rewards[0].args.get("path")}
    assert values[key] == str(tmp_path / below_home), values
    if key.startswith("rewards"):
        assert cfg.rewards[0].args["tokenizer_path"] == str(tmp_path / "rm_tok")


def test_a_tilde_no_home_expands_is_refused_naming_the_key():
    with pytest.raises(ConfigError) as caught:
        load_config(None, ["output_dir=~no-such-user-59/x"])
    assert caught.value.key == "output_dir" and "~no-such-user-59" in str(caught.value)
