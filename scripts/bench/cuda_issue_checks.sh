#!/usr/bin/env bash
# Issues 41 and 42 on CUDA (a minute or two on one H200; run after bench_cuda.sh): the calculator in the
# CUDA rollout (the decode loop over the bf16 copy, tool turns forced while the other rows sample) for 3
# steps of configs/tiny-tools-cpu.yaml, and screening against none for 6 steps of configs/tiny-cpu.yaml
# (dapo.screen_size=2 ruling out all-wrong screens, the study's best setting), each printing its
# end-of-run summary (generated tokens per trained token, tool calls). Outputs go to a temporary folder.
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
