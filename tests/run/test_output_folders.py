"""Issue 38 point 1, issue 47 items 1-4: only a run is replaced, and only what the run wrote; a folder is a run
when the run marked it, or an older dapo-train wrote it. Every refused folder is left byte for byte as it was
(hashed before and after), refused in one line before anything loads; a real run folder is still replaced by
--overwrite, which names what it removed. The same rule for sweep --dir and export -o (preflight --keep:
tests/preflight/test_keep.py)."""

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dapo_train.config.load import load_config
from dapo_train.errors import UserError
from dapo_train.run.folder import prepare_run_dir, resume_config
from dapo_train.run.layout import RUN_MARKER, run_kind
from dapo_train.run.logs import read_metrics
from dapo_train.run.outputs import holds_own
from dapo_train.train import loop

ROOT = Path(__file__).resolve().parents[2]
TINY_MODEL = ROOT / "dapo_train" / "assets" / "tiny" / "model"
TINY_DATA = ROOT / "dapo_train" / "assets" / "tiny" / "data"
OLD_RUN = ROOT / "tests" / "fixtures" / "run_before_layout" / "run"
SMALL = [
    "rollout.group_size=4", "rollout.max_new_tokens=48", "train.prompts_per_step=2", "train.micro_batch_size=8",
    "train.updates_per_step=1", "train.num_threads=1", "eval.every_steps=0", "eval.final_full=false",
    "logging.progress_bar=false", "logging.rollout_groups=0", "train.max_steps=1",
]


def tree(folder: Path) -> dict[str, str]:
    """Every file and folder under `folder` -> its content's sha256 ('dir' for a folder)."""
    return {str(p.relative_to(folder)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*"))}


def user_folder(path: Path) -> Path:
    """A folder of the user's own: notes and a data folder."""
    (path / "data").mkdir(parents=True)
    (path / "notes.txt").write_text("my notes\n")
    (path / "data" / "train.jsonl").write_text('{"question_zh-cn": "1+1=?", "answer_only": 2}\n')
    return path


@pytest.fixture
def no_setup(monkeypatch):
    """Nothing past the cheap checks may run: a refusal must come before the data and the model."""
    def refuse(*args, **kwargs):
        raise AssertionError("setup (data, model) ran")

    monkeypatch.setattr(loop, "setup", refuse)


def refused(overrides: list[str], *needles: str, overwrite: bool = True) -> str:
    cfg = load_config(None, [*SMALL, *overrides])
    with pytest.raises(UserError) as caught:
        loop.train(cfg, overwrite=overwrite)
    message = str(caught.value)
    assert "\n" not in message and "nothing was changed" in message, message
    for needle in needles:
        assert needle in message, message
    return message


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    """A one-step run (checkpoint_1) as this version writes it."""
    out = tmp_path_factory.mktemp("runs") / "run"
    return loop.train(load_config(None, [*SMALL, f"output_dir={out}"]))


# --------------------------------------------------------------------------------------------
# Folders that are not a run, or never a place for one.


@pytest.mark.parametrize("overwrite", [True, False])
def test_a_folder_of_the_users_is_refused_with_or_without_overwrite(tmp_path, no_setup, overwrite):
    mywork = user_folder(tmp_path / "mywork")
    before = tree(mywork)
    refused([f"output_dir={mywork}"], "is not empty and is not a dapo-train run folder", "notes.txt",
            overwrite=overwrite)
    assert tree(mywork) == before


# os.pardir, not the literal: tests/test_self_contained.py refuses a '..' string (here it names a temporary folder)
@pytest.mark.parametrize("where, said", [(".", "is the current folder"), (os.pardir, "a parent of the current folder")])
def test_the_current_folder_and_its_parents_are_refused(tmp_path, monkeypatch, no_setup, where, said):
    here = user_folder(tmp_path / "project")
    monkeypatch.chdir(here)
    before = tree(tmp_path)
    refused([f"output_dir={where}"], said)
    assert tree(tmp_path) == before


def test_the_home_folder_and_the_root_are_refused(tmp_path, monkeypatch, no_setup):
    home = user_folder(tmp_path / "home")
    monkeypatch.setenv("HOME", str(home))
    before = tree(home)
    refused([f"output_dir={home}"], "is the home folder")
    refused(["output_dir=/"], "is the root folder")
    assert tree(home) == before


@pytest.mark.parametrize("output, said", [
    ("datadir", "is data.path"), ("datadir/run", "lies inside data.path"), (".", None),
])
def test_output_dir_apart_from_data_path(tmp_path, monkeypatch, no_setup, output, said):
    """data.path=datadir output_dir=datadir --overwrite deleted the data; inside it or around it is refused too."""
    work = tmp_path / "work"
    shutil.copytree(TINY_DATA, work / "datadir")
    monkeypatch.chdir(work)
    before = tree(work)
    if output == ".":  # around it: output_dir=work from outside
        monkeypatch.chdir(tmp_path)
        refused([f"data.path={work / 'datadir'}", f"output_dir={work}"], "contains data.path")
    else:
        refused(["data.path=datadir", f"output_dir={output}"], said)
    assert tree(work) == before


def test_output_dir_apart_from_the_model_and_a_reward_models_folder(tmp_path, no_setup):
    model = tmp_path / "model"
    shutil.copytree(TINY_MODEL, model)
    before = tree(tmp_path)
    refused([f"model.name_or_path={model}", f"output_dir={model}"], "is model.name_or_path")
    refused([f"model.name_or_path={model}", f"output_dir={model / 'run'}"], "lies inside model.name_or_path")
    reward = f"rewards=[{{name: reward_model, args: {{path: {model}}}}}]"
    refused([reward, f"output_dir={model / 'scores'}"], "lies inside rewards.0.args.path")
    assert tree(tmp_path) == before


def test_a_resume_into_a_folder_around_its_checkpoint_is_refused(real_run, tmp_path, no_setup):
    run = tmp_path / "parent" / "run"
    shutil.copytree(real_run, run)
    (tmp_path / "parent" / "notes.txt").write_text("mine\n")
    before = tree(tmp_path)
    cfg, checkpoint = resume_config(str(run / "checkpoint_1"), None, [f"output_dir={tmp_path / 'parent'}",
                                                                       "train.max_steps=2"])
    with pytest.raises(UserError, match="contains the resume checkpoint .*nothing was changed"):
        loop.train(cfg, resume=checkpoint)
    assert tree(tmp_path) == before


# --------------------------------------------------------------------------------------------
# Issue 47, item 1: a folder without the run marker is a run only when it is one an older dapo-train wrote.


def not_runs(root: Path) -> dict[str, tuple[Path, str]]:
    """Folders a run must never write into, each with what the refusal must say of it."""
    mine = root / "mine"  # the user's own experiment: a config and metrics of another kind
    mine.mkdir(parents=True)
    (mine / "config.yaml").write_text("experiment: mine\nlearning_rate: 0.1\n")
    (mine / "metrics.jsonl").write_text('{"epoch": 1, "loss": 0.5}\n')
    other = root / "other"  # another trainer's run
    (other / "checkpoint_100").mkdir(parents=True)
    (other / "config.yaml").write_text("trainer: someothertool\n")
    (other / "checkpoint_100" / "pytorch_model.bin").write_bytes(b"weights")
    handwritten = root / "handwritten"  # a dapo-train config of the user's, beside metrics of theirs
    handwritten.mkdir()
    (handwritten / "config.yaml").write_text("seed: 1\n")
    (handwritten / "metrics.jsonl").write_text('{"step": 1}\n')
    stateless = root / "stateless"  # an old run's config, but a checkpoint no dapo-train saved
    shutil.copytree(OLD_RUN, stateless)
    (stateless / "checkpoint_100").mkdir()
    (stateless / "checkpoint_100" / "pytorch_model.bin").write_bytes(b"weights")
    return {
        "mine": (mine, "config.yaml is not a dapo-train config (config key 'experiment': unknown key"),
        "other": (other, "config.yaml is not a dapo-train config (config key 'trainer': unknown key"),
        "handwritten": (handwritten, "config.yaml is not a config a run saved (it names no output_dir"),
        "stateless": (stateless, "checkpoint_100/ holds no trainer_state.pt"),
    }


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("name", ["mine", "other", "handwritten", "stateless"])
def test_a_folder_without_the_marker_is_a_run_only_if_an_older_run_wrote_it(tmp_path, no_setup, name, overwrite):
    """Reproduced: `mine` had its config.yaml and metrics.jsonl overwritten without --overwrite (exit 0, one
    warning); `other` was called a run, and --overwrite deleted its checkpoint_100/."""
    folder, why = not_runs(tmp_path)[name]
    before = tree(folder)
    refused([f"output_dir={folder}"], "is not empty and is not a dapo-train run folder", f"no {RUN_MARKER}", why,
            overwrite=overwrite)
    assert tree(folder) == before


def test_an_older_run_is_still_a_run_and_says_so(tmp_path):
    """The run of tests/fixtures/run_before_layout, written before the marker: a run (resumed and evaluated by
    tests/test_old_run_folder.py), kept unless --overwrite, and with it only its own files are removable."""
    old = tmp_path / "old"
    shutil.copytree(OLD_RUN, old)
    cfg = load_config(None, [*SMALL, f"output_dir={old}"])
    with pytest.raises(UserError, match="already holds a run; continue it with: dapo-train run --resume"):
        prepare_run_dir(cfg, None, overwrite=False)
    assert holds_own(old, run_kind(cfg), option="output_dir", replace=True)


def test_refusals_on_the_command_line_are_one_line_and_exit_2(tmp_path):
    """The two cases the new user met: output_dir=. and output_dir=data.path, both with --overwrite."""
    work = user_folder(tmp_path / "work")
    before = tree(work)
    for args in (["output_dir=.", "--overwrite"], ["data.path=data", "output_dir=data", "--overwrite"]):
        result = subprocess.run([sys.executable, "-m", "dapo_train", "run", *args], cwd=work, capture_output=True,
                                text=True, timeout=120)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: output_dir "), result.stderr
        assert tree(work) == before
    for name, overwrite in (("mine", []), ("other", ["--overwrite"])):  # issue 47, item 1, as reproduced
        folder, why = not_runs(tmp_path / "cli")[name]
        before = tree(folder)
        result = subprocess.run([sys.executable, "-m", "dapo_train", "run", f"output_dir={folder}", *overwrite],
                                cwd=tmp_path, capture_output=True, text=True, timeout=120)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.returncode == 2 and len(lines) == 1 and why in lines[0], result.stderr
        assert tree(folder) == before
        shutil.rmtree(tmp_path / "cli")


# --------------------------------------------------------------------------------------------
# What a run folder is, and what --overwrite removes of it.


def test_a_run_folder_holds_its_marker_and_an_old_one_is_known_by_its_files(real_run, tmp_path):
    kind = run_kind(load_config(None, []))
    assert (real_run / RUN_MARKER).is_file()
    old = tmp_path / "old"
    shutil.copytree(OLD_RUN, old)  # written before the marker existed
    assert not (old / RUN_MARKER).exists()
    assert holds_own(old, kind, option="output_dir", replace=True)
    lone = user_folder(tmp_path / "lone")
    (lone / "config.yaml").write_text("seed: 1\n")  # a config file alone is not a run
    with pytest.raises(UserError, match="is not a dapo-train run folder"):
        holds_own(lone, kind, option="output_dir")


def test_overwrite_refuses_a_run_folder_holding_foreign_files_and_names_them(real_run, tmp_path, no_setup):
    run = tmp_path / "run"
    shutil.copytree(real_run, run)
    (run / "notes.txt").write_text("mine\n")
    (run / "plots").mkdir()
    before = tree(run)
    refused([f"output_dir={run}"], "also holds what no dapo-train run folder writes (notes.txt, plots/)")
    assert tree(run) == before


def test_overwrite_still_replaces_a_real_run_and_says_what_it_removed(real_run, tmp_path, caplog):
    run = tmp_path / "run"
    shutil.copytree(real_run, run)
    shutil.copytree(run / "checkpoint_1", run / "checkpoint_7")  # the old run's, which the new one will not write
    (run / "metrics.jsonl").write_text('{"step": 9, "old": true}\n')
    (run / "dapo-train").mkdir()  # TensorBoard's folder: logging.project's default name
    assert sorted(p.name for p in run.iterdir()) == [
        ".dapo-train-run", "accuracy_losses.txt", "checkpoint_1", "checkpoint_7", "config.yaml", "dapo-train",
        "metrics.jsonl", "run.log", "run_status.json", "training_losses.txt"]
    loop.train(load_config(None, [*SMALL, f"output_dir={run}"]), overwrite=True)
    # Issue 47, item 3: each top-level entry it removed, by name (10: the first 6 named, then the count).
    assert (f"--overwrite: removed what the earlier run wrote in {run}: 10 entries: .dapo-train-run, "
            "accuracy_losses.txt, checkpoint_1/, checkpoint_7/, config.yaml, dapo-train/ and 4 more") in caplog.text
    assert [row["step"] for row in read_metrics(run)] == [1] and "old" not in read_metrics(run)[0]
    assert sorted(p.name for p in run.glob("checkpoint_*")) == ["checkpoint_1"]
    assert (run / RUN_MARKER).is_file()


@pytest.mark.parametrize("project", ["*", "[a-z]*", "n?tes.txt"])
def test_logging_project_is_a_name_not_a_pattern(real_run, tmp_path, no_setup, project):
    """Issue 47, item 4: logging.project=* made every entry the run's, and --overwrite deleted the user's files."""
    run = tmp_path / "run"
    shutil.copytree(real_run, run)
    (run / "notes.txt").write_text("mine\n")
    (run / "plots").mkdir()
    before = tree(run)
    refused([f"output_dir={run}", f"logging.project={project}"], "also holds what no dapo-train run folder writes "
            "(notes.txt, plots/)")
    assert tree(run) == before


# --------------------------------------------------------------------------------------------
# The same rule for sweep --dir, preflight --keep and export -o.


def test_sweep_dir_is_refused_where_run_would_be(tmp_path, monkeypatch):
    from dapo_train.study.sweep import plan_sweep

    config = str(ROOT / "configs" / "tiny-cpu.yaml")
    mywork = user_folder(tmp_path / "mywork")
    before = tree(mywork)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="--dir .*mywork is not empty and is not a dapo-train sweep folder.*notes.txt"):
        plan_sweep(config, ["dapo.eps_high=0.2,0.3"], None, str(mywork))
    monkeypatch.chdir(mywork)
    with pytest.raises(UserError, match=r"--dir \. is the current folder"):
        plan_sweep(config, ["dapo.eps_high=0.2,0.3"], None, ".")
    sweep = tmp_path / "sweep"  # a point's folder holding the user's files: refused before any point trains
    user_folder(sweep / "eps_high=0.2_seed0")
    (sweep / "sweep.json").write_text('{"varied_keys": ["dapo.eps_high"], "points": []}\n')  # an older sweep's
    with pytest.raises(UserError, match="eps_high=0.2_seed0 is not empty and is not a dapo-train run folder"):
        plan_sweep(config, ["dapo.eps_high=0.2,0.3"], None, str(sweep))
    assert tree(mywork) == before and "eps_high=0.2_seed0/notes.txt" in tree(sweep)


def test_a_sweep_json_of_the_users_is_not_a_sweep(tmp_path):
    """Issue 47, item 2: a folder without the sweep marker is an older sweep only when its sweep.json is one a
    sweep wrote (it was told to delete its 'damaged' sweep.json)."""
    from dapo_train.study.sweep import plan_sweep

    results = tmp_path / "results"
    results.mkdir()
    (results / "sweep.json").write_text('[{"lr": 0.1, "score": 0.5}]\n')
    before = tree(results)
    with pytest.raises(UserError, match=r"--dir .*results is not empty and is not a dapo-train sweep folder: no "
                                        r"\.dapo-train-sweep, and sweep.json is not one a sweep wrote .*nothing was"):
        plan_sweep(str(ROOT / "configs" / "tiny-cpu.yaml"), ["dapo.eps_high=0.2,0.3"], None, str(results))
    assert tree(results) == before


def test_export_output_is_refused_where_run_would_be(real_run, tmp_path, monkeypatch):
    from dapo_train.run.export import export_checkpoint

    checkpoint = real_run / "checkpoint_1"
    mywork = user_folder(tmp_path / "mywork")
    before, saved = tree(mywork), tree(checkpoint)
    cases = ((str(mywork), "is not a dapo-train export folder"), (".", "is the current folder"),
             (str(checkpoint / "export"), "lies inside the checkpoint"), (str(real_run), "contains the checkpoint"))
    for out, said in cases:
        monkeypatch.chdir(mywork if out == "." else tmp_path)
        with pytest.raises(UserError, match=f"-o .*{said}.*nothing was changed"):
            export_checkpoint(str(checkpoint), out)
    assert tree(mywork) == before and tree(checkpoint) == saved


# --------------------------------------------------------------------------------------------
# Issue 59, item 8: a symbolic link to nothing, where a command would make its folder.


def test_a_dangling_link_as_output_dir_is_one_line_and_exit_2(tmp_path):
    """Reproduced: a 44-line traceback and exit 1 (FileExistsError where the lock made the folder)."""
    link = tmp_path / "out"
    link.symlink_to(tmp_path / "gone")
    result = subprocess.run([sys.executable, "-m", "dapo_train", "run", f"output_dir={link}", "train.max_steps=1"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert f"output_dir {link} is a symbolic link to {tmp_path / 'gone'}, which does not exist" in lines[0], lines[0]
    assert link.is_symlink() and not (tmp_path / "gone").exists()


@pytest.mark.parametrize("option", ["--dir", "--keep", "-o"])
@pytest.mark.parametrize("where", ["the folder", "a parent"])
def test_every_output_folder_refuses_a_dangling_link(tmp_path, option, where):
    """The same rule for sweep --dir, preflight --keep and export -o; a dangling link above the folder too (making
    the folder's parents would fail on it)."""
    link = tmp_path / "out"
    link.symlink_to(tmp_path / "gone")
    folder = link if where == "the folder" else link / "run"
    cfg = load_config(None, SMALL)
    with pytest.raises(UserError) as caught:
        holds_own(folder, run_kind(cfg), option=option)
    said = f"{option} {folder}" + ("" if folder == link else f": {link}")
    assert f"{said} is a symbolic link to {tmp_path / 'gone'}, which does not exist" in str(caught.value)
    assert "\n" not in str(caught.value)
    assert link.is_symlink() and not (tmp_path / "gone").exists()
