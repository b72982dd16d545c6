#!/usr/bin/env bash
# Issues 41, 42 and 54 on CUDA (about 10 minutes on one H200; run after bench_cuda.sh): the calculator in the
# CUDA rollout (the decode loop over the bf16 copy, tool turns forced while the other rows sample) for 3
# steps of configs/tiny-tools-cpu.yaml, and screening against none for 6 steps of configs/tiny-cpu.yaml
# (dapo.screen_size=2 ruling out all-wrong screens, the study's best setting), each printing its
# end-of-run summary (generated tokens per trained token, tool calls). Then issue 54's memory checks
# (docs/training.md#memory): train.micro_batch_tokens=auto's line (its estimated peak) against the measured
# peak at the Qwen2.5-1.5B shape; a real out-of-memory update redone smaller; the
# out-of-memory tests on the card. Outputs go to a temporary folder.
set -uo pipefail  # no -e: a failed check prints its error and the next one still runs
HERE="$(cd "$(dirname "$0")" && pwd)"
cd "${HERE%/scripts/bench}"  # the repository root
tmp=$(mktemp -d)
short="eval.every_steps=0 eval.final_full=false logging.progress_bar=false"
timed() { local t0=$SECONDS; "$@"; echo "  wall $((SECONDS - t0)) s"; }
summary() { grep -E "^  (wall|generation|update work|tools|final|skipped)|ready|aborted|Error|error" || true; }
echo "== tools on CUDA: configs/tiny-tools-cpu.yaml, 3 steps"
# shellcheck disable=SC2086
timed dapo-train run configs/tiny-tools-cpu.yaml train.max_steps=3 \
  $short output_dir="$tmp/tools" 2>&1 | summary
python -c 'import json, sys
for line in open(sys.argv[1]):
    row = json.loads(line)
    print("  step", row.get("step"), {k: v for k, v in row.items() if k.startswith("tool")})' "$tmp/tools/metrics.jsonl"
for screen in 0 2; do
  echo "== screening on CUDA: configs/tiny-cpu.yaml, 6 steps, dapo.screen_size=$screen"
  # shellcheck disable=SC2086
  timed dapo-train run configs/tiny-cpu.yaml train.max_steps=6 seed=1 \
    dapo.screen_size=$screen 'dapo.screen_drop=[all_wrong]' $short output_dir="$tmp/screen$screen" 2>&1 | summary
done
echo "== issue 54: train.micro_batch_tokens=auto at the Qwen2.5-1.5B shape (its line: the estimated peak; then measured)"
python scripts/bench/bench_step.py --steps 2 --prompts-per-step 16 --group-size 8 --max-new-tokens 256 \
  --set train.micro_batch_tokens=auto train.updates_per_step=4 2>&1 | grep -E "micro_batch_tokens=auto|peak_cuda|Error"
echo "== issue 54: an update out of memory on the card (checkpointing off, a 131,072-token mini-batch): halved until it fits"
python scripts/bench/bench_step.py --steps 2 --prompts-per-step 64 --group-size 16 --max-new-tokens 128 \
  --set train.micro_batch_tokens=131072 model.gradient_checkpointing=off train.updates_per_step=1 2>&1 \
  | grep -E "out of memory|micro_batches|peak_cuda|Error"
echo "== issue 58: the weight casts per forward by phase on the card (an eval decode forward casts none)"
python scripts/bench/bench_casts.py | tail -8
echo "== issue 54: the out-of-memory tests on the card (faults injected; CUDA's random state, empty_cache)"
python -m pytest -q tests/train/update/test_out_of_memory.py tests/rollout/test_fitting.py
