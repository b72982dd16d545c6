"""A model hub id without a network: one line within seconds that names the two ways out (a local
folder in model.name_or_path, HF_HUB_OFFLINE=1 with a cached copy), and no warning printed twice."""

import subprocess
import sys

import huggingface_hub
import pytest

from dapo_train.config.schema import ModelConfig
from dapo_train.errors import UserError
from dapo_train.model import loading

HUB_ID = "nobody-dapo/made-up-model"


@pytest.fixture
def no_network(monkeypatch):
    """The Hub unreachable, HF_HUB_OFFLINE unset, and from_pretrained (which retries for ~50 s) forbidden."""
    import transformers

    def unreachable(repo_id, timeout):
        raise ConnectionError("[Errno -2] Name or service not known")

    def must_not_run(*args, **kwargs):
        raise AssertionError("from_pretrained retries for ~50 s without a network; the probe must stop first")

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "model_info", unreachable)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", must_not_run)
    loading.hub_load_kwargs.cache_clear()
    yield monkeypatch
    loading.hub_load_kwargs.cache_clear()


def test_an_unreachable_hub_fails_on_the_probe_naming_both_ways_out(no_network):
    no_network.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo_id, filename: None)
    with pytest.raises(UserError) as error:  # from the probe: the fixture forbids from_pretrained
        loading.load_tokenizer(ModelConfig(name_or_path=HUB_ID))
    message = str(error.value)
    assert message.startswith(f"could not reach model '{HUB_ID}' on the Hugging Face Hub (ConnectionError: ")
    assert "set model.name_or_path to that folder" in message and "set HF_HUB_OFFLINE=1" in message
    assert "\n" not in message


def test_an_unreachable_hub_uses_a_cached_copy(no_network):
    no_network.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo_id, filename: "/cache/x")
    assert loading.hub_load_kwargs(HUB_ID) == {"local_files_only": True}


def test_offline_mode_names_the_local_folder_and_hf_hub_offline(tmp_path):
    """HF_HUB_OFFLINE=1 without a cached copy, through the command: one line, exit 2."""
    env = {"PATH": "", "HOME": str(tmp_path), "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "dapo_train", "run", f"model.name_or_path={HUB_ID}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        f"error: could not load model '{HUB_ID}' (HF_HUB_OFFLINE=1 and no cached copy); "
        f"{loading.LOCAL_MODEL_HINT}"
    )


def test_library_warnings_are_printed_once(tmp_path):
    """transformers gives huggingface_hub's logger its own handler; with the root's as well, every Hub
    retry warning would be printed twice."""
    script = (
        "import logging\n"
        "from dapo_train.run.console import console_logging\n"
        "console_logging()\n"
        "for name in ('huggingface_hub.utils._http', 'transformers.modeling_utils', 'datasets.load'):\n"
        "    logging.getLogger(name).warning('retrying from %s', name)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for name in ("huggingface_hub.utils._http", "transformers.modeling_utils", "datasets.load"):
        assert result.stderr.count(f"retrying from {name}") == 1, result.stderr


# --------------------------------------------------------------------------------------------
# The policy must be a causal LM (issue 38): config.json's architectures, read without weights.


@pytest.mark.parametrize("architectures,model_type,refused", [
    (["Qwen2ForSequenceClassification"], "qwen2", "names Qwen2ForSequenceClassification, not a causal-LM head"),
    (["Qwen2ForCausalLM"], "qwen2", None),
    (["GPT2LMHeadModel"], "gpt2", None),  # a causal LM whose class name does not end in ForCausalLM
    (None, "qwen2", None),  # no architectures: the model_type decides
    (None, "t5", "transformers has no causal-LM class for its model_type 't5'"),
])
def test_only_a_causal_lm_is_accepted_as_the_policy(architectures, model_type, refused):
    from types import SimpleNamespace

    from dapo_train.errors import ConfigError

    config = SimpleNamespace(architectures=architectures, model_type=model_type)
    model = ModelConfig(name_or_path="./some-model")
    if refused is None:
        loading.check_causal_lm(config, model)
        return
    with pytest.raises(ConfigError, match=f"model.name_or_path': ./some-model is not a causal LM: .*{refused}"):
        loading.check_causal_lm(config, model)


def test_gradient_checkpointing_falls_back_to_the_old_call_on_an_older_transformers():
    """A transformers from before activation_checkpointing_enable (another environment pins <5.20) has
    only gradient_checkpointing_enable: it gets the same non-reentrant setting."""
    calls = []

    class OlderModel:
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            calls.append(gradient_checkpointing_kwargs)

    loading.enable_gradient_checkpointing(OlderModel())
    assert calls == [{"use_reentrant": False}]
