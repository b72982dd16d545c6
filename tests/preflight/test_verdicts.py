"""Preflight's verdicts can be believed: "ready" for every config `run` accepts (every shipped config
that runs on the tiny task here; the Qwen ones are tests/test_preflight.py's), a value preflight made
is never blamed on the user, the EOS check passes on any seed yet fails when an EOS id never ends a
completion, and the report's last rows say what ran and what did not."""

import functools
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, GenerationConfig, Qwen2Config

from dapo_train.config.load import load_config
from dapo_train.errors import UserError
from dapo_train.preflight import command, rehearsal
from dapo_train.preflight.command import preflight
from dapo_train.preflight.report import Report
from dapo_train.run.outputs import holds_own
from dapo_train.task.locations import TINY_MODEL_DIR

ROOT = Path(__file__).resolve().parents[2]
TINY_CONFIGS = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "configs").rglob("*.yaml")
                      if not path.name.startswith("qwen") and path.parent.name != "accelerate")


@pytest.fixture
def threads():
    """preflight sets torch's threads as a run would (1 for the rehearsal on a CPU): put them back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _rows(report: Report) -> dict[str, str]:
    return {label: " ".join(text.split()) for label, text in report.rows}


@functools.cache
def _shipped(path: str) -> dict[str, str]:
    """The report of preflight on a shipped config, run once for all the tests that read it."""
    threads = torch.get_num_threads()
    try:
        return _rows(preflight(load_config(str(ROOT / path), []), path))
    finally:
        torch.set_num_threads(threads)


def test_the_shipped_configs_are_all_listed():
    # accelerate/*.yaml are `accelerate launch` files, not dapo-train configs; qwen*.yaml: test_preflight.py
    assert len(TINY_CONFIGS) == 17 and "configs/ablation/1-grpo.yaml" in TINY_CONFIGS


def test_the_demo_with_a_calculator_rehearses_a_call_and_says_so():
    rows = _shipped("configs/tiny-tools-cpu.yaml")
    assert rows["tool call"].startswith("calculator called with {'expression': '17 * 23'}"), rows["tool call"]
    assert "= the whole conversation as the chat template renders it, tokenized at once" in rows["tool call"]
    assert "DecodeLoopEngine" in rows["rollout"] and "a tool call through" in rows["ready"], rows


@pytest.mark.parametrize("path", TINY_CONFIGS)
def test_every_shipped_config_is_ready(path):
    rows = _shipped(path)
    assert list(rows)[-1] == "ready" and "with a non-zero gradient" in rows["train"], rows


def test_a_reward_that_cannot_vary_still_trains_and_is_still_run():
    """1-grpo's only reward is accuracy, -1 on every completion of a random model, and no dynamic
    sampling: every advantage was 0 and preflight said "not ready". Its reward still runs on the
    rollout's completions; the rehearsal's own reward (weight 0.01) gives the gradient."""
    rows = _shipped("configs/ablation/1-grpo.yaml")
    assert "accuracy mean -1.000 sd 0.000" in rows["rollout"] and "spread mean" in rows["rollout"]
    assert "rewards 1 rewards -> + spread (weight 0.01)" in rows["rehearsal"]
    assert "3 steps (3 with a non-zero gradient" in rows["train"]


def test_a_large_step_with_a_large_micro_batch_is_shrunk_consistently(tmp_path, threads):
    """16 prompts x G=8 with micro-batch 32 is valid; the shrink to 2 prompts made 16 sequences per step
    and kept 32, which the config check blamed on train.micro_batch_size."""
    cfg = load_config(None, ["train.prompts_per_step=16", "rollout.group_size=8", "train.micro_batch_size=32"])
    small, changes = rehearsal.shrink(cfg, tmp_path / "model", tmp_path / "run", cuda=False)
    assert (small.train.prompts_per_step, small.train.micro_batch_size) == (2, 16)
    assert ("train.micro_batch_size", 32, 16) in {(c.key, c.old, c.new) for c in changes}
    rows = _rows(preflight(cfg, "large step"))
    assert list(rows)[-1] == "ready", rows


def test_a_value_preflight_made_is_not_blamed_on_the_user(tmp_path, monkeypatch):
    monkeypatch.setattr(rehearsal, "EVAL_ITEMS", 0)  # the shrink now makes eval.batch_size 0
    with pytest.raises(UserError) as caught:
        rehearsal.shrink(load_config(None, []), tmp_path / "model", tmp_path / "run", cuda=False)
    message = str(caught.value)
    assert message.startswith("preflight's shrunk config is invalid (a preflight bug, not your config")
    assert "eval.batch_size 128 -> 0" in message and "eval.batch_size" in message.rpartition("):")[2]


def test_a_config_without_evals_or_eval_split_rehearses_eval_on_the_train_split(threads):
    cfg = load_config(None, ["eval.every_steps=0", "eval.final_full=false", "data.eval_split=validation"])
    rows = _rows(preflight(cfg, "no evals"))
    assert list(rows)[-1] == "ready", rows
    assert "data.eval_split validation -> train" in rows["rehearsal"]
    assert "eval.every_steps 0 -> 2 (" not in rows["rehearsal"]  # reasons are not printed, values are
    assert "3 evals" in rows["train"]


def test_the_report_says_what_ran_and_what_did_not():
    """On a CPU the `auto` settings a card resolves differently are rehearsed as on the card: the bf16
    rollout copy, so the old log-probs are recomputed and `tis` weighs the gap, bf16 autocast and
    gradient checkpointing, the static-cache engine in the rollout check; compilation and CUDA kernels
    are named as not run."""
    if torch.cuda.is_available():
        pytest.skip("the CPU's rehearsal")
    rows = _shipped("configs/tiny-cpu.yaml")
    ran = rows["ready"]
    assert ran.startswith("ran: rollout with the decode loop (the static-cache engine, not compiled, in the rollout "
                          "check) from a bfloat16 copy of the weights, 2 configured rewards and the rehearsal's own "
                          "on its completions, old log-probs recomputed for "), ran
    assert "rollout correction tis over " in ran and "bf16 autocast (the CPU's), gradient checkpointing" in ran
    assert ran.endswith("eval, checkpoint, resume, export"), ran
    assert rows["rollout"].startswith("StaticCacheEngine: "), rows["rollout"]
    assert rows["not run"] == ("the real weights (a random 2-layer model of width 32 stands in), training steps on the "
                               "static-cache engine (slow on a CPU: the rollout check ran it), compilation "
                               "(torch.compile, CUDA graphs), CUDA kernels (attention, matmuls on the card), bf16 "
                               "autocast on CUDA")
    assert "rollout.compile" not in rows.get("warnings", "")  # preflight set it: no warning to the user
    assert "26 tensors equal to the trained ones" in rows["export"]


def _tiny_rehearsal(tmp_path: Path, eos: list[int]):
    """(the tiny task's config with the tiny tokenizer, a rehearsal model stopping at `eos`, prompts)."""
    from dapo_train.task.prompts import load_prompts

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    cfg, _ = rehearsal.shrink(load_config(None, []), tmp_path / "model", tmp_path / "run", cuda=True)
    config = Qwen2Config(vocab_size=600, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    r = cfg.rollout
    sampling = command.SamplingSettings(r.max_new_tokens, True, r.temperature, r.top_p, r.top_k)
    model = rehearsal.build_model(config, GenerationConfig(eos_token_id=eos), tokenizer, tmp_path / "model", sampling)
    prompts = load_prompts(cfg.data, tokenizer, cfg.data.train_split)[0][:command.ROLLOUT_PROMPTS]
    return cfg, model, tokenizer, prompts


def test_the_eos_check_fails_when_an_eos_id_never_ends_a_completion(tmp_path):
    cfg, model, tokenizer, prompts = _tiny_rehearsal(tmp_path, [552, 550])
    with torch.no_grad():
        model.get_output_embeddings().weight[550] = 0.0
        model.get_output_embeddings().weight[550, 0] = -100.0  # dimension 0 is a constant c > 0: never drawn
    with pytest.raises(UserError, match=r"no completion of 8 x 32 ended with <\|endoftext\|>"):
        command._report_rollout(cfg, model, tokenizer, prompts, Report())


def test_a_reward_model_is_a_random_stand_in_without_a_card(tmp_path, threads, monkeypatch):
    """The verifier config loaded the configured reward model in full three times (rollout check, train,
    resume). Without a card its weights are never loaded: a random model of its architecture and
    vocabulary stands in, and the report says so."""
    from transformers import AutoModelForSequenceClassification

    from dapo_train.task.locations import resolve_model_path

    if torch.cuda.is_available():
        pytest.skip("the CPU's rehearsal")
    loads: list[str] = []
    real = AutoModelForSequenceClassification.from_pretrained.__func__

    def counted(cls, path, *args, **kwargs):
        loads.append(str(path))
        return real(cls, path, *args, **kwargs)

    monkeypatch.setattr(AutoModelForSequenceClassification, "from_pretrained", classmethod(counted))
    cfg = load_config(str(ROOT / "configs/reward_models/verifier.yaml"), [])
    report = preflight(cfg, "verifier", keep=str(tmp_path / "kept"))
    rows = _rows(report)
    assert list(rows)[-1] == "ready", rows
    configured = resolve_model_path("builtin:tiny-verifier")
    stand_in = str(rehearsal.stand_in_folder(tmp_path / "kept", 0))
    assert configured not in loads and loads and set(loads) == {stand_in}, loads
    assert "rewards.0.args.path builtin:tiny-verifier -> a stand-in" in rows["rehearsal"]
    assert "reward_model mean" in rows["rollout"]
    from transformers import AutoConfig

    original, copy = AutoConfig.from_pretrained(configured), AutoConfig.from_pretrained(stand_in)
    assert (copy.architectures, copy.vocab_size, copy.num_labels) == (original.architectures, original.vocab_size, 1)
    assert copy.num_hidden_layers == rehearsal.LAYERS
    # Issue 47, item 2: the kept folder holds nothing preflight did not write, so the next --keep replaces it.
    assert holds_own(tmp_path / "kept", command.kept_kind(cfg), option="--keep", replace=True)
    assert {path.name for path in (tmp_path / "kept").iterdir()} == {
        ".dapo-train-preflight", "preflight.log", "model", "reward_model_0", "run", "export"}


def test_with_a_card_the_rollout_check_scores_with_the_real_reward_model(tmp_path):
    """On CUDA the rollout check loads the configured reward model (once); training uses the stand-in."""
    cfg = load_config(str(ROOT / "configs/reward_models/both.yaml"), [])
    small, _ = rehearsal.shrink(cfg, tmp_path / "model", tmp_path / "run", cuda=True)
    checked = command._real_reward_models(small, cfg)
    models = [i for i, spec in enumerate(cfg.rewards) if spec.name == "reward_model"]
    assert models
    for i in models:
        assert small.rewards[i].args["path"] == str(rehearsal.stand_in_folder(tmp_path, i))
        assert checked.rewards[i].args["path"] == cfg.rewards[i].args["path"]
        assert checked.rewards[i].args["tokenizer_path"] == cfg.rewards[i].args.get("tokenizer_path")
    assert [s.name for s in checked.rewards] == [s.name for s in small.rewards]  # the rehearsal's own reward kept


def test_greedy_decoding_of_the_rehearsal_model_writes_numbers(tmp_path):
    """The eval is greedy: a random model's argmax was an EOS or one token repeated (16 newlines), so the
    answer check never saw a number. The digits' weight makes greedy text digits."""
    from dapo_train.task.answers import extract_answer

    _, model, tokenizer, prompts = _tiny_rehearsal(tmp_path, [552, 550])
    for prompt in prompts:
        ids = torch.tensor(prompt.input_ids)[None]
        text = tokenizer.decode(model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:])
        assert sum(ch.isdigit() for ch in text) >= 8 and extract_answer(text, strict=False) is not None, text


def test_an_export_missing_a_tensor_or_with_a_changed_one_fails_the_check(tmp_path):
    """from_pretrained loads an export that lacks tensors (they start random): the check compares every
    tensor with the checkpoint's own."""
    import shutil

    from safetensors.torch import load_file, save_file

    from dapo_train.preflight.export_check import check_export

    _, model, _, _ = _tiny_rehearsal(tmp_path, [552, 550])  # saved in tmp_path/model: the "checkpoint"
    checkpoint = tmp_path / "model"
    trained = load_file(str(checkpoint / "model.safetensors"))
    assert check_export(checkpoint, checkpoint) == len(trained)
    for name, broken in (("missing", dict(list(trained.items())[1:])),
                         ("changed", {**trained, "model.norm.weight": trained["model.norm.weight"] + 1e-3})):
        export = tmp_path / name
        shutil.copytree(checkpoint, export)
        save_file(broken, str(export / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(UserError) as caught:
            check_export(checkpoint, export)
        first = next(iter(trained))
        expected = (f"the export lacks 1 of the {len(trained)} trained tensors: {first}" if name == "missing" else
                    "the export's model.norm.weight differs from the trained tensor")
        assert str(caught.value).startswith(expected), str(caught.value)


def test_the_check_takes_adapters_on_the_embedding_and_the_tied_head(tmp_path):
    """Adapters on the tiny model's embedding and on its head, which it ties to the embedding: peft keeps the
    embedding's in lora_embedding_A/B, and the head has no weight of its own in the base's files (peft saves it
    beside the adapter). The export (untied) passes; peft's merge_and_unload, which keeps the one tied weight
    for both, lacks the trained head."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from dapo_train.config.schema import LoraConfig
    from dapo_train.model import lora
    from dapo_train.preflight.export_check import check_export
    from dapo_train.run.export import export_checkpoint

    settings = LoraConfig(r=4, alpha=8, target_modules=["embed_tokens", "lm_head", "q_proj"])
    adapted = lora.apply_lora(AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR), settings, "tiny")
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if ".lora_" in name:  # peft starts one matrix of each pair at 0: a merge would change nothing
                parameter.copy_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
    checkpoint = tmp_path / "checkpoint"
    adapted.save_pretrained(checkpoint)
    AutoTokenizer.from_pretrained(TINY_MODEL_DIR).save_pretrained(checkpoint)
    export = export_checkpoint(str(checkpoint), str(tmp_path / "export"), merge=True)
    tied_tensors = len(load_file(TINY_MODEL_DIR / "model.safetensors"))
    assert check_export(checkpoint, export) == tied_tensors + 1  # and lm_head.weight
    adapted.merge_and_unload().save_pretrained(tmp_path / "peft_merged")
    with pytest.raises(UserError, match=f"the export lacks 1 of the {tied_tensors + 1} trained tensors: lm_head"):
        check_export(checkpoint, tmp_path / "peft_merged")
    saved = load_file(checkpoint / "adapter_model.safetensors")  # saved without the base weights beside it
    save_file({k: v for k, v in saved.items() if ".base_layer." not in k}, checkpoint / "adapter_model.safetensors")
    with pytest.raises(UserError, match="the adapter on lm_head.weight has no base weight in its base model's files"):
        check_export(checkpoint, export)
