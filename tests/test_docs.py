"""The docs must not drift from the code: the generated configuration reference, every registered
reward documented with its arguments, every relative link (and anchor) resolving, and every
repository path they name (scripts/..., configs/...) existing."""

import importlib.util
import inspect
import re
from pathlib import Path

from dapo_train.rewards import FILLED_ARGS, REWARDS
from dapo_train.rewards.scoring import CALL_KEYWORDS

from doc_markdown import REPO_PATH, broken_links, missing_paths, section

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# The scripts' own docs: scripts/README.md and each script's docstring (its usage line names its path).
SCRIPT_DOCS = sorted(p for p in (ROOT / "scripts").rglob("*") if p.suffix in (".md", ".py", ".sh"))


def _generator():
    path = ROOT / "scripts" / "build" / "update_config_reference.py"
    spec = importlib.util.spec_from_file_location("update_config_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_configuration_reference_matches_the_code():
    page = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert _generator().render(page) == page, "run: python scripts/build/update_config_reference.py"
    # Every default whole: the longest one (the system prompt) ends as the schema's does.
    assert "</answer>'` |" in page and "...` |" not in page


def test_every_registered_reward_is_documented_with_its_arguments():
    """docs/rewards-and-tasks.md has a section per registered reward naming each argument it takes
    (from the function's signature, so a new reward or argument fails here until it is written up)."""
    page = (ROOT / "docs" / "rewards-and-tasks.md").read_text(encoding="utf-8")
    for name, entry in REWARDS.items():
        text = section(page, f"### {name}")
        args = [p for p in inspect.signature(entry.fn).parameters.values() if p.kind is p.KEYWORD_ONLY]
        for param in args:
            if param.name not in CALL_KEYWORDS:
                assert f"`{param.name}`" in text, (name, param.name)
        assert f"{{name: {name}" in text, f"{name}: no YAML example"
    for arg, key in FILLED_ARGS.items():  # the arguments the trainer fills in, and from where
        assert f"`{arg}`" in page and f"`{key}`" in page, arg


def test_every_relative_link_resolves():
    broken = [problem for page in PAGES for problem in broken_links(page)]
    assert not broken, broken
    assert sum(len(re.findall(r"\]\((?!https?:)", p.read_text(encoding="utf-8"))) for p in PAGES) >= 30


def test_the_link_check_finds_a_missing_page_and_a_missing_heading(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## A heading: with, punctuation\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\nSee [ok](other.md#a-heading-with-punctuation), [gone](missing.md), "
        "[no anchor](other.md#nowhere) and [here](#page).\n\n    [in code](not/checked.md)\n"
    )
    assert broken_links(page) == ["page.md: missing.md (no such file)", "page.md: other.md#nowhere (no such heading)"]


def test_every_repository_path_the_docs_name_exists():
    """A script moved to scripts/bench/ must not leave `python scripts/bench_x.py` behind in a page or a
    script's usage line: every scripts/..., configs/..., tests/..., docs/..., dapo_train/... path named in
    README.md, docs/*.md, scripts/README.md and the scripts themselves exists (a glob matches a file)."""
    missing = [problem for page in [*PAGES, *SCRIPT_DOCS] for problem in missing_paths(page, ROOT)]
    assert not missing, missing
    named = sum(len(REPO_PATH.findall(p.read_text(encoding="utf-8"))) for p in PAGES)
    assert named >= 50, named  # the pages were read


def test_the_scripts_readme_names_each_folders_scripts():
    """scripts/README.md's bullet for each folder (`- `bench/`: ...`) names exactly the scripts in it: a
    moved, renamed or new script fails here until the bullet follows."""
    text = (ROOT / "scripts" / "README.md").read_text(encoding="utf-8")
    bullets = dict(re.findall(r"^- `(\w+)/`:(.*?)(?=^- `|\n\n)", text, re.M | re.S))
    assert set(bullets) == {p.name for p in (ROOT / "scripts").iterdir() if p.is_dir()}
    for folder, body in bullets.items():
        named = set(re.findall(r"`([\w.-]+\.(?:py|sh|md))`", body))
        assert named == {p.name for p in (ROOT / "scripts" / folder).iterdir() if p.is_file()}, folder


def test_the_path_check_finds_a_moved_script(tmp_path):
    (tmp_path / "scripts" / "bench").mkdir(parents=True)
    (tmp_path / "scripts" / "bench" / "bench_step.py").write_text("")
    page = tmp_path / "page.md"
    page.write_text(
        "Run `python scripts/bench/bench_step.py`, then:\n\n    python scripts/bench_step.py --quick\n\n"
        "Rows of configs/ablation/*.yaml; a new one goes in scripts/<folder>/<name>.py. See scripts/qwen_offline.py.\n"
    )
    assert missing_paths(page, tmp_path) == [
        "page.md: scripts/bench_step.py", "page.md: configs/ablation/*.yaml", "page.md: scripts/qwen_offline.py",
    ]


def test_the_trl_name_table_names_real_keys():
    """docs/peers.md maps TRL's GRPOConfig names to keys: each dotted key in its 'here' column is one
    `dapo-train config --keys` lists (a renamed key fails here until the table follows)."""
    from dapo_train.config.keys import schema_keys

    page = (ROOT / "docs" / "peers.md").read_text(encoding="utf-8")
    table = section(page, "### TRL's GRPOConfig names and the keys here")
    here = [line.split(" | ")[1] for line in table.splitlines() if line.startswith("| `")]
    named = {key for cell in here for key in re.findall(r"`([a-z_]+\.[a-z0-9_.]+)", cell)}
    assert len(named) > 20 and not named - {info.key for info in schema_keys()}  # > 20: the table was read


def test_the_run_name_rules_list_what_the_code_leaves_unnamed():
    """docs/training.md's run-name rules: every key or section the list says names nothing is one the code
    leaves unnamed (config/naming.py), and the other way round; the keys the page says do name a run (the vLLM
    engine's memory settings) are not in it, and change the automatic name."""
    from dapo_train.config.load import load_config
    from dapo_train.config.naming import UNNAMED_KEYS

    rules = section((ROOT / "docs" / "training.md").read_text(encoding="utf-8"), "### Run names")
    unnamed_list, named_part = rules.split("\n\n")[1], rules.split("\n\n")[2]
    listed = set(re.findall(r"`([a-z_]+(?:\.[a-z_]+)*)`", unnamed_list))  # keys and whole sections
    assert listed <= set(UNNAMED_KEYS)
    assert all(any(key == k or key.startswith(k + ".") for k in listed) for key in UNNAMED_KEYS), listed
    named = re.findall(r"`(rollout\.vllm_[a-z_]+)`", named_part)
    assert named == ["rollout.vllm_memory", "rollout.vllm_kv_cache_mib"]
    for key, value in zip(named, ("0.5", "512")):
        assert not any(key == k or key.startswith(k + ".") for k in UNNAMED_KEYS)
        assert load_config(str(ROOT / "configs" / "qwen1.5b-vllm.yaml"), [f"{key}={value}"]).output_dir.endswith(
            f"_{key.split('.')[1]}={value}")


def test_the_lora_page_shows_a_list_of_target_modules_as_key_value():
    """Issue 59 item 16: docs/lora.md gave no KEY=VALUE form for a list of target modules (YAML's flow list,
    quoted for the shell); the command it shows sets the list it says."""
    import shlex

    from dapo_train.config.load import load_config

    commands = [line.strip() for line in (ROOT / "docs" / "lora.md").read_text(encoding="utf-8").splitlines()
                if line.strip().startswith("dapo-train run") and "model.lora.target_modules=[" in line]
    assert commands, "docs/lora.md shows no `dapo-train run ... model.lora.target_modules=[...]` command"
    overrides = [arg for arg in shlex.split(commands[0], comments=True) if "=" in arg]
    assert load_config(None, overrides).model.lora.target_modules == ["q_proj", "v_proj", "embed_tokens"]
