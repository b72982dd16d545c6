"""The automatic run name (issue 49, point 3): the config and the settings that change training, bounded,
with a hash for what does not fit; and the run folder's name checked against the file system's limit
before anything loads (issue 47, point 6)."""

import re
from pathlib import Path

import pytest

from dapo_train.config.load import load_config
from dapo_train.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
QWEN = str(ROOT / "configs" / "qwen1.5b.yaml")
PROMPT = "你是一个擅长数学的助手" * 9  # 99 characters, 297 bytes of UTF-8: longer than a file name may be


def name(*overrides: str, config: str | None = None) -> str:
    return load_config(config, list(overrides)).run_name


def test_a_setting_that_changes_training_names_the_run_whatever_the_order():
    assert name("dapo.eps_high=0.4") == "tiny-cpu_eps_high=0.4"
    assert name("train.max_steps=7", "dapo.eps_high=0.4") == "tiny-cpu_eps_high=0.4_max_steps=7"
    assert name("dapo.eps_high=0.4", "train.max_steps=7") == "tiny-cpu_eps_high=0.4_max_steps=7"
    assert name("seed=3") == "tiny-cpu_seed=3"  # seeds of one setting are runs of their own


def test_a_yaml_comment_in_a_value_names_nothing():
    """Issue 59 item 15: `train.learning_rate='1e-4 # comment'` trained at 1e-4 in tiny-cpu_learning_rate=1e-4-comment
    (YAML drops the comment; the name kept it). A '#' that is part of the value (quoted) still names it."""
    cfg = load_config(None, ["train.learning_rate=1e-4 # comment"])
    assert cfg.train.learning_rate == 1e-4 and cfg.run_name == "tiny-cpu_learning_rate=1e-4"
    assert name("train.learning_rate=1e-4") == cfg.run_name  # the same experiment, the same folder
    assert name("dapo.eps_high=0.4   # the paper's", "train.max_steps=7  #") == "tiny-cpu_eps_high=0.4_max_steps=7"
    quoted = load_config(None, ["data.system_prompt='answer # with care'"])
    assert quoted.data.system_prompt == "answer # with care" and quoted.run_name != "tiny-cpu_system_prompt=answer"


def test_paths_cadences_and_speed_settings_leave_the_name_alone():
    """Where the data's columns are, when to evaluate or save, what to show, how many rows a forward
    takes: the same experiment, so the same folder (and bare --resume finds it)."""
    assert name(
        "data.prompt_field=q", "data.answer_field=a", "eval.every_steps=0", "eval.num_items=20",
        "checkpoint.every_steps=5", "checkpoint.keep_last=1", "logging.progress_bar=false",
        "logging.rollout_every=1", "train.micro_batch_size=4", "rollout.generation_batch_size=64",
        "train.logprob_chunk_mib=16", "train.num_threads=2",
    ) == "tiny-cpu"


def test_a_local_copy_of_the_configs_model_and_data_keeps_its_name():
    """The README's offline command writes the folder its next command evaluates (outputs/qwen1.5b);
    another model or data set is another experiment, named by its last part."""
    offline = load_config(QWEN, ["model.name_or_path=./Qwen2.5-1.5B-Instruct", "data.path=./gsm8k_chinese"])
    assert offline.output_dir == str(Path("outputs") / "qwen1.5b")
    assert name("model.name_or_path=Qwen/Qwen2.5-7B-Instruct", config=QWEN) == "qwen1.5b_model=Qwen2.5-7B-Instruct"
    seed = load_config(str(ROOT / "configs" / "qwen1.5b-seed.yaml"), ["model.name_or_path=./Qwen2.5-1.5B-Instruct"])
    assert seed.output_dir == str(Path("outputs") / "qwen1.5b-seed")  # the seed trainer's settings: a run of its own
    assert name("data.path=./mine/train.jsonl", "data.prompt_field=q") == "tiny-cpu_data=train.jsonl"


def test_a_value_that_is_long_or_not_plain_text_is_named_by_a_hash():
    one, other = name(f"data.system_prompt={PROMPT}"), name(f"data.system_prompt={PROMPT}!")
    assert re.fullmatch(r"tiny-cpu_system_prompt=[0-9a-f]{6}", one), one
    assert one != other


def test_four_ordinary_overrides_name_a_folder_under_100_characters():
    """Issue 49's acceptance (the issue's own four passed 200 characters)."""
    cfg = load_config(None, [
        "data.path=./arithmetic_word_problems_train_split_2026.jsonl", f"data.system_prompt={PROMPT}",
        "train.learning_rate=3e-6", "rollout.max_new_tokens=1024",
    ])
    assert len(Path(cfg.output_dir).name) < 100, cfg.output_dir


def test_a_name_past_its_bound_ends_in_a_hash_of_every_setting():
    settings = ["dapo.eps_high=0.4", "dapo.eps_low=0.1", "rollout.group_size=16", "rollout.max_new_tokens=1024",
                "rollout.temperature=0.9", "train.learning_rate=3e-6", "train.prompts_per_step=16"]
    full = name(*settings)
    assert len(full) <= 80 and re.search(r"_[0-9a-f]{8}$", full), full
    assert full.startswith("tiny-cpu_eps_high=0.4_eps_low=0.1_group_size=16")
    # The last setting is past the bound, so only the hash tells the two runs apart.
    assert name(*settings[:-1], "train.prompts_per_step=32") != full


def test_a_run_folder_name_past_the_file_system_limit_is_refused_before_anything_loads(tmp_path):
    """A name of 300 bytes passes every common file system's limit (255 bytes: ext4, xfs, btrfs, APFS)."""
    with pytest.raises(ConfigError, match=r"'run_name': .*300 bytes.* at most \d+"):
        load_config(None, ["run_name=" + "x" * 300])
    with pytest.raises(ConfigError, match=r"'output_dir': .*300 bytes.* at most \d+"):
        load_config(None, [f"output_dir={tmp_path}/{'字' * 100}/run"])
    assert load_config(None, ["run_name=" + "x" * 200]).run_name == "x" * 200
    # An automatic name is bounded, but a config file's own name may already be near the limit.
    config = tmp_path / ("c" * 250 + ".yaml")
    config.write_text("seed: 1\n")
    with pytest.raises(ConfigError, match=r"'run_name': .*set run_name= or output_dir="):
        load_config(str(config), ["dapo.eps_high=0.4"])
