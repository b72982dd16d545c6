#!/usr/bin/env bash
# The prepared CUDA check of the speed levers (about 10 minutes on one H200): bench_step.py at
# Qwen2.5-1.5B dimensions, the seed trainer's batch (2 prompts x G=4, micro-batch 4; docs/peers.md) and
# 16 prompts x G=8 (micro-batch 32), each with the levers off (plain generate on G prompt copies,
# float32 rollout weights, no compile, no shared prefix) and on (the defaults); then the decode step
# against compiled static-cache generate alone, the full-vocabulary token draws (bench_draw.py), the
# rollout/trainer mismatch of each rollout path (bench_mismatch.py: bf16 copy, compiled cache, top-k
# 50), the gpu-marked tests, and where vllm is installed the vLLM rows (bench_vllm.py, a bench_step.py
# step through it, its tests). Paste the JSON lines into docs/benchmarks.md with the machine.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
cd "${HERE%/scripts/bench}"  # the repository root
# One random Qwen-shaped model for every step below (bench_step.model_folder): in DAPO_BENCH_MODEL_CACHE where
# that is set, else in a temporary folder removed at the end.
if [ -z "${DAPO_BENCH_MODEL_CACHE:-}" ]; then
  DAPO_BENCH_MODEL_CACHE="$(mktemp -d)"
  export DAPO_BENCH_MODEL_CACHE
  trap 'rm -rf "$DAPO_BENCH_MODEL_CACHE"' EXIT
fi
OFF="rollout.engine=hf-generate rollout.dtype=float32 rollout.compile=off train.shared_prefix=off"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for batch in "--prompts-per-step 2 --group-size 4 --micro-batch-size 4" \
             "--prompts-per-step 16 --group-size 8 --micro-batch-size 32"; do
  # shellcheck disable=SC2086
  python scripts/bench/bench_step.py --steps 3 $batch --set $OFF | tail -1
  # shellcheck disable=SC2086
  python scripts/bench/bench_step.py --steps 3 $batch | tail -1
done
python scripts/bench/bench_decode.py --batch 8 128 --repeats 3 | tail -2
# The full-vocabulary draws (ms per decode step's draw, 64 rows x 151,936): the inverse-CDF draw is taken on
# the CPU only (rollout/sampling.py FULL_VOCABULARY_DRAWS); add "cuda" there if it wins here too.
python scripts/bench/bench_draw.py --device cuda | tail -1
python scripts/bench/bench_mismatch.py | tail -5   # rollout_kl etc. of each rollout path against the training forward
python -m pytest -m gpu -q tests/test_gpu.py tests/rollout/test_draw.py  # these two hold the gpu marks; naming them spares collecting tests that import trl
# rollout.engine=vllm where vllm is installed (docs/vllm.md): hf against vllm at equal work on the Qwen shape, one
# step of the seed trainer's batch through it, and the vllm-marked tests on the card.
if python -c "import vllm" 2>/dev/null; then
  python scripts/bench/bench_vllm.py --shape qwen1.5b --prompts 16 --group-size 8 --new-tokens 128 --repeats 3 | tail -1
  python scripts/bench/bench_step.py --steps 3 --prompts-per-step 16 --group-size 8 --micro-batch-size 32 \
    --set rollout.engine=vllm | tail -1
  python -m pytest -m vllm -q tests/rollout/test_vllm_engine.py tests/rollout/test_vllm_tools.py tests/test_train_vllm.py
else
  echo "vllm rows skipped: vllm is not installed (pip install 'dapo-train[vllm]')"
fi
