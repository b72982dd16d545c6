"""`dapo-train eval` with a config that names tools: its prompts list them and the eval runs them, as the
run's rollouts did; `rollout.tools=[]` evaluates the same model without them, into another result file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from dapo_train.evaluation import command as eval_command
from dapo_train.evaluation.table import format_table

ROOT = Path(__file__).resolve().parents[2]


def _tool_config(tmp_path: Path) -> Path:
    """tools.yaml: the tiny model with the tests' tool template, and rollout.tools=[calculator]."""
    model = tmp_path / "model"
    shutil.copytree(ROOT / "dapo_train" / "assets" / "tiny" / "model", model)
    shutil.copy(ROOT / "tests" / "fixtures" / "chatml_tools.jinja", model / "chat_template.jinja")
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 2048  # room for the tool list in the prompt (rotary: any length works)
    (model / "config.json").write_text(json.dumps(config))
    (tmp_path / "tools.yaml").write_text(f"model: {{name_or_path: {model}}}\ndata: {{max_prompt_length: 1500, "
                                         "system_prompt: ''}\nrollout: {tools: [calculator]}\n")
    return tmp_path / "tools.yaml"


def test_an_eval_of_a_config_with_tools_lists_and_runs_them(tmp_path):
    _tool_config(tmp_path)

    def plan(*overrides: str):
        options = eval_command.EvalOptions(config_path=str(tmp_path / "tools.yaml"), limit=2, overrides=overrides)
        return eval_command.plan_target(None, options)

    with_tools, without = plan(), plan("rollout.tools=[]")
    assert with_tools.tools is not None and without.tools is None
    assert (with_tools.tools.max_calls, plan("rollout.max_tool_calls=2").tools.max_calls) == (4, 2)
    assert all('"name": "calculator"' in prompt.text for prompt in with_tools.prompts)
    assert not any("calculator" in prompt.text for prompt in without.prompts)
    assert (with_tools.result_name, without.result_name) == ("test_limit2_tools", "test_limit2")


def test_no_tools_evaluates_the_tool_config_without_them_and_is_in_the_help(monkeypatch):
    from typer.testing import CliRunner

    from dapo_train.cli import app

    config = str(ROOT / "configs" / "tiny-tools-cpu.yaml")
    asked = []
    monkeypatch.setattr(eval_command, "run_eval", lambda targets, options: asked.append(options))

    def plan(*flags: str):
        result = CliRunner().invoke(app, ["eval", "--config", config, "--limit", "2", *flags])
        assert result.exit_code == 0, result.output
        return eval_command.plan_target(None, asked[-1])

    with_tools, without = plan(), plan("--no-tools")
    assert with_tools.tools is not None and without.tools is None
    assert all('"name": "calculator"' in prompt.text for prompt in with_tools.prompts)
    assert not any("calculator" in prompt.text for prompt in without.prompts)
    assert (with_tools.result_name, without.result_name) == ("test_limit2_tools", "test_limit2")
    both = CliRunner().invoke(app, ["eval", "--config", config, "--no-tools", "rollout.tools=[calculator]"])
    assert both.exit_code != 0 and "--no-tools and a rollout.tools=... override both given" in str(both.exception)
    assert "--no-tools" in CliRunner().invoke(app, ["eval", "--help"]).output


METRICS = {"num_items": 2, "accuracy": 0.5, "accuracy_stderr": 0.35, "accuracy_ci95_low": 0.09,
           "accuracy_ci95_high": 0.91, "answer_accuracy": 0.5, "format_gap": 0.0,
           "format_rate": 1.0, "completion_length_mean": 40.0, "completion_length_max": 50,
           "truncated_rate": 0.0}


def test_the_eval_table_says_whether_tools_were_on(tmp_path, monkeypatch, capsys):
    """Issue 49, item 6: the table of `dapo-train eval` did not say whether the tools ran."""
    lines = format_table([("a", METRICS, ["calculator", "word_count"]), ("b", METRICS, [])]).splitlines()
    assert lines[0].split()[:3] == ["model", "tools", "items"]
    assert lines[2].split()[:3] == ["a", "calculator,", "word_count"] and lines[3].split()[:3] == ["b", "off", "2"]

    config = _tool_config(tmp_path)
    monkeypatch.setattr(eval_command, "evaluate_plan", lambda plan, options, device: (METRICS, [tmp_path / "x.json",
                                                                                              tmp_path / "x.jsonl"]))
    for overrides, shown in (((), "calculator"), (("rollout.tools=[]",), "off")):
        eval_command.run_eval([], eval_command.EvalOptions(config_path=str(config), limit=2, overrides=overrides))
        table = capsys.readouterr().out.splitlines()
        assert table[-3].split()[-12] == shown, table  # the row: model, tools, then the 11 numbers; the note


def test_the_evals_reward_models_score_the_policys_own_text():
    """Issue 47, item 13: as in training, a reward model reads what the policy wrote, not the tool turns (the
    eval scores its records, whose completion is the whole transcript)."""
    from dapo_train.evaluation.generate import add_model_scores
    from dapo_train.rewards.scoring import BoundReward, RewardSet
    from dapo_train.task.prompts import Prompt

    seen = []

    def judge(completions, answers, lengths=None, prompts=None):
        seen.extend(completions)
        return [1.0] * len(completions)

    reward = BoundReward("judge", "judge", 1.0, judge, load=lambda device: judge, loaded=True)
    record = {"completion": "<answer>\n<tool_call>{}</tool_call>\nuser\n391\nassistant\n</answer>", "gold": "391",
              "length": 12, "tool_turn_spans": [[34, 54]]}  # "\nuser\n391\nassistant\n"
    add_model_scores(RewardSet((reward,)), [Prompt("test:0", "q", "391", "p", (1,))], [record])
    assert seen == ["<answer>\n<tool_call>{}</tool_call></answer>"] and record["scores"] == {"judge": 1.0}



def test_a_checkpoint_is_compared_with_its_runs_step_0_only_when_it_decodes_as_the_run_did(tmp_path):
    """run_start: the run folder's step-0 records for a checkpoint evaluated as its run evaluated (greedy, no
    setting that changes what is evaluated), else the reason; nothing for a folder that is no run's checkpoint."""
    from types import SimpleNamespace

    from dapo_train.evaluation.settings import SettingChanges
    from dapo_train.run.eval_items import PERIODIC, write_items

    start = [{"uid": "test:0", "gold": "1", "correct": True, "answer_correct": True}]
    write_items(tmp_path / "run", PERIODIC, 0, start)
    (tmp_path / "run" / "checkpoint_3").mkdir()
    (tmp_path / "model").mkdir()

    def plan(folder, changes=SettingChanges()):
        return SimpleNamespace(target=SimpleNamespace(folder=folder), changes=changes)

    checkpoint = tmp_path / "run" / "checkpoint_3"
    assert eval_command.run_start(plan(checkpoint), eval_command.EvalOptions()) == (start, None)
    for changes, samples, why in (
        (SettingChanges(budget=64), 1, "a completion budget of 64 differs"),
        (SettingChanges({"rollout.tools": []}), 1, "rollout.tools=[] differs"),  # --no-tools
        (SettingChanges(engine="vllm"), 1, "the vllm engine differs"),
        (SettingChanges(), 4, "4 samples per item differs"),
        (SettingChanges({"data.max_prompt_length": 9}, 12), 1, "data.max_prompt_length=9, a completion budget of 12 "
                                                               "differ from how the run evaluated step 0"),
    ):
        records, reason = eval_command.run_start(plan(checkpoint, changes), eval_command.EvalOptions(samples=samples))
        assert records is None and why in reason, reason
    assert eval_command.run_start(plan(tmp_path / "model"), eval_command.EvalOptions()) == (None, None)
    assert eval_command.run_start(plan(None), eval_command.EvalOptions()) == (None, None)
