"""Where a model or a data set named in a config is: the shipped tiny world, a local path, or a Hub id.

`builtin:tiny`, `builtin:tiny-zh-math` (dapo_train/assets/tiny/) and `builtin:tiny-long`,
`builtin:tiny-zh-math-long` (dapo_train/assets/tiny-long/; rebuilt by scripts/build/make_tiny_model.py), and
the reward model `builtin:tiny-verifier` (dapo_train/assets/tiny-verifier/; scripts/build/make_tiny_verifier.py)
the tool-calling warm start `builtin:tiny-tools` (dapo_train/assets/tiny-tools/;
scripts/build/make_tiny_tools_model.py) and the strong start `builtin:tiny-strong` (dapo_train/assets/tiny-strong/;
make_tiny_model.py --recipe tiny-strong) resolve to shipped folders; a name that looks like a path is one;
anything else is a Hub id.

Before a Hub id is downloaded, one short question goes to the Hub: without a network,
`from_pretrained` retries for ~50 s and `load_dataset` for ~25 s before they fail; one request with a
timeout first turns that into one line within seconds. A Hub that answers "no such repo", or an id
the Hub cannot hold, is a UserError at once; a Hub that cannot be reached is the caller's to handle
(a model may still load from the cache).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import huggingface_hub
from huggingface_hub.utils import HfHubHTTPError, HFValidationError, RepositoryNotFoundError

from dapo_train.config.schema import (
    BUILTIN_DATA,
    BUILTIN_MODEL,
)
from dapo_train.errors import UserError

# --------------------------------------------------------------------------------------------
# Names that point outside the config: the shipped tiny world, local paths.

ASSETS_DIR = Path(__file__).resolve().parents[1] / "assets"
TINY_MODEL_DIR = ASSETS_DIR / "tiny" / "model"
TINY_DATA_DIR = ASSETS_DIR / "tiny" / "data"
TINY_LONG_MODEL_DIR = ASSETS_DIR / "tiny-long" / "model"
TINY_LONG_DATA_DIR = ASSETS_DIR / "tiny-long" / "data"
TINY_VERIFIER_DIR = ASSETS_DIR / "tiny-verifier"
TINY_TOOLS_MODEL_DIR = ASSETS_DIR / "tiny-tools"
TINY_STRONG_MODEL_DIR = ASSETS_DIR / "tiny-strong"
# The shipped names: the short task and its model, the long-solution task and its warm start, and a
# verifier of the short task's completions (a sequence classifier: a reward model, not a policy), and
# the tiny model continued on solutions that call the calculator (issue 42), and a strong start on the short
# task (issue 53: most answers already right, so RL can lose accuracy as well as gain it).
BUILTIN_MODELS = {BUILTIN_MODEL: TINY_MODEL_DIR, "builtin:tiny-long": TINY_LONG_MODEL_DIR,
                  "builtin:tiny-verifier": TINY_VERIFIER_DIR, "builtin:tiny-tools": TINY_TOOLS_MODEL_DIR,
                  "builtin:tiny-strong": TINY_STRONG_MODEL_DIR}
BUILTIN_DATA_SETS = {BUILTIN_DATA: TINY_DATA_DIR, "builtin:tiny-zh-math-long": TINY_LONG_DATA_DIR}


def _resolve_builtin(name: str, shipped: dict[str, Path], key: str) -> str:
    if name.startswith("builtin:") and name not in shipped:
        raise UserError(f"{key}: no shipped {name!r}; the shipped ones are {', '.join(shipped)}")
    return str(shipped.get(name, name))


def resolve_model_path(name_or_path: str, key: str = "model.name_or_path") -> str:
    """builtin:tiny, builtin:tiny-long, builtin:tiny-verifier, builtin:tiny-tools, builtin:tiny-strong -> the
    shipped model folder; anything else unchanged. key: the setting that named it, for the message."""
    return _resolve_builtin(name_or_path, BUILTIN_MODELS, key)


def resolve_data_path(path: str) -> str:
    """builtin:tiny-zh-math(-long) -> the shipped data folder (train.jsonl, test.jsonl); else unchanged."""
    return _resolve_builtin(path, BUILTIN_DATA_SETS, "data.path")


def looks_like_path(name: str) -> bool:
    """A name meant as a local path even if it does not exist: it starts with '.', '/' or '~', or
    has more than one '/' (a hub id is 'owner/name')."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1

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
