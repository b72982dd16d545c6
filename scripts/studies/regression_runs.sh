#!/usr/bin/env bash
# The regression stop on real runs (docs/studies.md, "The regression stop"): configs/tiny-strong-cpu.yaml
# (builtin:tiny-strong, 0.66 on the 100 eval items) with eval.stop_on_regression on and an eval every 2 steps of
# 40 (20 periodic evals: the bound is 0.01 / 40 = 2.5e-4, 12 items lost and none gained), from the demo's recipe
# (lr 1e-4, 40 steps, greedy evals: passed first, the config now ships another), one run at a time on one
# torch thread, no eval of the whole split at the end:
#
#   flat    train.learning_rate=1e-5 (a tenth of the demo's: the strong-start study found it keeps the start)
#   demo    the demo's rate, 1e-4 (lowers the start by about 7 points on 500 items)
#   lr3x    train.learning_rate=3e-4: between the demo and a collapse
#   bad     train.learning_rate=1e-3: a run made to get worse (the start collapses)
#
#     bash scripts/studies/regression_runs.sh outputs/regression_runs
#     python scripts/studies/regression_sim.py --runs-dir outputs/regression_runs   # their table
#
# The 8 runs took 9.3 min of CPU (the flat and demo ones about 2 min each, the others stop within 4 steps).
# A run whose .time file holds its time line is not run again. RECIPES and SEEDS pick others (default: all, 1 2);
# EVERY another eval cadence.
set -euo pipefail
dir=${1:-outputs/regression_runs}
mkdir -p "$dir"
every=${EVERY:-2}

args() {
  case $1 in
    flat) echo "train.learning_rate=1e-5" ;;
    demo) echo "" ;;
    lr3x) echo "train.learning_rate=3e-4" ;;
    bad) echo "train.learning_rate=1e-3" ;;
    *) echo "unknown recipe $1" >&2; exit 2 ;;
  esac
}

for seed in ${SEEDS:-1 2}; do
  for recipe in ${RECIPES:-bad flat demo lr3x}; do
    out=$dir/${recipe}_seed$seed
    [ -s "$out.time" ] && ! grep -q '^Command exited with non-zero status [^6]' "$out.time" && continue
    # shellcheck disable=SC2046  # the recipe's overrides are separate words
    CUDA_VISIBLE_DEVICES= /usr/bin/time -f '%U %S %e' -o "$out.time" dapo-train run configs/tiny-strong-cpu.yaml \
      train.learning_rate=1e-4 train.max_steps=40 eval.samples=0 $(args "$recipe") seed="$seed" eval.every_steps="$every" eval.stop_on_regression=true eval.final_full=false \
      train.num_threads=1 logging.progress_bar=false output_dir="$out" > "$out.log" 2>&1 || true  # 6: it stopped
  done
done
