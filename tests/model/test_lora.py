"""LoRA through peft: only adapters train, the reference is the base with adapters disabled,
adapter checkpoints resume exactly and evaluate directly, a merged export needs no peft, and
bad settings fail in one line before training."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file

from dapo_train.config.load import load_config, read_yaml
from dapo_train.config.schema import ModelConfig
from dapo_train.errors import ConfigError, UserError
from dapo_train.evaluation.command import EvalOptions, run_eval
from dapo_train.model import lora
from dapo_train.model.layout import collate
from dapo_train.model.loading import load_model
from dapo_train.run.export import export_checkpoint
from dapo_train.run.logs import read_metrics
from dapo_train.task.locations import TINY_MODEL_DIR
from dapo_train.train import loop
from dapo_train.train.session import setup
from dapo_train.train.update.batching import MiniBatch, collate_micro_batch, split_micro_batches
from dapo_train.train.update.passes import Learner, accumulate_gradients

from conftest import EOS2_ID, make_random_model

SMALL = [
    "rollout.group_size=4", "rollout.max_new_tokens=48", "train.prompts_per_step=2", "train.micro_batch_size=4",
    "train.updates_per_step=2", "train.deterministic=true", "train.num_threads=1", "logging.progress_bar=false",
    "eval.print_samples=0", "model.lora.r=4", "train.learning_rate=1e-3",
    "eval.final_full=false",  # the end-of-run eval on all 500 items is tested in tests/run/test_eval_items.py
]
EVAL_ITEMS = 16


def _cfg(out, *extra):
    return load_config(None, [*SMALL, "eval.every_steps=0", f"output_dir={out}", *extra])


def _state(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


# --------------------------------------------------------------------------------------------
# Every LoRA knob moves the weights; bad target modules fail naming what the model has.


def _one_lora_step(**settings) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(logits before, logits after) one AdamW step of LoRA(settings) on a fixed random model and
    batch, and that batch's model inputs."""
    from dapo_train.config.schema import LoraConfig
    from dapo_train.train.update.batching import TrainSample

    torch.manual_seed(0)
    model = lora.apply_lora(make_random_model(), LoraConfig(**{"r": 4, **settings}), "random")
    g = torch.Generator().manual_seed(1)
    samples = [
        TrainSample(torch.randint(3, 60, (5,), generator=g), torch.randint(3, 60, (7,), generator=g),
                    advantage=1.0 if i % 2 else -1.0, in_loss=True)
        for i in range(6)
    ]
    cfg = load_config(None, ["train.prompts_per_step=2", "rollout.group_size=3", "train.micro_batch_size=6"])
    optimizer = torch.optim.AdamW(lora_parameters(model), lr=1e-2)
    learner = Learner.build(cfg, model, optimizer, Accelerator(cpu=True), EOS2_ID)
    [micro] = [collate_micro_batch(m, EOS2_ID) for m in split_micro_batches(samples, 6)]

    inputs = {"input_ids": micro.batch.input_ids, "attention_mask": micro.batch.attention_mask}

    def logits() -> torch.Tensor:
        model.eval()
        with torch.no_grad():
            return model(**inputs).logits

    before = logits()
    model.train()
    accumulate_gradients(learner, MiniBatch([micro], float(micro.batch.completion_mask.sum()), 1, []))
    optimizer.step()
    return before, logits(), inputs


def lora_parameters(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def test_each_lora_setting_changes_the_trained_model():
    """r, alpha, dropout and target_modules each change what one identical update produces; the
    untrained adapters (B = 0) compute exactly what the base model does."""
    before, first, inputs = _one_lora_step()
    with torch.no_grad():
        torch.testing.assert_close(before, make_random_model()(**inputs).logits, atol=0, rtol=0)
    assert not torch.allclose(first, before, atol=1e-4)  # the step moved the model
    for settings in ({"r": 8}, {"alpha": 64.0}, {"dropout": 0.5}, {"target_modules": ["q_proj", "v_proj"]}):
        _, after, _ = _one_lora_step(**settings)
        assert not torch.allclose(after, first, atol=1e-6), settings


def test_target_modules_that_match_nothing_name_the_models_layers():
    with pytest.raises(ConfigError) as info:
        lora.apply_lora(make_random_model(), load_config(None, ["model.lora.r=4", "model.lora.target_modules="
                                                                "[q_proj, q_projj]"]).model.lora, "random")
    message = str(info.value)
    assert info.value.key == "model.lora.target_modules"
    assert "'model.lora.target_modules': q_projj matches no linear or embedding layer of random;" in message
    assert "its layers are named: down_proj, embed_tokens, gate_proj, k_proj, lm_head, o_proj, q_proj" in message


def test_lora_settings_on_a_model_without_those_layers_fail_before_training():
    """GPT-2 names its projections c_attn / c_proj / c_fc: the default (Qwen / Llama) names match nothing."""
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=32))
    with pytest.raises(ConfigError, match=r"q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj match no "
                                          r"linear or embedding layer of gpt2; its layers are named: c_attn, c_fc"):
        lora.apply_lora(gpt2, load_config(None, ["model.lora.r=4"]).model.lora, "gpt2")
    wrapped = lora.apply_lora(gpt2, load_config(None, ["model.lora.r=4", "model.lora.target_modules=[c_attn]"])
                              .model.lora, "gpt2")
    assert {n for n, p in wrapped.named_parameters() if p.requires_grad} == {
        "base_model.model.transformer.h.0.attn.c_attn.lora_A.default.weight",
        "base_model.model.transformer.h.0.attn.c_attn.lora_B.default.weight",
    }


def test_a_typo_in_target_modules_is_one_line_exit_2_and_no_run_folder(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "dapo_train", "run", "model.lora.r=4", "model.lora.target_modules=[q_proj, vproj]",
         "output_dir=run"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr and sum(line.startswith("error:") for line in lines) == 1
    assert lines[-1].startswith("error: config key 'model.lora.target_modules': vproj matches no linear"), lines[-1]
    assert not (tmp_path / "run").exists()


def test_without_peft_a_lora_run_fails_in_one_line_before_the_run_folder(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` raises ImportError
    with pytest.raises(UserError, match=r"model.lora.r=4 needs the peft package, which is not installed: "
                                        r"pip install 'dapo-train\[lora\]'"):
        loop.train(_cfg(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_an_adapter_on_a_tied_embedding_says_what_peft_warns_of_in_its_own_words(tmp_path, caplog):
    """Issue 59 item 16: an adapter on embed_tokens of a model that ties it to its head (the tiny model) printed
    peft's two UserWarnings (weight tying "can lead to complications"; save_embedding_layers set to True) with
    no word on what they mean here. One line says it: the adapted embedding and head differ, which a vLLM copy
    and a merged export keep, and each checkpoint holds the embedding's whole weight (553 x 128 float32 numbers
    of the tiny model's embedding, its config.json: 283,136 bytes)."""
    import logging
    import warnings

    from dapo_train.config.schema import LoraConfig

    settings = LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"])
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO):
        wrapped = lora.apply_lora(load_model(ModelConfig(), torch.device("cpu")), settings, "builtin:tiny")
        wrapped.save_pretrained(tmp_path / "adapter")
        lora.attach_adapter(load_model(ModelConfig(), torch.device("cpu")), str(tmp_path / "adapter"),
                            torch.device("cpu"))
    peft_said = [str(w.message)[:80] for w in caught if "embedding" in str(w.message) or "tie" in str(w.message)]
    assert peft_said == []
    assert ("LoRA on embed_tokens of builtin:tiny, which ties its input embedding and LM head into one weight: the "
            "adapted embedding and head differ (each adds its own adapter's change), which a vLLM copy keeps and "
            "`dapo-train export --merge` writes untied; each checkpoint also holds the whole embedding weight "
            "(0.3 MB)") in caplog.text
    assert caplog.text.count("ties its input embedding and LM head") == 1  # said once, not at each load
    with warnings.catch_warnings(record=True) as caught:
        lora.apply_lora(load_model(ModelConfig(), torch.device("cpu")), LoraConfig(r=4), "builtin:tiny")
    assert not [w for w in caught if "tie" in str(w.message)]  # the default targets: nothing tied, nothing to say


def test_lora_settings_with_rank_0_say_they_cannot_act(caplog):
    lora.check_lora_start(load_config(None, ["model.lora.alpha=32", "model.lora.target_modules=[q_proj]"]))
    assert "model.lora.alpha, model.lora.target_modules set but model.lora.r=0 (LoRA off): they have no effect" in (
        caplog.text
    )
    caplog.clear()
    lora.check_lora_start(load_config(None, []))
    assert caplog.text == ""


# --------------------------------------------------------------------------------------------
# Training: only the adapters move; the reference policy is the base with adapters disabled.


@pytest.fixture(scope="module")
def kl_run(tmp_path_factory):
    """Two LoRA steps with dapo.beta > 0 (the k3 term to the reference), in process."""
    cfg = _cfg(tmp_path_factory.mktemp("kl") / "run", "dapo.beta=0.1")
    run = setup(cfg, tmp_path_factory.mktemp("kl_dir"), None)
    before = _state(run.model)
    metrics = [loop.train_step(run) for _ in range(2)]
    return run, before, metrics


def test_lora_training_changes_only_adapter_weights(kl_run):
    run, before, metrics = kl_run
    after = _state(run.model)
    adapters = {name for name in after if "lora_" in name}
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    assert sum(m.get("optimizer_steps", 0) for m in metrics) > 0  # there were updates
    changed = {name for name in after if not torch.equal(after[name], before[name])}
    assert changed and changed <= adapters  # every base weight is bit-identical
    assert any(".lora_B." in name for name in changed)  # B starts at 0: the adapter now changes the output
    optimized = {id(p) for group in run.learner.optimizer.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for name, p in run.model.named_parameters() if name in adapters}


def test_the_reference_policy_is_the_base_model_with_adapters_disabled(kl_run):
    """No second copy: the reference is the policy object itself, and scoring it inside the
    reference scope gives exactly the log-probs of a freshly loaded base model."""
    run, _, metrics = kl_run
    learner = run.learner
    assert learner.reference.model is run.model
    assert any(m.get("kl", 0) > 0 for m in metrics)  # the k3 term saw the policy differ from the reference
    batch = collate([torch.tensor([3, 4, 5, 6])] * 2, [torch.tensor([7, 8, 9]), torch.tensor([10, 11, 12])], 550)
    base = load_model(ModelConfig(), torch.device("cpu"))
    with torch.no_grad():
        with learner.reference.scope():
            reference, _ = learner.scorer(learner.reference.model, batch)
        policy, _ = learner.scorer(run.model, batch)
        expected, _ = learner.scorer(base, batch)
    torch.testing.assert_close(reference, expected, atol=1e-6, rtol=0)
    assert not torch.allclose(policy, expected, atol=1e-4)  # the adapters did move the policy


# --------------------------------------------------------------------------------------------
# Checkpoints: the adapter, exact resume, eval and export.


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """Two LoRA steps, a checkpoint after each, greedy eval on EVAL_ITEMS items at steps 0 and 2."""
    out = tmp_path_factory.mktemp("lora") / "run"
    return loop.train(load_config(None, [
        *SMALL, "train.max_steps=2", "checkpoint.every_steps=1", "eval.every_steps=2", f"eval.num_items={EVAL_ITEMS}",
        f"output_dir={out}",
    ]))


def test_a_lora_checkpoint_holds_the_adapter_and_resumes_exactly(lora_run, tmp_path):
    checkpoint = lora_run / "checkpoint_2"
    names = {p.name for p in checkpoint.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "trainer_state.pt", "config.yaml"} <= names
    assert "model.safetensors" not in names
    adapter = load_file(checkpoint / "adapter_model.safetensors")
    assert adapter and all("lora_A" in key or "lora_B" in key for key in adapter)
    base_bytes = (TINY_MODEL_DIR / "model.safetensors").stat().st_size
    assert (checkpoint / "adapter_model.safetensors").stat().st_size < base_bytes / 10

    split = tmp_path / "split"
    shutil.copytree(lora_run, split, ignore=shutil.ignore_patterns("checkpoint_2"))
    for config in split.rglob("config.yaml"):
        config.write_text(config.read_text().replace(str(lora_run), str(split)))
    cfg = load_config(None, [], base=read_yaml(split / "config.yaml"))
    loop.train(cfg, resume=split / "checkpoint_1")
    resumed = load_file(split / "checkpoint_2" / "adapter_model.safetensors")
    for key in adapter:
        torch.testing.assert_close(resumed[key], adapter[key], atol=1e-6, rtol=0)
    for key in ("loss", "reward_mean", "kl", "completion_length_mean"):
        assert [row.get(key) for row in read_metrics(split)] == pytest.approx(
            [row.get(key) for row in read_metrics(lora_run)], abs=1e-6), key


def test_resume_refuses_to_change_the_adapters_shape(lora_run):
    for change, needle in (("model.lora.r=8", "model.lora.r is 4 in the checkpoint and 8 now"),
                           ("model.lora.target_modules=[q_proj]", "model.lora.target_modules is"),
                           ("model.lora.r=0", "holds a LoRA adapter, but model.lora.r=0")):
        changed = load_config(None, [change], base=read_yaml(lora_run / "config.yaml"))
        with pytest.raises(UserError, match=needle):
            lora.check_resume(changed, lora_run / "checkpoint_2")
    lora.check_resume(load_config(None, ["model.lora.alpha=8"], base=read_yaml(lora_run / "config.yaml")),
                      lora_run / "checkpoint_2")  # alpha and dropout may change: they only scale the same shapes


@pytest.fixture(scope="module")
def adapter_eval(lora_run):
    """`dapo-train eval` on the adapter checkpoint itself: (metrics, its completions)."""
    checkpoint = lora_run / "checkpoint_2"
    [metrics] = run_eval([str(checkpoint)], EvalOptions(limit=EVAL_ITEMS))
    records = [json.loads(line) for line in (checkpoint / f"completions_test_limit{EVAL_ITEMS}.jsonl").open()]
    return metrics, records


def test_eval_takes_an_adapter_checkpoint_and_agrees_with_the_runs_own_eval(lora_run, adapter_eval):
    metrics, records = adapter_eval
    logged = [row["accuracy"] for row in read_metrics(lora_run) if "accuracy" in row]
    assert len(records) == EVAL_ITEMS and len(logged) == 2
    assert metrics["accuracy"] == pytest.approx(logged[-1])  # the same items, greedy: the same answers


def test_a_merged_export_loads_without_peft_and_gives_the_same_greedy_completions(lora_run, adapter_eval, tmp_path):
    out = export_checkpoint(str(lora_run / "checkpoint_2"), str(tmp_path / "merged"), merge=True)
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }
    assert not any("adapter" in p.name for p in out.iterdir())
    merged, base = load_file(out / "model.safetensors"), load_file(TINY_MODEL_DIR / "model.safetensors")
    assert merged.keys() == base.keys() and any(not torch.equal(merged[k], base[k]) for k in base)  # B A folded in
    script = (
        "import sys\n"
        "sys.modules['peft'] = None  # as if peft were not installed\n"
        "from dapo_train.cli import main\n"
        f"sys.argv = ['dapo-train', 'eval', {str(out)!r}, '--config', {str(lora_run / 'config.yaml')!r}, "
        f"'--limit', '{EVAL_ITEMS}']\n"
        "main()\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    merged = [json.loads(line) for line in (out / f"completions_test_limit{EVAL_ITEMS}.jsonl").open()]
    _, adapter_records = adapter_eval
    assert [r["completion"] for r in merged] == [r["completion"] for r in adapter_records]


def test_an_adapter_export_and_the_dtype_option(lora_run, tmp_path):
    """Without --merge the adapter alone, which peft puts back on the base; --dtype sets the
    weights' dtype; a full model folder exports as a plain folder and --merge says it cannot act."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = export_checkpoint(str(lora_run / "checkpoint_2"), str(tmp_path / "adapter"))
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR), str(out))
    trained = load_file(lora_run / "checkpoint_2" / "adapter_model.safetensors")
    state = {k: v for k, v in loaded.state_dict().items() if "lora_" in k}
    assert len(state) == len(trained) and all(
        torch.equal(state[k.replace(".weight", ".default.weight")], v) for k, v in trained.items()
    )
    half = export_checkpoint(str(lora_run / "checkpoint_2"), str(tmp_path / "bf16"), merge=True, dtype="bfloat16")
    assert {t.dtype for t in load_file(half / "model.safetensors").values()} == {torch.bfloat16}
    with pytest.raises(UserError, match="already exists and is not empty"):
        export_checkpoint(str(lora_run / "checkpoint_2"), str(half), merge=True)


def test_without_peft_an_adapter_checkpoint_says_what_to_install(lora_run, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)
    checkpoint = str(lora_run / "checkpoint_2")
    with pytest.raises(UserError, match=r"is a LoRA adapter checkpoint; evaluating it needs the peft package, which "
                                        r"is not installed: pip install 'dapo-train\[lora\]'"):
        run_eval([checkpoint], EvalOptions(limit=2))
    with pytest.raises(UserError, match="exporting it needs the peft package"):
        export_checkpoint(checkpoint, str(tmp_path / "merged"), merge=True)
    assert not (tmp_path / "merged").exists()


def test_a_new_run_can_start_from_an_adapter_checkpoint(lora_run):
    """model.name_or_path may name a LoRA checkpoint: the run starts from its merged weights,
    W + alpha / r * B A (alpha 16, r 4 here)."""
    from dapo_train.model.loading import load_policy

    checkpoint = lora_run / "checkpoint_2"
    model = load_policy(load_config(None, [f"model.name_or_path={checkpoint}"]), torch.device("cpu"))
    assert not lora.is_peft_model(model) and all(p.requires_grad for p in model.parameters())
    base, adapter = load_file(TINY_MODEL_DIR / "model.safetensors"), load_file(checkpoint / "adapter_model.safetensors")
    name = "model.layers.0.self_attn.q_proj"
    a, b = adapter[f"base_model.model.{name}.lora_A.weight"], adapter[f"base_model.model.{name}.lora_B.weight"]
    assert b.abs().max() > 0
    expected = base[f"{name}.weight"] + 16.0 / 4 * b @ a
    torch.testing.assert_close(model.state_dict()[f"{name}.weight"], expected, atol=1e-6, rtol=0)


def test_a_full_checkpoint_exports_as_a_plain_folder(tmp_path, caplog):
    full = tmp_path / "checkpoint_0"
    shutil.copytree(TINY_MODEL_DIR, full)
    out = export_checkpoint(str(full), str(tmp_path / "plain"), merge=True)
    assert "holds full weights, not a LoRA adapter; there is nothing to merge" in caplog.text
    written, original = load_file(out / "model.safetensors"), load_file(full / "model.safetensors")
    assert written.keys() == original.keys() and all(torch.equal(written[k], original[k]) for k in original)


def test_a_short_lora_demo_run_learns(tmp_path):
    """The tiny demo's settings with rank-8 adapters at lr 1e-3 (full fine-tuning: 1e-4) for 6 steps:
    greedy accuracy on the 100 fixed eval items must rise by at least 5 points from the warm start
    (measured: 0.16 -> 0.30; the 40-step LoRA demo is measured in docs/lora.md)."""
    cfg = load_config(None, [f"output_dir={tmp_path / 'demo'}", "train.max_steps=6", "eval.every_steps=6",
                             "logging.progress_bar=false", "eval.print_samples=0", "model.lora.r=8",
                             "train.learning_rate=1e-3", "eval.final_full=false"])
    run_dir = loop.train(cfg)
    rows = [line.split(",") for line in (run_dir / "accuracy_losses.txt").read_text().split()]
    (step0, before), (step6, after) = [(int(s), float(a)) for s, a in rows]
    assert (step0, step6) == (0, 6)
    assert after >= before + 0.05, (before, after)
    assert not (run_dir / "checkpoint_6" / "model.safetensors").exists()  # it trained adapters, not the model


def test_resume_refuses_another_model_unless_the_saved_folder_is_gone(tmp_path):
    """Full weights: the checkpoint's weights are its model's, trained; naming another model on resume
    would record a model the run never trained. A local folder that is gone may be named anew (moved)."""
    from dapo_train.config.load import save_config

    checkpoint = tmp_path / "checkpoint_2"
    checkpoint.mkdir()
    save_config(load_config(None, []), checkpoint / "config.yaml")  # model.name_or_path: builtin:tiny
    with pytest.raises(UserError, match="model.name_or_path is 'builtin:tiny' in the checkpoint and "
                                        "'builtin:tiny-long' now; its weights were trained from 'builtin:tiny'"):
        lora.check_resume(load_config(None, ["model.name_or_path=builtin:tiny-long"]), checkpoint)
    lora.check_resume(load_config(None, ["train.max_steps=80"]), checkpoint)  # other keys may change
    save_config(load_config(None, [f"model.name_or_path={tmp_path / 'moved-away'}"]), checkpoint / "config.yaml")
    lora.check_resume(load_config(None, ["model.name_or_path=builtin:tiny"]), checkpoint)


def test_an_adapter_checkpoint_with_a_relative_base_evaluates_from_another_folder(tmp_path, monkeypatch):
    """Issue 59, item 15: a LoRA run started with model.name_or_path=./base records that path as given, relative to
    the folder the run started in; `eval` of its checkpoint from any other folder failed, naming model.name_or_path,
    a key the eval's user never set. The run folder says where it started (its output_dir, outputs/run, is this
    checkpoint's parent), so the base is read from there."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer

    from dapo_train.config.load import save_config

    work = tmp_path / "work"
    shutil.copytree(TINY_MODEL_DIR, work / "base")
    checkpoint = work / "outputs" / "run" / "checkpoint_2"
    base = load_model(ModelConfig(name_or_path=str(work / "base")), torch.device("cpu"))
    get_peft_model(base, peft_config=LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(checkpoint)
    AutoTokenizer.from_pretrained(work / "base").save_pretrained(checkpoint)
    save_config(load_config(None, ["model.name_or_path=./base", "model.lora.r=2", "output_dir=outputs/run"]),
                checkpoint / "config.yaml")
    monkeypatch.chdir(tmp_path)  # not the folder the run started in
    assert lora.adapter_base(checkpoint) == str(work / "base")
    [metrics] = run_eval([str(checkpoint)], EvalOptions(limit=2))
    assert metrics["num_items"] == 2, metrics


def test_a_relative_base_found_nowhere_names_the_checkpoint_that_records_it(tmp_path, monkeypatch):
    """Where neither the run's start folder nor the current one holds the base (the run folder was moved), the one
    line names the checkpoint's config.yaml and the path it records, not a key of the eval's own."""
    from dapo_train.config.load import save_config

    checkpoint = tmp_path / "moved" / "checkpoint_2"
    checkpoint.mkdir(parents=True)
    (checkpoint / "adapter_config.json").write_text('{"base_model_name_or_path": "./base"}')
    save_config(load_config(None, ["model.name_or_path=./base", "model.lora.r=2", "output_dir=outputs/run"]),
                checkpoint / "config.yaml")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as caught:
        lora.adapter_base(checkpoint)
    assert f"{checkpoint / 'config.yaml'} records the base model as './base'" in str(caught.value), caught.value
