#!/usr/bin/env bash
# The selective-rollout studies that follow the demo screening study (docs/studies.md, "Selective
# rollouts: history, the long task, round sizing"), seeds 1-5, each run on one CPU thread, JOBS at a
# time (default: one per core), the settings' order rotated from seed to seed so that a machine's load
# falls on every setting alike. PART picks what runs (default: all three):
#
#   history  configs/tiny-cpu.yaml on the first 200 training prompts of builtin:tiny-zh-math (the
#            whole test split kept for eval), so a run draws each prompt 3-5 times and the history can
#            act: off, a screen of 2 on the all-wrong side, dapo.skip_history, both, and both with
#            dapo.max_round_prompts=32 (25 runs)
#   long     configs/tiny-long-cpu.yaml: off, a screen of 2 on the all-wrong side (10 runs)
#   rounds   configs/tiny-cpu.yaml, with and without dapo.max_round_prompts=32: off, a screen of 2 on
#            the all-wrong side (20 runs; on a quiet machine, unlike the first demo study)
#
#     bash scripts/studies/selective_study.sh outputs/selective_study
#     python scripts/studies/selective_table.py outputs/selective_study/history --baseline off
#     cd outputs/selective_study && dapo-train compare history/*_seed? --baseline history/off_seed1
#
# and the same for long/ and rounds/ (rounds: --baseline off8, the demo as shipped).
#
# A run that finished (its .time file holds no "Command exited" line) is not run again, so an
# interrupted study resumes where it stopped; rerun a failed one after removing its folder. Each run's
# `/usr/bin/time` line (user s, system s, wall s) is the last line of its .time file. CUDA is hidden:
# the study is of the CPU demo.
set -euo pipefail
dir=${1:-outputs/selective_study}
parts=${PART:-history long rounds}
jobs=${JOBS:-$(nproc)}
[ "$jobs" -le 10 ] || jobs=10
mkdir -p "$dir"

small=$dir/history/data
if [[ " $parts " == *" history "* ]] && [ ! -s "$small/train.jsonl" ]; then
  mkdir -p "$small"
  full=$(python -c "from dapo_train.task.locations import resolve_data_path as r; print(r('builtin:tiny-zh-math'))")
  head -n 200 "$full/train.jsonl" > "$small/train.jsonl"
  cp "$full/test.jsonl" "$small/test.jsonl"
fi

screen="dapo.screen_size=2 'dapo.screen_drop=[all_wrong]'"
# One line per run: the folder (under $dir), then the run's arguments.
runs() {
  local seed=$1 part=$2
  case $part in
    history)
      local data="configs/tiny-cpu.yaml data.path=$small"
      echo "history/off_seed$seed $data"
      echo "history/s2w_seed$seed $data $screen"
      echo "history/hist_seed$seed $data dapo.skip_history=true"
      echo "history/both_seed$seed $data dapo.skip_history=true $screen"
      echo "history/bothr_seed$seed $data dapo.skip_history=true $screen dapo.max_round_prompts=32" ;;
    long)
      echo "long/off_seed$seed configs/tiny-long-cpu.yaml"
      echo "long/s2w_seed$seed configs/tiny-long-cpu.yaml $screen" ;;
    rounds)
      echo "rounds/off_seed$seed configs/tiny-cpu.yaml dapo.max_round_prompts=32"
      echo "rounds/s2w_seed$seed configs/tiny-cpu.yaml dapo.max_round_prompts=32 $screen"
      echo "rounds/off8_seed$seed configs/tiny-cpu.yaml"
      echo "rounds/s2w8_seed$seed configs/tiny-cpu.yaml $screen" ;;
  esac
}

for seed in 1 2 3 4 5; do
  for part in $parts; do
    mapfile -t lines < <(runs "$seed" "$part")
    n=${#lines[@]}
    for ((i = 0; i < n; i++)); do
      line=${lines[$(((i + seed - 1) % n))]}
      name=${line%% *} args=${line#* }
      out=$dir/$name
      [ -s "$out.time" ] && ! grep -q '^Command' "$out.time" && continue
      mkdir -p "$(dirname "$out")"
      printf '%s\0' "/usr/bin/time -f '%U %S %e' -o $out.time dapo-train run $args seed=$seed output_dir=$out \
> $out.log 2>&1 || echo 'failed: $out.log'"
    done
  done
done | CUDA_VISIBLE_DEVICES= xargs -0 -r -P "$jobs" -I{} sh -c '{}'
