"""The reward model: a sequence classifier's score of each (question, completion), registered as the
reward `reward_model`, as the seed trainer and TRL's GRPOTrainer take a model among their rewards.

What it reads: with `format: chat` (the default when its tokenizer has a chat template) its own
template over a user turn, the question as the policy saw it without the policy's system prompt,
and an assistant turn, the completion; with `plain`, the policy's prompt text followed by the
completion. A text longer than `max_tokens` keeps its last tokens (the prompt is cut from the left,
never the completion's end, where the answer is) and each batch that cuts logs a warning with its
count. Its one logit, read at each text's last token (last_token_scores), is the reward, or
`normalize: sigmoid` of (logit - shift) x scale.

What is cheap is checked whenever a config is read (check_args, from rewards.build_rewards): the
args, the path, config.json (a *ForSequenceClassification architecture with num_labels 1), the
tokenizer (it loads, has a pad token or an EOS to pad with, and its ids fit the model's embedding).
The weights load once per run (load, from RewardSet.load in the trainer's setup): frozen, in eval
mode, on the policy's device, bfloat16 on CUDA by default; remote code stays off and weights load as
safetensors first. Scoring runs in batches of `batch_size` under torch.inference_mode; under several
processes each rank scores the completions it generated. A batch that runs out of memory is scored again in
halves, and the smaller batch stays for the run (a text's score does not depend on its batch); one text alone
that does not fit ends the run at its last good step (DoesNotFit, train/loop.py).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence

from dapo_train.errors import DoesNotFit, UserError
from dapo_train.faults import REWARD_ROWS, out_of_memory_above
from dapo_train.model import loading
from dapo_train.rewards.scoring import register
from dapo_train.task import locations

logger = logging.getLogger(__name__)

FORMATS = ("auto", "chat", "plain")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# normalize -> what the reward is made of z = (logit - shift) * scale.
NORMALIZERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"none": lambda z: z, "sigmoid": torch.sigmoid}
HEAD_SUFFIX = "ForSequenceClassification"
PATH_KIND = locations.RepoKind(
    "model", "path", local="folder", existing="folder",
    hint="download it where there is network (`hf download <id> --local-dir ./<name>`) and set the reward's "
    "args.path to that folder",
)
PROBE_TOKENS = 256  # the length of the timed batch at load


@dataclass(frozen=True)
class RewardModelSettings:
    """The reward's args (reward_model's keyword arguments, which hold the defaults)."""

    path: str
    tokenizer_path: str | None
    format: str
    max_tokens: int
    batch_size: int
    dtype: str
    normalize: str
    scale: float
    shift: float


@dataclass(frozen=True)
class Checked:
    """What the cheap checks found: the model folder or Hub id, the tokenizer (pad token set), the
    format and the token budget resolved from `auto` and 0."""

    path: str
    tokenizer: object
    format: str
    max_tokens: int


# --------------------------------------------------------------------------------------------
# The cheap checks: args, path, config.json, tokenizer.


def _check_values(settings: RewardModelSettings) -> None:
    """Types and ranges of the args, before any file is read."""
    if not isinstance(settings.path, str) or not settings.path.strip():
        raise ValueError(f"reward_model needs path: a Hub id or a local folder, got {settings.path!r}")
    if settings.tokenizer_path is not None and (not isinstance(settings.tokenizer_path, str)
                                                or not settings.tokenizer_path.strip()):
        raise ValueError(f"tokenizer_path must be a Hub id or a folder (null = path), got {settings.tokenizer_path!r}")
    for name, allowed in (("format", FORMATS), ("dtype", DTYPES), ("normalize", tuple(NORMALIZERS))):
        if getattr(settings, name) not in allowed:
            raise ValueError(f"{name}: got {getattr(settings, name)!r}; allowed: {', '.join(allowed)}")
    for name, low in (("max_tokens", 0), ("batch_size", 1)):
        value = getattr(settings, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    for name in ("scale", "shift"):
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
    if settings.scale == 0:
        raise ValueError("scale 0 would give every completion the same reward")
    if settings.normalize == "none" and (settings.scale != 1 or settings.shift != 0):
        raise ValueError(
            "scale and shift act only inside normalize: sigmoid; on the raw logit a shift cancels in the group "
            "advantage and a scale is the reward's weight, so set weight instead"
        )


def _model_config(path: str):
    """config.json of a sequence classifier with one output, or a ValueError saying what it is instead."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=False, **loading.hub_load_kwargs(path, PATH_KIND))
    except loading.LOAD_ERRORS as exc:
        raise ValueError(loading.unreachable_message(path, exc, "config", PATH_KIND)) from None
    heads = [name for name in config.architectures or [] if name.endswith(HEAD_SUFFIX)]
    if not heads:
        raise ValueError(
            f"{path} is not a sequence classifier: its config.json names {config.architectures or 'no architecture'}, "
            f"not a *{HEAD_SUFFIX} head (a causal LM would get a randomly initialised score head)"
        )
    if config.model_type not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES:
        raise ValueError(f"{path}: transformers has no sequence-classification class for model_type "
                         f"{config.model_type!r} (and remote code stays off)")
    if config.num_labels != 1:
        raise ValueError(f"{path} has num_labels {config.num_labels}; a reward model gives one score (num_labels 1)")
    return config


def _tokenizer(settings: RewardModelSettings, path: str):
    """The reward model's own tokenizer (tokenizer_path, default path) with a pad token: its EOS where it
    has none, as the seed trainer does."""
    from transformers import AutoTokenizer

    name = path if settings.tokenizer_path is None else locations.resolve_model_path(settings.tokenizer_path,
                                                                                     "tokenizer_path")
    folder = Path(name).expanduser()
    if locations.looks_like_path(name) and not folder.is_dir():
        raise ValueError(f"tokenizer_path: folder not found: {name}")
    if folder.is_dir() and not any((folder / file).is_file() for file in loading.TOKENIZER_FILES):
        raise ValueError(f"{name} holds no tokenizer (none of {', '.join(loading.TOKENIZER_FILES)}); set "
                         "tokenizer_path to the reward model's own")
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=False,
                                                  **loading.hub_load_kwargs(name, PATH_KIND))
    except loading.LOAD_ERRORS as exc:
        raise ValueError(loading.unreachable_message(name, exc, "tokenizer", PATH_KIND)) from None
    if not tokenizer("1 + 1 = 2", add_special_tokens=False)["input_ids"]:
        raise ValueError(f"the tokenizer of {name} turns text into no tokens; it is not the reward model's own")
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError(f"the tokenizer of {name} has neither a pad nor an EOS token to pad batches with")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _positions(config) -> int | None:
    limits = [getattr(config, name, None) for name in ("max_position_embeddings", "n_positions")]
    return next((int(limit) for limit in limits if isinstance(limit, int) and limit > 0), None)


def check_model(settings: RewardModelSettings) -> Checked:
    """Every check short of loading the weights; a ValueError says what is wrong."""
    _check_values(settings)
    try:
        path = loading.check_model_path(settings.path, PATH_KIND)
        config = _model_config(path)
        tokenizer = _tokenizer(settings, path)
    except UserError as err:  # a path or a Hub id that is not there: the reward's args are what to fix
        raise ValueError(str(err)) from None
    vocabulary = config.get_text_config().vocab_size
    if len(tokenizer) > vocabulary:
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's embedding {vocabulary} rows: they are not a "
            "pair (point tokenizer_path at the model's own tokenizer)"
        )
    form = settings.format if settings.format != "auto" else "chat" if tokenizer.chat_template else "plain"
    if form == "chat" and not tokenizer.chat_template:
        raise ValueError(f"format chat: the tokenizer of {settings.tokenizer_path or path} has no chat template; "
                         "use format: plain")
    positions = _positions(config)
    if positions is not None and settings.max_tokens > positions:
        raise ValueError(f"max_tokens {settings.max_tokens} is more than the model's {positions} positions")
    return Checked(path, tokenizer, form, settings.max_tokens or positions or tokenizer.model_max_length)


def memory_footprint(args: dict, cuda: bool) -> tuple[object, int, int, int]:
    """What the memory estimate (train/memory.py) needs of a configured reward model, without its weights:
    (its transformers config, bytes per weight on a CUDA card or the CPU, texts per forward, tokens per text)."""
    import inspect

    fields = RewardModelSettings.__annotations__
    defaults = {name: p.default for name, p in inspect.signature(reward_model).parameters.items()
                if name in fields and p.default is not p.empty}
    settings = RewardModelSettings(**{**defaults, **args})
    checked = check_model(settings)
    dtype = _dtype(settings.dtype, torch.device("cuda" if cuda else "cpu"))
    return _model_config(checked.path), dtype.itemsize, settings.batch_size, checked.max_tokens


def check_args(args: dict) -> None:
    """The registry's check: runs whenever a config is read (`run`, `config`, `sweep`)."""
    check_model(RewardModelSettings(**args))


# --------------------------------------------------------------------------------------------
# The loaded model.


def _dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return loading.DTYPES[name]


def _score_head(model: torch.nn.Module, path: str) -> torch.nn.Module:
    """The linear layer that scores every position (`score` in transformers' decoder classifiers, `classifier`
    in a few)."""
    head = getattr(model, "score", None) or getattr(model, "classifier", None)
    if not isinstance(head, torch.nn.Module):
        raise UserError(f"reward model {path}: {type(model).__name__} has no score or classifier head to read")
    return head


def last_token_scores(model: torch.nn.Module, head: torch.nn.Module, input_ids: torch.Tensor,
                      mask: torch.Tensor) -> torch.Tensor:
    """(B,) the head's first output at each right-padded row's last attention-mask position, as verl reads it.

    Not transformers' pooling: it takes the rightmost token that is not the pad id, and where the pad id is
    the EOS (a tokenizer without a pad token) that ends the chat template's turn, that is one token early.
    A head over a pooled state (an encoder's first token: no position axis) gives the model's own logits.
    input_ids, mask: (B, T)."""
    captured = []
    hook = head.register_forward_hook(lambda module, args, output: captured.append(output))
    try:
        pooled = model(input_ids=input_ids, attention_mask=mask, use_cache=False).logits  # (B, 1); no KV cache kept
    finally:
        hook.remove()
    per_position = captured[-1]  # (B, T, 1) for a decoder's head
    if per_position.dim() != 3 or per_position.shape[1] != input_ids.shape[1]:
        return pooled[:, 0]
    last = mask.sum(dim=-1) - 1  # (B,)
    return per_position[torch.arange(len(last), device=last.device), last, 0]


class RewardModel:
    """A loaded, frozen reward model and its tokenizer; called as a reward function."""

    def __init__(self, settings: RewardModelSettings, checked: Checked, model: torch.nn.Module):
        self.settings, self.checked, self.model = settings, checked, model
        self.head = _score_head(model, checked.path)
        self.texts_scored = 0  # every text it has read, for the multi-process test and the logs
        self.batch_rows = settings.batch_size  # halved by a batch that ran out of memory (logits)

    @classmethod
    def load(cls, settings: RewardModelSettings, device: torch.device) -> RewardModel:
        """Checks, then the weights once, frozen, in eval mode on `device`; logs their size and the time of
        one batch."""
        from transformers import AutoModelForSequenceClassification

        checked, start = check_model(settings), time.perf_counter()
        dtype = _dtype(settings.dtype, device)
        try:
            model = AutoModelForSequenceClassification.from_pretrained(
                checked.path, dtype=dtype, trust_remote_code=False, use_safetensors=None,
                **loading.hub_load_kwargs(checked.path, PATH_KIND),
            )
        except loading.LOAD_ERRORS as exc:
            raise UserError(loading.unreachable_message(checked.path, exc, "reward model", PATH_KIND)) from None
        model = model.to(device).eval().requires_grad_(False)
        # transformers' classifiers refuse a batch without a pad id; the score is not read where it points
        # (last_token_scores).
        model.config.get_text_config().pad_token_id = checked.tokenizer.pad_token_id
        loaded = cls(settings, checked, model)
        loaded._log_size(time.perf_counter() - start, device, dtype)
        return loaded

    def _log_size(self, seconds: float, device: torch.device, dtype: torch.dtype) -> None:
        tensors = [*self.model.parameters(), *self.model.buffers()]
        size = sum(t.numel() * t.element_size() for t in tensors)
        count = sum(p.numel() for p in self.model.parameters())
        rows, length = self.settings.batch_size, min(PROBE_TOKENS, self.checked.max_tokens)
        probe = torch.full((rows, length), int(self.checked.tokenizer.pad_token_id == 0), device=device)
        for _ in range(2):  # the second, without the first call's warm-up
            start = time.perf_counter()
            with torch.inference_mode():
                self.model(input_ids=probe, attention_mask=torch.ones_like(probe), use_cache=False)
            probe_seconds = time.perf_counter() - start
        logger.info(
            "reward model %s: %.2fM parameters, %.1f MiB (%s) on %s, frozen, loaded in %.1f s; format %s, at most %d "
            "tokens; a batch of %d texts x %d tokens takes %.3f s (seconds_reward_model in metrics: per step)",
            self.settings.path, count / 1e6, size / 2**20, str(dtype).removeprefix("torch."), device, seconds,
            self.checked.format, self.checked.max_tokens, rows, length, probe_seconds,
        )

    def texts(self, completions: list[str], prompts: list[str] | None, questions: list[str] | None) -> list[str]:
        """What the model reads, per completion (the module docstring)."""
        if self.checked.format == "plain":
            if prompts is None:
                raise ValueError("reward_model with format plain needs the prompt texts (prompts=)")
            return [prompt + completion for prompt, completion in zip(prompts, completions)]
        if questions is None:
            raise ValueError("reward_model with format chat needs the questions (questions=)")
        render = self.checked.tokenizer.apply_chat_template
        return [render([{"role": "user", "content": question}, {"role": "assistant", "content": completion}],
                       tokenize=False) for question, completion in zip(questions, completions)]

    def token_ids(self, texts: list[str]) -> tuple[list[list[int]], int]:
        """Each text's ids, its last max_tokens where it is longer (a leading BOS stays). -> (ids, cut)."""
        tokenizer, budget = self.checked.tokenizer, self.checked.max_tokens
        special = self.checked.format == "plain"  # a chat template writes its own special tokens
        out, cut = [], 0
        for ids in tokenizer(texts, add_special_tokens=special)["input_ids"]:
            if len(ids) > budget:
                cut += 1
                keep_bos = tokenizer.bos_token_id is not None and ids[0] == tokenizer.bos_token_id
                ids = [ids[0], *ids[len(ids) - budget + 1:]] if keep_bos else ids[len(ids) - budget:]
            out.append(ids)
        return out, cut

    def logits(self, ids: list[list[int]]) -> torch.Tensor:
        """(N,) float32 logits, batch_rows texts at a time, longest first (less padding), right-padded so that
        every text keeps the positions it has alone; a batch out of memory is scored again at half the size."""
        order, start = sorted(range(len(ids)), key=lambda i: -len(ids[i])), 0
        out = torch.empty(len(ids), dtype=torch.float32)
        while start < len(order):
            rows = order[start : start + self.batch_rows]
            try:
                out[rows] = self._scores([ids[index] for index in rows])
                start += len(rows)
            except torch.OutOfMemoryError:
                self._halve(len(rows), len(ids[rows[0]]))
        return out

    def _scores(self, texts: list[list[int]]) -> torch.Tensor:
        """One batch's (B,) float32 logits, on the CPU."""
        out_of_memory_above(REWARD_ROWS, len(texts))  # a test's fault (faults.py); nothing otherwise
        device, pad = next(self.model.parameters()).device, self.checked.tokenizer.pad_token_id
        batch = pad_sequence([torch.tensor(t) for t in texts], batch_first=True, padding_value=pad)  # (B, T)
        mask = pad_sequence([torch.ones(len(t), dtype=torch.long) for t in texts], batch_first=True)  # (B, T)
        with torch.inference_mode():
            return last_token_scores(self.model, self.head, batch.to(device), mask.to(device)).float().cpu()  # (B,)

    def _halve(self, rows: int, tokens: int) -> None:
        """A batch of `rows` texts (the longest `tokens` long) ran out of memory: half as many from now on."""
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if rows <= 1:
            raise DoesNotFit(f"reward model {self.settings.path}: one text alone ({tokens} tokens) does not fit the "
                             "card; what cuts its memory: a smaller max_tokens, dtype bfloat16, or a smaller model")
        self.batch_rows = rows // 2
        logger.warning("reward model %s: out of memory scoring %d texts of up to %d tokens: scored again %d at a "
                       "time, kept for the rest of the run (its batch_size is %d)", self.settings.path, rows,
                       tokens, self.batch_rows, self.settings.batch_size)

    def __call__(self, completions: list[str], answers: list, *, lengths=None, prompts=None,
                 questions=None) -> list[float]:
        ids, cut = self.token_ids(self.texts(completions, prompts, questions))
        if cut:
            logger.warning(
                "reward model %s: %d of %d texts were longer than max_tokens %d and lost their first tokens (the "
                "prompt first, never the completion's end); raise max_tokens to read them whole",
                self.settings.path, cut, len(ids), self.checked.max_tokens,
            )
        self.texts_scored += len(ids)
        s = self.settings
        return NORMALIZERS[s.normalize]((self.logits(ids) - s.shift) * s.scale).tolist()


def load(args: dict, device: torch.device) -> RewardModel:
    """The registry's load: once per run (RewardSet.load)."""
    return RewardModel.load(RewardModelSettings(**args), device)


@register("reward_model", check=check_args, load=load)
def reward_model(
    completions: list[str], answers: list, *, lengths=None, prompts=None, questions=None, path: str,
    tokenizer_path: str | None = None, format: str = "auto", max_tokens: int = 0, batch_size: int = 16,
    dtype: str = "auto", normalize: str = "none", scale: float = 1.0, shift: float = 0.0,
) -> list[float]:
    """A sequence classifier's score of (question, completion): a learned verifier or an outcome reward
    model with one output (num_labels 1), its logit or, with normalize sigmoid, sigmoid((logit - shift) x
    scale). path: Hub id, folder or builtin:tiny-verifier; format: chat (its template) or plain (prompt +
    completion), auto = chat when it has a template; max_tokens 0 = its positions; dtype auto = bfloat16
    on CUDA.

    The trainer loads the model once per run (RewardSet.load); called directly, this loads it for the
    one call, on CUDA when there is one.
    """
    settings = RewardModelSettings(path=path, tokenizer_path=tokenizer_path, format=format, max_tokens=max_tokens,
                                   batch_size=batch_size, dtype=dtype, normalize=normalize, scale=scale, shift=shift)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return RewardModel.load(settings, device)(completions, answers, prompts=prompts, questions=questions)
