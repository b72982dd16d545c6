#!/usr/bin/env bash
# The tools study (docs/studies.md, "A calculator during rollouts"): configs/tiny-tools-cpu.yaml from its
# tool-aware warm start, with the calculator (rollout.tools=[calculator]) and without it (rollout.tools=[]),
# seeds 1-5: ten runs, each on one CPU thread, JOBS at a time (default: one per core, at most 10). Extra
# KEY=VALUE arguments go to every run. Then compare them seed by seed:
#
#     bash scripts/studies/tools_study.sh outputs/tools_study
#     dapo-train compare outputs/tools_study --baseline 'tools=[]'
#
# On the project's 2-core machine one run takes 6-9 minutes, so the ten take about 40 (JOBS=2).
# `dapo-train sweep configs/tiny-tools-cpu.yaml 'rollout.tools=[calculator],[]' --seeds 1,2,3,4,5` runs
# the same grid one run after another. CUDA is hidden: the study is of the CPU demo.
set -euo pipefail
dir=${1:-outputs/tools_study}
shift || true
jobs=${JOBS:-$(nproc)}
[ "$jobs" -le 10 ] || jobs=10
mkdir -p "$dir"
for seed in 1 2 3 4 5; do
  for tools in calculator none; do
    list="[$tools]"; [ "$tools" = none ] && list="[]"
    printf '%s\0' "dapo-train run configs/tiny-tools-cpu.yaml seed=$seed 'rollout.tools=$list' $* \
output_dir=$dir/${tools}_seed$seed > $dir/${tools}_seed$seed.log 2>&1 || echo 'failed: $dir/${tools}_seed$seed.log'"
  done
done | CUDA_VISIBLE_DEVICES= xargs -0 -P "$jobs" -I{} sh -c '{}'
