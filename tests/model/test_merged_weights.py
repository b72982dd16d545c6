"""What a vLLM engine loads after each update (model/lora.merged_weights): the plain model's weights under its
own names, a LoRA model's adapters folded in, so that a copy loaded with them computes the adapted model's
logits: adapters on linear layers as peft's merge_and_unload folds them, and adapters on the input embedding or
on an LM head tied to it each on its own weight (merge_and_unload folds them into the one shared weight). The
same weights make `dapo-train export --merge`'s untied model."""

import copy

import pytest
import torch

from dapo_train.config.schema import LoraConfig
from dapo_train.model import lora

from conftest import make_random_model


def _adapted(plain, targets: list[str]):
    """`plain` with LoRA adapters on `targets`, every adapter matrix random: peft starts B (linear) or A
    (embedding) at 0, which would merge to the base weights."""
    settings = LoraConfig(r=4, alpha=8, **({"target_modules": targets} if targets else {}))
    adapted = lora.apply_lora(copy.deepcopy(plain), settings, "random")
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if ".lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return adapted


def test_merged_weights_are_merge_and_unloads_under_the_plain_models_names_and_leave_the_model_as_it_is():
    torch.manual_seed(0)
    plain = make_random_model()
    adapted = _adapted(plain, [])  # model.lora's default targets: the attention and MLP projections
    before = {name: p.detach().clone() for name, p in adapted.named_parameters()}
    merged = dict(lora.merged_weights(adapted))
    expected = copy.deepcopy(adapted).merge_and_unload().state_dict()
    assert set(merged) == {name for name, _ in plain.named_parameters()}
    assert all(torch.allclose(merged[name], expected[name], atol=1e-6) for name in merged)
    assert not torch.allclose(merged["model.layers.0.self_attn.q_proj.weight"],
                              plain.state_dict()["model.layers.0.self_attn.q_proj.weight"])
    assert all(torch.equal(p, before[name]) for name, p in adapted.named_parameters())
    assert dict(lora.merged_weights(plain)).keys() == merged.keys()  # a plain model: its own weights
    assert not lora.unties_embeddings(adapted) and not lora.unties_embeddings(plain)


@pytest.mark.parametrize("targets", [["embed_tokens"], ["lm_head"], ["embed_tokens", "lm_head", "q_proj"]])
def test_adapters_on_the_embedding_or_the_tied_head_reach_the_merged_weights(targets):
    """The random model ties its head to its embedding; an adapter on either makes the two differ, so the
    merged weights name both and a copy with its own head loaded with them computes the adapted logits."""
    plain = make_random_model()
    adapted = _adapted(plain, targets).eval()
    merged = dict(lora.merged_weights(adapted))
    assert lora.unties_embeddings(adapted) and set(merged) == {name for name, _ in plain.named_parameters()} | {
        "lm_head.weight"}
    untied_config = copy.deepcopy(plain.config)
    untied_config.tie_word_embeddings = False
    untied = type(plain)(untied_config).eval()
    untied.load_state_dict(merged, strict=True)
    ids = torch.randint(0, plain.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected, got, base = adapted(input_ids=ids).logits, untied(input_ids=ids).logits, plain(input_ids=ids).logits
    assert (expected - base).abs().max() > 0.5  # the adapters move the logits
    assert torch.allclose(got, expected, atol=1e-5), float((got - expected).abs().max())


@pytest.mark.parametrize("targets", [["embed_tokens"], ["lm_head"], ["q_proj"]])
def test_a_merged_export_computes_the_adapted_models_logits(targets, tmp_path, caplog):
    """`export --merge` of adapters on the tiny model (it ties its head to its embedding): adapters on the
    embedding or the head export an untied model, each weight with its own adapter's change, and say so; other
    adapters keep the tied model (the head not written apart). Either way, loaded with transformers alone, the
    exported folder computes the adapted model's logits."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dapo_train.run.export import export_checkpoint
    from dapo_train.task.locations import TINY_MODEL_DIR

    plain = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32)
    adapted = _adapted(plain, targets).eval()
    checkpoint = tmp_path / "checkpoint"
    adapted.save_pretrained(checkpoint)
    AutoTokenizer.from_pretrained(TINY_MODEL_DIR).save_pretrained(checkpoint)
    caplog.set_level("INFO")
    out = export_checkpoint(str(checkpoint), str(tmp_path / "merged"), merge=True)
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    untied = targets != ["q_proj"]
    assert exported.config.tie_word_embeddings is not untied
    assert ("lm_head.weight" in load_file(out / "model.safetensors")) is untied
    assert ("written untied" in caplog.text) is untied
    ids = torch.randint(0, plain.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected, got, base = adapted(input_ids=ids).logits, exported(input_ids=ids).logits, plain(input_ids=ids).logits
    assert (expected - base).abs().max() > 0.5  # the adapters move the logits
    assert torch.allclose(got, expected, atol=1e-5), float((got - expected).abs().max())
