#!/usr/bin/env bash
# The prepared CUDA check of the speed levers (about 10 minutes on one H200): bench_step.py at
# Qwen2.5-1.5B dimensions, the seed trainer's batch (2 prompts x G=4, micro-batch 4; docs/peers.md) and
# 16 prompts x G=8 (micro-batch 32), each with the levers off (plain generate on G prompt copies,
# float32 rollout weights, no compile, no shared prefix) and on (the defaults); then the decode step
# against compiled static-cache generate alone, the full-vocabulary token draws (bench_draw.py), the
# rollout/trainer mismatch of each rollout path (bench_mismatch.py: bf16 copy, compiled cache, top-k
# 50), the gpu-marked tests, and where vllm is installed the vLLM rows (bench_vllm.py, a bench_step.py
# step through it, its tests on the card). Paste the JSON lines into docs/benchmarks.md with the machine.
#
# Every check runs, whatever the others did (no `set -e`), and ends in one verdict line: PASS <name>,
# FAIL <name> (exit N) or SKIP <name> (why); a summary of them closes the script, which exits 1 when any
# check failed. PASS means the check ran through (a measurement printed its figures; tests passed).
#   bash scripts/bench/bench_cuda.sh             # on the card
#   bash scripts/bench/bench_cuda.sh --dry-run   # anywhere: every check's name and command, run none
set -uo pipefail  # no -e: a failed check says so and the next one runs
HERE="$(cd "$(dirname "$0")" && pwd)"
cd "${HERE%/scripts/bench}"  # the repository root
DRY=0
case "${1:-}" in
  --dry-run) DRY=1 ;;
  "") ;;
  *) echo "usage: bash scripts/bench/bench_cuda.sh [--dry-run]" >&2; exit 2 ;;
esac
VERDICTS=()
NO_CARD=""  # set when the card check failed: every later check is skipped, saying so

verdict() {  # verdict PASS|FAIL|SKIP NAME [DETAIL]: one line now, kept for the summary
  local line="$1 $2${3:+ ($3)}"
  echo "$line"
  VERDICTS+=("$line")
}

check() {  # check NAME COMMAND...: runs the command (its output shown), then its verdict
  local name=$1
  shift
  if [ "$DRY" = 1 ] || [ -n "$NO_CARD" ]; then
    verdict SKIP "$name" "${NO_CARD:-dry run: $*}"
    return
  fi
  echo "== $name"
  local started=$SECONDS status=0
  "$@" || status=$?
  if [ "$status" = 0 ]; then
    verdict PASS "$name" "$((SECONDS - started)) s"
  else
    verdict FAIL "$name" "exit $status after $((SECONDS - started)) s"
  fi
}

skip() {  # skip NAME WHY: a check that cannot run here
  verdict SKIP "$1" "$2"
}

# One random Qwen-shaped model for every step below (bench_step.model_folder): in DAPO_BENCH_MODEL_CACHE where
# that is set, else in a temporary folder removed at the end.
if [ -z "${DAPO_BENCH_MODEL_CACHE:-}" ] && [ "$DRY" = 0 ]; then
  DAPO_BENCH_MODEL_CACHE="$(mktemp -d)"
  export DAPO_BENCH_MODEL_CACHE
  trap 'rm -rf "$DAPO_BENCH_MODEL_CACHE"' EXIT
fi
OFF="rollout.engine=hf-generate rollout.dtype=float32 rollout.compile=off train.shared_prefix=off"
SEED_BATCH="--prompts-per-step 2 --group-size 4 --micro-batch-size 4"
BIG_BATCH="--prompts-per-step 16 --group-size 8 --micro-batch-size 32"

card() { nvidia-smi --query-gpu=name,memory.total --format=csv,noheader && python -c "import torch
assert torch.cuda.is_available(), 'torch sees no CUDA device'
print(torch.cuda.get_device_name(), torch.__version__)"; }
step() { python scripts/bench/bench_step.py --steps 3 "$@" | tail -1; }
decode() { python scripts/bench/bench_decode.py --batch 8 128 --repeats 3 | tail -2; }
# The full-vocabulary draws (ms per decode step's draw, 64 rows x 151,936): the inverse-CDF draw is taken on
# the CPU only (rollout/sampling.py FULL_VOCABULARY_DRAWS); add "cuda" there if it wins here too.
draw() { python scripts/bench/bench_draw.py --device cuda | tail -1; }
mismatch() { python scripts/bench/bench_mismatch.py | tail -5; }  # rollout_kl etc. of each path against training
# The two files that hold the gpu marks; naming them spares collecting tests that import trl.
gpu_tests() { python -m pytest -m gpu -q -rA tests/test_gpu.py tests/rollout/test_draw.py; }
vllm_bench() {
  python scripts/bench/bench_vllm.py --shape qwen1.5b --prompts 16 --group-size 8 --new-tokens 128 --repeats 3 \
    | tail -1
}
# The vllm-marked tests on the card: their engine built from a CUDA model as a run builds it, their bounds a bf16
# engine's (tests/vllm_bounds.py).
vllm_tests() {
  python -m pytest -m vllm -q -rA tests/rollout/test_vllm_engine.py tests/rollout/test_vllm_tools.py \
    tests/test_train_vllm.py
}

check "card: nvidia-smi and torch see it" card
[[ "${VERDICTS[-1]}" == FAIL* ]] && NO_CARD="no CUDA device: the card check failed"
# shellcheck disable=SC2086
check "bench_step: seed batch, levers off" step $SEED_BATCH --set $OFF
# shellcheck disable=SC2086
check "bench_step: seed batch, levers on" step $SEED_BATCH
# shellcheck disable=SC2086
check "bench_step: 16 x G=8, levers off" step $BIG_BATCH --set $OFF
# shellcheck disable=SC2086
check "bench_step: 16 x G=8, levers on" step $BIG_BATCH
check "bench_decode: the decode step against compiled static-cache generate" decode
check "bench_draw: the full-vocabulary draws on CUDA" draw
check "bench_mismatch: each rollout path against the training forward" mismatch
check "gpu tests (tests/test_gpu.py, tests/rollout/test_draw.py)" gpu_tests
# rollout.engine=vllm where vllm is installed (docs/vllm.md): hf against vllm at equal work on the Qwen shape,
# one step of the 16 x G=8 batch through it, and the vllm-marked tests on the card.
if [ "$DRY" = 1 ] || python -c "import vllm" 2>/dev/null; then
  check "bench_vllm: hf against vllm at the Qwen shape" vllm_bench
  # shellcheck disable=SC2086
  check "bench_step: 16 x G=8 through vllm" step $BIG_BATCH --set rollout.engine=vllm
  check "vllm tests on the card" vllm_tests
else
  for name in "bench_vllm: hf against vllm at the Qwen shape" "bench_step: 16 x G=8 through vllm" \
              "vllm tests on the card"; do
    skip "$name" "vllm is not installed: pip install 'dapo-train[vllm]'"
  done
fi
# Later card-only checks go here, one `check NAME COMMAND...` line each (a function above, or a script of
# their own under scripts/bench/), so that each gets its verdict and the summary counts it.
# Issue 58: a decode casts each weight at most once per generate call and the LM head once per update call, on the
# card (bench_casts.py --check, the demo under bf16 autocast with the bf16 copy: compiled rollout, eval, update);
# the out-of-memory guard's tests with the card's allocator, fused AdamW and its empty_cache.
casts() { python scripts/bench/bench_casts.py --check | tail -9; }
oom_tests() { python -m pytest -q -rA tests/train/update/test_out_of_memory.py tests/rollout/test_fitting.py; }
check "bench_casts: weight casts per forward by phase on the card" casts
check "out-of-memory tests on the card (faults injected where a card raises them)" oom_tests

echo "== summary"
passed=0 failed=0 skipped=0
for line in "${VERDICTS[@]}"; do
  echo "$line"
  case "$line" in PASS*) passed=$((passed + 1)) ;; FAIL*) failed=$((failed + 1)) ;; *) skipped=$((skipped + 1)) ;; esac
done
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" = 0 ]
