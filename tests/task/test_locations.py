"""The one Hub probe (dapo_train.task.locations) behind model and dataset ids: one request with
HUB_TIMEOUT_S, and for each kind of answer one line that names the config key and the way out.
Every Hub call is a stand-in: these tests never touch the network."""

import datasets
import httpx2
import huggingface_hub
import pytest
import transformers
from huggingface_hub.utils import HfHubHTTPError, HFValidationError, RepositoryNotFoundError

from dapo_train.config.schema import DataConfig, ModelConfig
from dapo_train.errors import UserError
from dapo_train.model import loading
from dapo_train.model.loading import LOCAL_MODEL_HINT
from dapo_train.task import locations
from dapo_train.task.sources import LOCAL_COPY_HINT, load_split

MODEL_ID, DATASET_ID = "nobody-dapo/made-up-model", "nobody-dapo/made-up-dataset"


def _response(status: int) -> httpx2.Response:
    return httpx2.Response(status, request=httpx2.Request("GET", "https://huggingface.co/api/x"))


@pytest.fixture
def hub_says(monkeypatch):
    """hub_says(exc): both info calls raise `exc` (None: they answer) and record (repo_id, timeout);
    HF_HUB_OFFLINE unset; the downloads themselves may not run unless a test allows it."""
    calls = []

    def answer(exc):
        def info(repo_id, timeout):
            calls.append((repo_id, timeout))
            if exc is not None:
                raise exc

        monkeypatch.setattr(huggingface_hub, "model_info", info)
        monkeypatch.setattr(huggingface_hub, "dataset_info", info)
        return calls

    def must_not_run(*args, **kwargs):
        raise AssertionError("the probe's answer must stop this before the download")

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", must_not_run)
    monkeypatch.setattr(datasets, "load_dataset", must_not_run)
    loading.hub_load_kwargs.cache_clear()
    yield answer
    loading.hub_load_kwargs.cache_clear()


def load_model_id(repo_id):
    loading.load_tokenizer(ModelConfig(name_or_path=repo_id))


def load_dataset_id(repo_id):
    load_split(DataConfig(path=repo_id), "train")


# What each kind's messages say, written out in full: the user reads exactly these lines.
NOT_FOUND = [
    (load_model_id, MODEL_ID,
     f"model.name_or_path '{MODEL_ID}' is not a local folder, and the Hub has no such model (or it is private or "
     f"gated: log in with `hf auth login`); {LOCAL_MODEL_HINT}"),
    (load_dataset_id, DATASET_ID,
     f"data.path '{DATASET_ID}' is not a local path, and the Hub has no such dataset (or it is private or "
     f"gated: log in with `hf auth login`); {LOCAL_COPY_HINT}"),
]
MALFORMED = [
    (load_model_id, "bad..id", "model.name_or_path 'bad..id' is neither an existing folder nor a Hub model id"),
    (load_dataset_id, "bad..id", "data.path 'bad..id' is neither an existing file or folder nor a Hub dataset id"),
]


@pytest.mark.parametrize("load, repo_id, message", NOT_FOUND, ids=["model", "dataset"])
def test_a_repo_the_hub_does_not_have_is_one_line_naming_the_key(hub_says, load, repo_id, message):
    calls = hub_says(RepositoryNotFoundError("404 Client Error", response=_response(404)))
    with pytest.raises(UserError) as error:
        load(repo_id)
    assert str(error.value) == message
    assert calls == [(repo_id, locations.HUB_TIMEOUT_S)]  # one request, with the one timeout


@pytest.mark.parametrize("load, repo_id, message", MALFORMED, ids=["model", "dataset"])
def test_an_id_the_hub_cannot_hold_is_one_line_naming_the_key(hub_says, load, repo_id, message):
    hub_says(HFValidationError("Cannot have -- or .. in repo_id"))
    with pytest.raises(UserError) as error:
        load(repo_id)
    assert str(error.value) == message


def test_a_hub_that_answers_otherwise_leaves_the_model_download_to_report_it(hub_says):
    calls = hub_says(HfHubHTTPError("500 Server Error", response=_response(500)))
    assert loading.hub_load_kwargs(MODEL_ID) == {}  # no local_files_only: from_pretrained asks the Hub itself
    assert calls == [(MODEL_ID, locations.HUB_TIMEOUT_S)]


def test_a_hub_that_answers_otherwise_leaves_the_dataset_download_to_report_it(hub_says, monkeypatch):
    calls = hub_says(HfHubHTTPError("500 Server Error", response=_response(500)))
    monkeypatch.setattr(datasets, "load_dataset", lambda repo_id: {"train": f"the train split of {repo_id}"})
    assert load_split(DataConfig(path=DATASET_ID), "train") == f"the train split of {DATASET_ID}"
    assert calls == [(DATASET_ID, locations.HUB_TIMEOUT_S)]


def test_an_unreachable_hub_is_returned_to_the_caller_with_its_reason(hub_says):
    hub_says(ConnectionError("[Errno -2] Name or service not known"))
    kind = locations.RepoKind("dataset", "data.path", "path", "file or folder", "hint")
    unreachable = locations.probe(DATASET_ID, kind)
    assert locations.reason(unreachable) == "ConnectionError: [Errno -2] Name or service not known"
