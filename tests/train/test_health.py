"""When a run stops on its own (train/health.py): the counts since the last step that trained, the
reason and the last good checkpoint it names, and the record a checkpoint carries."""

from dapo_train.config.load import load_config
from dapo_train.train.health import StepHealth

NONFINITE, STARVED, TRAINED = {"skipped_nonfinite": 1}, {"skipped_no_groups": 1, "gen_rounds": 4}, {"loss": 0.1}


def test_bad_steps_count_since_the_last_step_that_trained(tmp_path):
    """Steps 1-2 train, 3 is non-finite, 4 starved, 5 non-finite: 2 non-finite since step 2 stop a run of
    train.max_bad_steps=2, whatever lies between; the weights were clean up to step 2, so checkpoint_2 is
    the good one and checkpoint_4 (a stop saved it) is not."""
    cfg = load_config(None, ["train.max_bad_steps=2", "train.max_starved_steps=3", "train.max_steps=50"])
    health = StepHealth()
    for step, metrics in enumerate([TRAINED, TRAINED, NONFINITE, STARVED], 1):
        health.record(step, metrics)
        assert health.abort_reason(cfg, step, tmp_path) is None
    assert (health.nonfinite, health.starved, health.last_trained, health.clean_step) == (1, 1, 2, 2)
    assert health.suspect
    for step in (1, 2, 4):
        (tmp_path / f"checkpoint_{step}").mkdir()
    health.record(5, NONFINITE)
    reason = health.abort_reason(cfg, 5, tmp_path)
    assert reason.startswith("2 non-finite steps since step 2, the last that trained (train.max_bad_steps=2)")
    assert f"the last good checkpoint is {tmp_path / 'checkpoint_2'}" in reason
    health.record(6, TRAINED)  # a step that trains clears both counts
    assert (health.nonfinite, health.starved, health.last_trained, health.suspect) == (0, 0, 6, False)


def test_starved_steps_stop_the_run_and_leave_the_weights_clean(tmp_path):
    cfg = load_config(None, ["train.max_starved_steps=2", "train.max_steps=50"])
    health = StepHealth()
    for step, metrics in enumerate([TRAINED, STARVED, STARVED], 1):
        health.record(step, metrics)
    assert not health.suspect and health.clean_step == 3  # a starved step does not move the weights
    (tmp_path / "checkpoint_3").mkdir()
    reason = health.abort_reason(cfg, 3, tmp_path)
    assert reason.startswith("2 steps in a row without an informative group (train.max_starved_steps=2)")
    assert "non-finite" not in reason and f"the last good checkpoint is {tmp_path / 'checkpoint_3'}" in reason


def test_the_last_step_reached_with_suspect_weights_stops_the_run_too(tmp_path):
    cfg = load_config(None, ["train.max_steps=2"])
    health = StepHealth()
    health.record(1, TRAINED)
    health.record(2, NONFINITE)
    reason = health.abort_reason(cfg, 2, tmp_path)
    assert reason.startswith("the run reached train.max_steps with 1 non-finite step(s) since step 1")
    assert "no checkpoint holds weights from before it" in reason


def test_the_record_goes_through_a_checkpoint_and_old_ones_read():
    health = StepHealth(nonfinite=1, starved=2, last_trained=7, clean_step=7)
    assert StepHealth.from_state({"step": 10, "bad_steps": 1, "health": health.state_dict()}) == health
    # Written before the record: only the non-finite steps in a row, which ended the clean stretch.
    assert StepHealth.from_state({"step": 10, "bad_steps": 2}) == StepHealth(2, 0, 8, 8)
