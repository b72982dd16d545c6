"""The vllm engine's settings without vllm (this runs in the main suite, where the CUDA paths can be read
though not run): what each config key makes of vLLM's arguments on a CPU and on a card, the sleep around
the update on CUDA (and none on a CPU), and the start's word on the keys that cannot act."""

from __future__ import annotations

import pytest
import torch

from dapo_train.config.load import load_config
from dapo_train.errors import ConfigError
from dapo_train.model.loading import load_model, load_tokenizer
from dapo_train.rollout import EngineSetup
from dapo_train.rollout.engines import pause
from dapo_train.rollout.vllm_engine import VllmEngine
from dapo_train.rollout.vllm_settings import check_memory, inert_settings, llm_settings, start_refused


@pytest.fixture(scope="module")
def tiny():
    cfg = load_config(None, [])
    return load_model(cfg.model, torch.device("cpu")), load_tokenizer(cfg.model)


def settings(tiny, cuda: bool, **setup) -> dict:
    model, tokenizer = tiny
    options = {"batch_size": 64, "dtype": "auto", "compile": "auto", "max_length": 352, **setup}
    return llm_settings(EngineSetup(model, tokenizer, **options), cuda)


def test_on_a_cpu_the_kv_cache_is_sized_to_the_run_and_prefills_are_whole(tiny):
    cpu = settings(tiny, cuda=False)
    # 64 sequences x 352 positions x 4 layers x 2 (K, V) x 2 KV heads x 32 x 4 bytes = 46,137,344 bytes: 44 MiB
    assert cpu["kv_cache_memory_bytes"] == 44 * 2**20
    assert (cpu["dtype"], cpu["max_model_len"], cpu["max_num_seqs"], cpu["enforce_eager"]) == ("float32", 352, 64, True)
    assert cpu["enable_chunked_prefill"] is False and "gpu_memory_utilization" not in cpu
    assert cpu["generation_config"] == "vllm" and cpu["logprobs_mode"] == "processed_logprobs"
    assert settings(tiny, cuda=False, vllm_kv_cache_mib=100)["kv_cache_memory_bytes"] == 100 * 2**20
    assert settings(tiny, cuda=False, batch_size=128)["kv_cache_memory_bytes"] == 88 * 2**20
    assert settings(tiny, cuda=False, compile="on")["enforce_eager"] is False
    assert settings(tiny, cuda=False, max_length=0)["max_model_len"] == 512  # the model's positions


def test_on_cuda_it_takes_its_share_of_the_card_sleeps_and_compiles(tiny, monkeypatch):
    monkeypatch.setenv("CC", "cc")  # a C compiler, which Triton needs to compile (rollout/compiled.py)
    card = settings(tiny, cuda=True, vllm_memory=0.45)
    assert (card["gpu_memory_utilization"], card["enable_sleep_mode"]) == (0.45, True)
    assert "kv_cache_memory_bytes" not in card and "enable_chunked_prefill" not in card  # vLLM sizes and chunks
    assert (card["dtype"], card["enforce_eager"]) == ("bfloat16", False)
    assert settings(tiny, cuda=True, dtype="float32", compile="off")["dtype"] == "float32"
    assert settings(tiny, cuda=True, compile="off")["enforce_eager"] is True
    assert settings(tiny, cuda=True, vllm_kv_cache_mib=2048)["kv_cache_memory_bytes"] == 2048 * 2**20


def test_on_cuda_without_a_c_compiler_it_starts_eager(tiny, monkeypatch, tmp_path):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no gcc, no clang
    assert settings(tiny, cuda=True)["enforce_eager"] is True
    assert settings(tiny, cuda=False, compile="on")["enforce_eager"] is False  # vLLM's CPU compile: no Triton


class FailingCompile:
    """vllm.LLM whose compiled start fails as a compile does (InductorError, raised inside vLLM's start): the
    settings of each start recorded."""

    starts: list[dict] = []
    eager_too = False  # an eager start fails so too (no retry is left)

    def __init__(self, **settings) -> None:
        from torch._inductor.exc import InductorError, InvalidCxxCompiler

        FailingCompile.starts.append(dict(settings))
        if not settings["enforce_eager"] or FailingCompile.eager_too:
            try:
                raise InductorError(InvalidCxxCompiler(), None)
            except InductorError as error:
                raise RuntimeError("Engine core initialization failed. See root cause above.") from error


def test_a_start_whose_compile_fails_starts_again_eager_once(tiny, caplog):
    from dapo_train.rollout.vllm_engine import _started

    model, tokenizer = tiny
    FailingCompile.starts = []
    options = {"enforce_eager": False, "dtype": "bfloat16"}
    _started(FailingCompile, options, None, EngineSetup(model, tokenizer, 8, "auto", "auto"), cuda=True)
    assert [start["enforce_eager"] for start in FailingCompile.starts] == [False, True]
    assert options["enforce_eager"] is True  # what the start line then says: eager
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1 and said[0].startswith("rollout: compiling the decode step failed (InvalidCxxCompiler: ")
    assert "the vllm engine decodes eagerly from now on" in said[0]
    FailingCompile.starts, FailingCompile.eager_too = [], True
    with pytest.raises(ConfigError, match="^config key 'rollout.engine': vLLM could not start with this run's "
                                          "settings: Engine core initialization failed"):
        _started(FailingCompile, {"enforce_eager": False}, None, EngineSetup(model, tokenizer, 8, "auto", "auto"),
                 cuda=True)
    assert [start["enforce_eager"] for start in FailingCompile.starts] == [False, True]  # one retry, no more
    with pytest.raises(ConfigError, match="unsupported head size 16"):  # no compile failure: refused, not retried
        _started(Refusing, {"enforce_eager": False}, None, EngineSetup(model, tokenizer, 8, "auto", "auto"), cuda=True)
    assert len(Refusing.starts) == 1


class Refusing:
    starts: list[dict] = []

    def __init__(self, **settings) -> None:
        Refusing.starts.append(settings)
        raise RuntimeError("unsupported head size 16")


class FakeLLM:
    """Records the engine's calls to vLLM."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def sleep(self, level: int) -> None:
        self.calls.append(f"sleep {level}")

    def wake_up(self) -> None:
        self.calls.append("wake_up")

    def collective_rpc(self, method, kwargs=None) -> None:
        self.calls.append(method if isinstance(method, str) else method.__name__)

    def reset_prefix_cache(self) -> None:
        self.calls.append("reset_prefix_cache")


@pytest.mark.parametrize("cuda", [True, False])
def test_the_update_sleeps_the_engine_on_cuda_and_the_sync_wakes_it_first(tiny, cuda):
    engine = object.__new__(VllmEngine)  # its start is vllm's; here only what follows it
    engine.model, engine.cuda, engine.asleep, engine.llm = tiny[0], cuda, False, FakeLLM()
    pause(engine)
    pause(engine)  # a second pause does not sleep twice
    engine.sync_weights()
    slept = ["sleep 1", "wake_up"] if cuda else []
    assert engine.llm.calls == [*slept, "reload_weights", "_repack_tied_head", "reset_prefix_cache"]
    assert not engine.asleep


def test_the_start_says_which_vllm_keys_cannot_act():
    def said(*overrides: str, cuda: bool = False) -> list[str]:
        return inert_settings(load_config(None, list(overrides)).rollout, cuda)

    assert said() == [] and said("rollout.engine=vllm") == [] and said("rollout.engine=vllm", cuda=True) == []
    assert said("rollout.vllm_memory=0.5", "rollout.vllm_kv_cache_mib=64") == [
        "rollout.vllm_memory and rollout.vllm_kv_cache_mib cannot act: rollout.engine is hf, not vllm"]
    assert said("rollout.engine=vllm", "rollout.vllm_memory=0.5")[0].startswith(
        "rollout.vllm_memory cannot act on a CPU")
    assert said("rollout.engine=vllm", "rollout.vllm_memory=0.5", cuda=True) == []


def test_run_with_vllm_missing_is_one_line_and_exit_2_before_the_model_loads(monkeypatch, tmp_path, capsys):
    import importlib.util
    import sys

    from dapo_train import cli
    from dapo_train.train import session

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == "vllm" else real(name, *args))
    monkeypatch.setattr(session, "load_policy", lambda *args, **kwargs: pytest.fail("the model loaded"))
    monkeypatch.setattr(sys, "argv", ["dapo-train", "run", "rollout.engine=vllm", f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(SystemExit) as exited:
        cli.main()
    assert exited.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert "vllm is not installed; pip install 'dapo-train[vllm]'" in lines[-1] and "Traceback" not in "".join(lines)
    assert not (tmp_path / "run").exists()


def test_a_kv_cache_the_device_cannot_hold_is_refused_naming_the_key():
    def check(*overrides: str, cuda: bool = False, free_mib: int = 1000) -> None:
        check_memory(load_config(None, ["rollout.engine=vllm", *overrides]).rollout, cuda, free_mib * 2**20)

    check("rollout.vllm_kv_cache_mib=1000")  # all there is: vLLM's own start decides
    check("rollout.vllm_kv_cache_mib=0", free_mib=1)  # auto: sized to the run
    check_memory(load_config(None, ["rollout.vllm_kv_cache_mib=5000"]).rollout, False, 2**20)  # hf: not vllm's
    with pytest.raises(ConfigError, match=r"^config key 'rollout.vllm_kv_cache_mib': a KV cache of 1,001 MiB is "
                                          r"more than the 1,000 MiB this machine has available; lower it"):
        check("rollout.vllm_kv_cache_mib=1001")
    with pytest.raises(ConfigError, match="more than the 1,000 MiB the card has free"):
        check("rollout.vllm_kv_cache_mib=1001", cuda=True)


def test_what_vllm_refuses_at_start_names_the_config_key_behind_it(tiny):
    model, tokenizer = tiny
    cpu = EngineSetup(model, tokenizer, 8, "auto", "auto", vllm_kv_cache_mib=64)
    said = ValueError("Available memory on node 0 (1.00/2.00 GiB) is less than requested memory for kv (9.00 GiB). "
                      "Decrease --kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE, or reduce CPU memory")
    refused = str(start_refused(said, cpu, cuda=False))
    assert refused.startswith("config key 'rollout.vllm_kv_cache_mib': vLLM could not start: Available memory on node "
                              "0 (1.00/2.00 GiB) is less than requested memory for kv (9.00 GiB); set ")
    assert "--kv-cache-memory-bytes" not in refused  # vLLM's option, which the user never sets
    card = EngineSetup(model, tokenizer, 8, "auto", "auto")  # KV cache auto: vllm_memory sizes it
    no_room = ValueError("No available memory for the cache blocks. Try increasing `gpu_memory_utilization`")
    assert str(start_refused(no_room, card, cuda=True)).startswith("config key 'rollout.vllm_memory': ")
    other = str(start_refused(RuntimeError("unsupported head size 16\nmore"), card, cuda=True))
    assert other.startswith("config key 'rollout.engine': vLLM could not start with this run's settings: "
                            "unsupported head size 16 (")


def test_an_adapter_on_the_tied_head_gives_the_engine_a_head_of_its_own(tiny):
    """The tiny model ties its head to its embedding: with an adapter on either, the engine unties them and
    takes every weight from the trainer (the folder holds no head); other adapters leave it as it is."""
    import copy

    from dapo_train.config.schema import LoraConfig
    from dapo_train.model import lora

    model, tokenizer = tiny
    for targets, unties in ((["lm_head"], True), (["embed_tokens"], True), (["q_proj"], False)):
        adapted = lora.apply_lora(copy.deepcopy(model), LoraConfig(r=4, target_modules=targets), "tiny")
        options = llm_settings(EngineSetup(adapted, tokenizer, 8, "auto", "auto", max_length=64), cuda=False)
        assert (options.get("hf_overrides"), options.get("load_format")) == (
            ({"tie_word_embeddings": False}, "dummy") if unties else (None, None)), targets


def test_ranks_on_one_machine_share_its_memory_and_each_card_is_its_ranks_own(monkeypatch):
    """Under torchrun every rank's engine takes its KV cache from the same machine's memory on a CPU: two
    ranks' 600 MiB each do not fit in 1,000 MiB, one rank's do; on CUDA each rank checks its own card."""
    def check(cuda: bool = False) -> None:
        check_memory(load_config(None, ["rollout.engine=vllm", "rollout.vllm_kv_cache_mib=600"]).rollout, cuda,
                     1000 * 2**20)

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    check()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    check(cuda=True)
    with pytest.raises(ConfigError, match=r"a KV cache of 600 MiB for each of the 2 processes on this machine is "
                                          r"more than the 1,000 MiB this machine has available"):
        check()


def test_one_ranks_engine_among_several_joins_the_trainers_group_with_its_own_seed(tiny, monkeypatch):
    """One process: vLLM's own executor. Several (the trainer's group exists): vLLM's external launcher, one
    whole model per rank (tensor parallelism 1), the rank as the engine's seed."""
    from dapo_train.rollout import vllm_ranks

    single = settings(tiny, cuda=False)
    assert "distributed_executor_backend" not in single and single["seed"] == 0
    monkeypatch.setattr(vllm_ranks.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(vllm_ranks.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(vllm_ranks.dist, "get_rank", lambda: 1)
    ranked = settings(tiny, cuda=True)
    assert (ranked["distributed_executor_backend"], ranked["tensor_parallel_size"], ranked["seed"]) == \
        ("external_launcher", 1, 1)
    assert {key: value for key, value in ranked.items() if key not in ("distributed_executor_backend",
            "tensor_parallel_size", "seed")} == {key: value for key, value in settings(tiny, cuda=True).items()
                                                 if key not in ("distributed_executor_backend",
                                                                "tensor_parallel_size", "seed")}
