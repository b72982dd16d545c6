"""FSDP's dtypes under `accelerate launch --config_file configs/accelerate/fsdp.yaml` (train/distributed.py
fsdp_plugin): accelerate's own plugin under bf16 gathers the weights and reduces the gradients in bfloat16, not
the float32 that configs/qwen7b-fsdp.yaml budgets; the trainer's keeps FSDP's casts off and asks for a float32
reduction, and accelerate's bf16 leaves that as it is. Two gloo ranks on the CPU shard the tiny model with each
policy as accelerate's fsdp2_prepare_model passes it (fully_shard(mp_policy=...): accelerate prepares FSDP on GPUs
only) and report what is gathered, computed and reduced."""

from __future__ import annotations

import os
import pickle
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from dapo_train.train import distributed

from conftest import make_random_model


def test_only_an_fsdp_launch_gets_a_plugin(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert distributed.fsdp_plugin() is None


@pytest.mark.parametrize("version", ["1", "2"])
def test_accelerates_bf16_keeps_the_float32_reduction(monkeypatch, version):
    """AcceleratorState calls set_mixed_precision("bf16") on the plugin of an FSDP run on GPUs: accelerate's own
    plugin then casts both ways to bfloat16; the trainer's keeps no param cast and a float32 reduction."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", version)
    ours, theirs = distributed.fsdp_plugin(), FullyShardedDataParallelPlugin()
    for plugin in (ours, theirs):
        plugin.set_mixed_precision("bf16")
    assert (ours.mixed_precision_policy.param_dtype, ours.mixed_precision_policy.reduce_dtype) == (None, torch.float32)
    assert (theirs.mixed_precision_policy.param_dtype, theirs.mixed_precision_policy.reduce_dtype) == \
        (torch.bfloat16, torch.bfloat16)


def _worker(rank: int, port: int, out: str) -> None:
    """One of two gloo ranks: the tiny model sharded per decoder layer with each plugin's policy, one forward
    and backward under bf16 autocast (accelerate's), then what each FSDP unit gathers and reduces, and the
    dtype of the weights generation sees (distributed.full_weights)."""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import fully_shard

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                      ACCELERATE_USE_FSDP="true", FSDP_VERSION="2")
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    found = {}
    for name, plugin in (("ours", distributed.fsdp_plugin()), ("accelerate's", FullyShardedDataParallelPlugin())):
        plugin.set_mixed_precision("bf16")
        model = make_random_model(seed=3).train()
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=plugin.mixed_precision_policy)
        fully_shard(model, mp_policy=plugin.mixed_precision_policy)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=torch.tensor([[5, 6, 7, 8]]), labels=torch.tensor([[5, 6, 7, 8]])).loss
        loss.backward()
        groups = [module._get_fsdp_state()._fsdp_param_group for module in distributed._fsdp2_modules(model)]
        params = [param for group in groups for param in group.fsdp_params]
        with distributed.full_weights(accelerator, model) as plain:
            generated = {p.dtype for p in plain.parameters()}
        found[name] = {
            "gathered": {param.param_dtype or param.orig_dtype for param in params},
            "reduced": {group._reduce_dtype or param.param_dtype or param.orig_dtype for group in groups
                        for param in group.fsdp_params},
            "gradients": {p.grad.dtype for p in model.parameters() if p.grad is not None},
            "generation": generated,
        }
    torch.distributed.barrier()
    if rank == 0:
        Path(out).write_bytes(pickle.dumps(found))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_gather_and_reduce_in_float32_where_accelerates_own_plugin_took_bf16(tmp_path):
    out = tmp_path / "found.pkl"
    mp.spawn(_worker, args=(_free_port(), str(out)), nprocs=2, join=True)
    found = pickle.loads(out.read_bytes())
    f32, bf16 = torch.float32, torch.bfloat16
    assert found["ours"] == {"gathered": {f32}, "reduced": {f32}, "gradients": {f32}, "generation": {f32}}
    # What the 7B config said (float32 gathered, 28.4 GiB per card) was not so before: bf16 both ways.
    assert found["accelerate's"]["gathered"] == found["accelerate's"]["reduced"] == {bf16}
    assert found["accelerate's"]["generation"] == {bf16}
