"""What preflight says of the real run without loading it (preflight/real_run.py): auto's choice on each card size
says why none fits and when it is a whole mini-batch."""

from pathlib import Path
from types import SimpleNamespace

from transformers import AutoConfig

from dapo_train.config.load import load_config
from dapo_train.preflight.real_run import memory_estimate
from dapo_train.train.memory import ModelShape

import qwen_offline

ROOT = Path(__file__).resolve().parents[2]


def test_the_memory_row_says_why_24_gb_holds_no_budget_and_that_48_and_80_gb_hold_a_whole_mini_batch(tmp_path):
    """Issue 59 (item 16). qwen1.5b.yaml, a longest prompt of 211 tokens: on 24 GB the optimizer step moment (18 bytes
    x 1,543,714,304 parameters = 25.9 GiB: float32 weights 4, AdamW's moments 8, the bf16 rollout copy 2, gradients
    4; one process on a card steps AdamW fused, with no temporaries) is over 21.6e9 usable; on 48 and 80 GB the
    whole mini-batch, 2 groups x (8 x 512 + 211) = 8,614 tokens rounded up to 9,216."""
    qwen_offline.write_model_configs(tmp_path, "1.5b")
    cfg = load_config(str(ROOT / "configs" / "qwen1.5b.yaml"), [f"model.name_or_path={tmp_path}"])
    shape = ModelShape.from_config(AutoConfig.from_pretrained(tmp_path), cfg.model.lora)
    said = memory_estimate(cfg, shape, [SimpleNamespace(input_ids=[0] * 211)], 1)
    assert said.endswith("24 GB none fits (the optimizer step moment alone: 25.9 GiB), 48 GB 9,216 (a whole "
                         "mini-batch), 80 GB 9,216 (a whole mini-batch)"), said
