"""One short question to the Hugging Face Hub before a model or a dataset is downloaded.

Without a network, `from_pretrained` retries for ~50 s and `load_dataset` for ~25 s before they
fail; one request with a timeout first turns that into one line within seconds. A Hub that answers
"no such repo", or an id the Hub cannot hold, is a UserError at once; a Hub that cannot be reached
is the caller's to handle (a model may still load from the cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import huggingface_hub
from huggingface_hub.utils import HfHubHTTPError, HFValidationError, RepositoryNotFoundError

from dapo_train.errors import UserError

HUB_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class RepoKind:
    """How the messages name one kind of Hub repo.

    name: the Hub's repo type, "model" or "dataset" (huggingface_hub.<name>_info asks for one);
    key: the config key that holds the id; local: what a local source is ("not a local <local>");
    existing: what an existing local source is ("neither an existing <existing> nor a Hub id");
    hint: how to do without the Hub.
    """

    name: str
    key: str
    local: str
    existing: str
    hint: str


def offline() -> bool:
    """HF_HUB_OFFLINE=1: the Hub is not to be asked."""
    return bool(huggingface_hub.constants.HF_HUB_OFFLINE)


def probe(repo_id: str, kind: RepoKind) -> Exception | None:
    """Ask the Hub once, within HUB_TIMEOUT_S, whether `repo_id` is there. -> None when the Hub
    answered (the download reports any other refusal, and may use the cache), or the exception that
    says why the Hub could not be reached (no network, DNS, proxy, timeout)."""
    info = getattr(huggingface_hub, f"{kind.name}_info")
    try:
        info(repo_id, timeout=HUB_TIMEOUT_S)
    except RepositoryNotFoundError:
        raise UserError(
            f"{kind.key} '{repo_id}' is not a local {kind.local}, and the Hub has no such {kind.name} (or it is "
            f"private or gated: log in with `hf auth login`); {kind.hint}"
        ) from None
    except HFValidationError:
        raise UserError(
            f"{kind.key} '{repo_id}' is neither an existing {kind.existing} nor a Hub {kind.name} id"
        ) from None
    except HfHubHTTPError:
        return None
    except Exception as exc:  # anything that is not an answer from the Hub
        return exc
    return None


def reason(exc: Exception) -> str:
    """'ConnectionError: [Errno -2] Name or service not known': an unreachable Hub, for a message."""
    return f"{type(exc).__name__}: {exc}"
