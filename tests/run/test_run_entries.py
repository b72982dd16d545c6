"""Issue 52 items 1-2: what is a run's in its folder goes by the exact names the run writes, and the run never
writes its files through a link. The user's files are hashed before and after: byte-identical with and without
--overwrite, and every refusal is one line, before the data or the model loads (preflight --keep, which nests
the same rule: tests/preflight/test_keep.py)."""

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dapo_train.config.load import load_config
from dapo_train.errors import UserError
from dapo_train.run.folder import resume_config
from dapo_train.run.layout import RUN_MARKER
from dapo_train.run.logs import read_metrics
from dapo_train.train import loop

TINY_MODEL = Path(__file__).resolve().parents[2] / "dapo_train" / "assets" / "tiny" / "model"
SMALL = [
    "rollout.group_size=4", "rollout.max_new_tokens=48", "train.prompts_per_step=2", "train.micro_batch_size=8",
    "train.updates_per_step=1", "train.num_threads=1", "eval.every_steps=0", "eval.final_full=false",
    "logging.progress_bar=false", "logging.rollout_groups=0", "train.max_steps=1",
]
# Names that merely look like the run's (issue 52, item 1, as reproduced: all three were deleted, exit 0).
LOOKALIKES = ("checkpoint_1.tar.gz", "checkpoint_1_notes.md", "abandoned_after_step_review.txt")


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tree(folder: Path) -> dict[str, str]:
    """Every entry under `folder` -> its content's sha256 ('dir' for a folder, the target for a link)."""
    return {str(p.relative_to(folder)): f"link {os.readlink(p)}" if p.is_symlink() else "dir" if p.is_dir()
            else sha(p) for p in sorted(folder.rglob("*"))}


@pytest.fixture
def no_setup(monkeypatch):
    """Nothing past the cheap checks may run: a refusal must come before the data and the model."""
    def refuse(*args, **kwargs):
        raise AssertionError("setup (data, model) ran")

    monkeypatch.setattr(loop, "setup", refuse)


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    """A one-step run (checkpoint_1) as this version writes it."""
    out = tmp_path_factory.mktemp("runs") / "run"
    return loop.train(load_config(None, [*SMALL, f"output_dir={out}"]))


def copy_run(real_run: Path, where: Path) -> Path:
    run = where / "run"
    shutil.copytree(real_run, run, symlinks=True)
    return run


def train_refused(cfg, *needles: str, **how) -> str:
    with pytest.raises(UserError) as caught:
        loop.train(cfg, **how)
    message = str(caught.value)
    assert "\n" not in message and "nothing was changed" in message, message
    for needle in needles:
        assert needle in message, message
    return message


# --------------------------------------------------------------------------------------------
# Item 1: an entry is the run's only in the exact form the run writes it.


@pytest.mark.parametrize("overwrite", [True, False])
def test_names_that_only_look_like_the_runs_survive(real_run, tmp_path, no_setup, overwrite):
    run = copy_run(real_run, tmp_path)
    for name in LOOKALIKES:
        (run / name).write_text(f"the user's {name}\n")
    before = tree(run)
    cfg = load_config(None, [*SMALL, f"output_dir={run}"])
    # with --overwrite: refused, each named; without: the run that saved checkpoint_1 is kept as ever
    if overwrite:
        train_refused(cfg, "also holds what no dapo-train run folder writes", *LOOKALIKES, overwrite=True)
    else:
        with pytest.raises(UserError, match="already holds a run; continue it with"):
            loop.train(cfg)
    assert tree(run) == before


def test_notes_inside_a_checkpoint_refuse_the_overwrite(real_run, tmp_path, no_setup):
    """A run-owned folder holding what the run never writes is not deleted whole: --overwrite refuses, naming it; a
    checkpoint_<N>/ the run never wrote (issue 59, item 7) is named whole."""
    run = copy_run(real_run, tmp_path)
    (run / "checkpoint_3").mkdir()
    (run / "checkpoint_3" / "notes.md").write_text("step 3 looked odd\n")
    (run / "checkpoint_1" / "eval_notes.txt").write_text("mine\n")
    abandoned = run / "abandoned_after_step1_20261206-051500"
    (abandoned / "checkpoint_2").mkdir(parents=True)
    (abandoned / "checkpoint_2" / "review.md").write_text("why I went back\n")
    before = tree(run)
    train_refused(load_config(None, [*SMALL, f"output_dir={run}"]), "checkpoint_3/ without .dapo-train-checkpoint",
                  "checkpoint_1/eval_notes.txt", "abandoned_after_step1_20261206-051500/checkpoint_2/ without",
                  overwrite=True)
    assert tree(run) == before


def test_overwrite_removes_every_exact_form_the_run_writes(real_run, tmp_path, caplog):
    """What the run does write, in each of its forms, still goes: a kill's temporary checkpoint, what a resume set
    aside (two in one second: _2), the eval files `dapo-train eval` put in a checkpoint, and a LoRA checkpoint's
    files as the installed peft and transformers save them (each checkpoint marked, as the run marks the ones it
    writes)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dapo_train.run.checkpoint import CHECKPOINT_KIND
    from dapo_train.run.outputs import mark

    run = copy_run(real_run, tmp_path)
    shutil.copytree(run / "checkpoint_1", run / "checkpoint_5")  # every file a checkpoint holds, in one the new run
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(TINY_MODEL), LoraConfig(r=2, target_modules=["q_proj"]))
    model.save_pretrained(run / "checkpoint_6")
    AutoTokenizer.from_pretrained(TINY_MODEL).save_pretrained(run / "checkpoint_6")
    mark(run / "checkpoint_6", CHECKPOINT_KIND)
    for name in (".tmp_checkpoint_2_4242/model.safetensors", "checkpoint_5/eval_test_limit8.json",  # will not write
                 "checkpoint_5/completions_test_limit8.jsonl", "checkpoint_5/.eval_test.json.4242.tmp",
                 "abandoned_after_step0_20261206-051500/metrics.jsonl",
                 "abandoned_after_step0_20261206-051500_2/checkpoint_1/trainer_state.pt",
                 "abandoned_after_step0_20261206-051500_2/eval_items/step_1.jsonl"):
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text("the run's\n")
    mark(run / "abandoned_after_step0_20261206-051500_2" / "checkpoint_1", CHECKPOINT_KIND)
    loop.train(load_config(None, [*SMALL, f"output_dir={run}"]), overwrite=True)
    assert sorted(p.name for p in run.iterdir() if p.name.startswith((".tmp", "abandoned", "checkpoint"))) == [
        "checkpoint_1"]
    assert [row["step"] for row in read_metrics(run)] == [1]


# --------------------------------------------------------------------------------------------
# Item 2: a run's file that is a link is refused, and what it points to is left as it was.


def linked_run(tmp_path: Path, name: str, hard: bool) -> tuple[Path, Path]:
    """A marked run folder that never saved a checkpoint (a restart is allowed), `name` a link to a file of the
    user's beside it. -> (run folder, the user's file)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / RUN_MARKER).write_text('{"written_by": "dapo-train"}\n')
    mine = tmp_path / f"my_{name}"
    mine.write_text("the user's own experiment notes\n" * 3)
    if hard:
        os.link(mine, run / name)
    else:
        (run / name).symlink_to(Path(os.pardir) / mine.name)
    return run, mine


@pytest.mark.parametrize("hard", [False, True], ids=["symlink", "hard link"])
@pytest.mark.parametrize("name", ["config.yaml", "metrics.jsonl"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_a_run_file_that_is_a_link_is_refused(tmp_path, no_setup, name, hard, overwrite):
    """Reproduced: a restart without --overwrite overwrote config.yaml's target and truncated metrics.jsonl's."""
    run, mine = linked_run(tmp_path, name, hard)
    before, kept = sha(mine), tree(run)
    train_refused(load_config(None, [*SMALL, f"output_dir={run}"]), f"{run / name} is a ",
                  "hard link" if hard else "symbolic link", overwrite=overwrite)
    assert sha(mine) == before and tree(run) == kept


def test_resume_refuses_a_linked_config(real_run, tmp_path, no_setup):
    """--resume rewrote config.yaml through the link as well."""
    run = copy_run(real_run, tmp_path)
    mine = tmp_path / "my_experiment.yaml"
    (run / "config.yaml").rename(mine)
    (run / "config.yaml").symlink_to(Path(os.pardir) / mine.name)
    before, kept = sha(mine), tree(run)
    cfg, checkpoint = resume_config(str(run), None, ["train.max_steps=2"])
    train_refused(cfg, f"{run / 'config.yaml'} is a symbolic link", resume=checkpoint)
    assert sha(mine) == before and tree(run) == kept


def test_a_linked_run_file_on_the_command_line_is_one_line_and_exit_2(tmp_path):
    run, mine = linked_run(tmp_path, "metrics.jsonl", hard=False)
    before = sha(mine)
    result = subprocess.run([sys.executable, "-m", "dapo_train", "run", f"output_dir={run}", "train.max_steps=1"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and "is a symbolic link" in lines[0], result.stderr
    assert sha(mine) == before


def test_a_linked_marker_or_records_folder_is_refused(tmp_path, no_setup):
    """The marker and the folders a run writes its records into follow the same rule."""
    run = tmp_path / "run"
    run.mkdir()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine\n")
    (tmp_path / "marker_of_mine").write_text("mine\n")
    (run / RUN_MARKER).symlink_to(tmp_path / "marker_of_mine")
    cfg = load_config(None, [*SMALL, f"output_dir={run}"])
    train_refused(cfg, f"{run / RUN_MARKER} is a symbolic link")
    (run / RUN_MARKER).unlink()
    (run / RUN_MARKER).write_text('{"written_by": "dapo-train"}\n')
    (run / "rollouts").symlink_to(mine)
    train_refused(cfg, f"{run / 'rollouts'} is a symbolic link")
    assert (tmp_path / "marker_of_mine").read_text() == "mine\n" and sorted(os.listdir(mine)) == ["notes.txt"]


# --------------------------------------------------------------------------------------------
# Issue 59, items 7 and 15: a checkpoint_<N>/ is the run's only when the run wrote it, in the exact form it writes.


def test_overwrite_keeps_a_checkpoint_folder_the_run_never_wrote(real_run, tmp_path, no_setup):
    """Item 7, as reproduced: --overwrite deleted the user's 5-byte text file checkpoint_9/trainer_state.pt from a
    run whose steps end before 9 (here at 1). Refused now, naming the folder; the file keeps its bytes."""
    run = copy_run(real_run, tmp_path)
    mine = run / "checkpoint_9" / "trainer_state.pt"
    mine.parent.mkdir()
    mine.write_text("mine\n")
    before, digest = tree(run), sha(mine)
    train_refused(load_config(None, [*SMALL, f"output_dir={run}"]), "checkpoint_9/", overwrite=True)
    assert tree(run) == before and sha(mine) == digest


def test_a_checkpoint_from_before_its_marker_is_the_runs_when_its_state_says_its_step(real_run, tmp_path, caplog):
    """Old run folders: a checkpoint written before checkpoints were marked is the run's when its trainer_state.pt
    is a trainer state of the step its name says; --overwrite replaces such a run as before. A copy under another
    step's name (the state says 1, the name 4) is not one the run wrote: refused, named."""
    from dapo_train.run.checkpoint import CHECKPOINT_MARKER

    run = copy_run(real_run, tmp_path)
    (run / "checkpoint_1" / CHECKPOINT_MARKER).unlink()  # as an older dapo-train left it
    shutil.copytree(run / "checkpoint_1", run / "checkpoint_4")
    before = tree(run)
    cfg = load_config(None, [*SMALL, f"output_dir={run}"])
    train_refused(cfg, "checkpoint_4/", overwrite=True)
    assert tree(run) == before
    shutil.rmtree(run / "checkpoint_4")
    loop.train(cfg, overwrite=True)
    assert "removed what the earlier run wrote" in caplog.text and "checkpoint_1/" in caplog.text
    assert (run / "checkpoint_1" / CHECKPOINT_MARKER).is_file() and [r["step"] for r in read_metrics(run)] == [1]


def test_a_checkpoint_name_with_leading_zeros_is_not_the_runs(real_run, tmp_path, no_setup):
    """Item 15: checkpoint_007/ was read as step 7 from its name: `--resume RUN` took it for the latest checkpoint
    and --overwrite deleted it. The run writes checkpoint_7/: checkpoint_007/ is the user's, whatever it holds."""
    run = copy_run(real_run, tmp_path)
    shutil.copytree(run / "checkpoint_1", run / "checkpoint_007")
    before = tree(run)
    cfg, checkpoint = resume_config(str(run), None, [])
    assert checkpoint == run / "checkpoint_1"
    train_refused(load_config(None, [*SMALL, f"output_dir={run}"]), "checkpoint_007/", overwrite=True)
    assert tree(run) == before
