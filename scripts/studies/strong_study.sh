#!/usr/bin/env bash
# What a recipe does to a strong start (docs/studies.md, "A strong start"): configs/tiny-strong-cpu.yaml
# (builtin:tiny-strong, 0.646 strict on the 500 test items) under the demo's recipe (BASE, passed before each
# recipe's change: lr 1e-4, 40 steps, an eval of 100 items every 10, greedy only; the config itself now ships
# what this study found) and one change at a time,
# seeds 1-5, each run on one CPU thread, JOBS at a time (default: one per core), the recipes' order rotated from
# seed to seed so that a machine's load falls on every recipe alike:
#
#   demo     the demo's recipe as shipped (lr 1e-4, 8 updates per step, G=8, eps_high 0.28, beta 0)
#   lr0.3    train.learning_rate=3e-5        lr0.1   train.learning_rate=1e-5
#   upd1     train.updates_per_step=1 (one on-policy update per step: the clip cannot act)
#   kl       dapo.beta=1e-3 (k3 KL to the frozen start)
#   eps0.2   dapo.eps_high=0.2 (no clip-higher)
#   g16      rollout.group_size=16
#   lora     model.lora.r=8 train.learning_rate=3e-4 (the LoRA setting docs/lora.md measured on the demo)
#   lr10     train.learning_rate=1e-3: a run made to get worse, for the regression warning (not in the default set;
#            RECIPES=lr10 SEEDS="1 2")
#
# First the start itself, greedy on all 500 test items (start/), which every run's final eval is paired with:
#
#     bash scripts/studies/strong_study.sh outputs/strong_study
#     python scripts/studies/strong_table.py outputs/strong_study
#
# The tool model's strong start (builtin:tiny-tools, 0.924 with the calculator) the same way, in a folder of its
# own: CONFIG=configs/tiny-tools-cpu.yaml RECIPES="demo lr0.1" bash scripts/studies/strong_study.sh outputs/tools_start
#
# Longer horizons (issue 60; docs/studies.md, "A strong start over longer horizons"): HORIZONS="40 200 500" trains
# each recipe and seed as one run in legs, to step 40, then --resume to 200 and to 500 (a constant learning rate
# and no warmup, as the config has, so the legs are one run: tests/train/test_evals.py), and
# evaluates the last step of each leg greedily and with SAMPLES (default 8) samples per item (eval.samples) on
# EVAL_ITEMS (default 0: all 500) test items, paired with the run's own step 0; no other eval (eval.every_steps
# is the last horizon), and the end-of-run eval reuses the leg's last one. Its table: strong_horizons.py.
#
#     HORIZONS="40 200 500" RECIPES="lr0.1 lr0.3 lora" bash scripts/studies/strong_study.sh outputs/strong_horizons
#     python scripts/studies/strong_horizons.py outputs/strong_horizons
#
# A run that finished (its .time file holds no "Command exited" line) is not run again, so an interrupted
# study resumes where it stopped; rerun a failed one after removing its folder (a failed later leg: rerun the
# study, the leg resumes from the run's last checkpoint). Each run's `/usr/bin/time` line (user s, system s,
# wall s) is the last line of its .time file (with HORIZONS, of each leg's RECIPE_seedN.to<H>.time). CUDA is
# hidden: the study is of the CPU demo. RECIPES picks some (default: all); SEEDS others (default: 1 2 3 4 5);
# CONFIG another start.
set -euo pipefail
dir=${1:-outputs/strong_study}
jobs=${JOBS:-$(nproc)}
[ "$jobs" -le 10 ] || jobs=10
recipes=(${RECIPES:-demo lr0.3 lr0.1 upd1 kl eps0.2 g16 lora})
mkdir -p "$dir"
config=${CONFIG:-configs/tiny-strong-cpu.yaml}
base=${BASE-train.learning_rate=1e-4 train.max_steps=40 eval.every_steps=10 eval.num_items=100 eval.samples=0}

if ! compgen -G "$dir/start/eval_test*.json" > /dev/null; then  # the start, greedy on the whole test split: one eval
  rm -rf "$dir/start"
  CUDA_VISIBLE_DEVICES= dapo-train eval --config "$config" $base "output_dir=$dir/start.run" train.num_threads=1 \
    logging.progress_bar=false > "$dir/start.log" 2>&1
  mv "$dir"/start.run.eval/* "$dir/start" && rmdir "$dir/start.run.eval"  # the one model evaluated
fi

args() {
  case $1 in
    demo) echo "" ;;
    lr0.3) echo "train.learning_rate=3e-5" ;;
    lr0.1) echo "train.learning_rate=1e-5" ;;
    upd1) echo "train.updates_per_step=1" ;;
    kl) echo "dapo.beta=1e-3" ;;
    eps0.2) echo "dapo.eps_high=0.2" ;;
    g16) echo "rollout.group_size=16" ;;
    lora) echo "model.lora.r=8 train.learning_rate=3e-4" ;;
    lr10) echo "train.learning_rate=1e-3" ;;
    *) echo "unknown recipe $1" >&2; exit 2 ;;
  esac
}

finished() {  # the leg or run whose time file is $1 finished
  [ -s "$1" ] && ! grep -q '^Command' "$1"
}

legs() {  # one run (recipe $1, seed $2, folder $3) in legs to each of HORIZONS, each leg's command after the last
  local first=1 chain="" h evals
  horizons=($HORIZONS)
  evals="eval.every_steps=${horizons[-1]} eval.num_items=${EVAL_ITEMS:-0} eval.samples=${SAMPLES:-8}"
  for h in "${horizons[@]}"; do
    if [ $first = 1 ]; then
      leg="dapo-train run $config $base $(args "$1") seed=$2 train.max_steps=$h $evals output_dir=$3"
    else
      leg="dapo-train run --resume $3 train.max_steps=$h"
    fi
    first=0
    finished "$3.to$h.time" && continue
    chain+="/usr/bin/time -f '%U %S %e' -o $3.to$h.time $leg logging.progress_bar=false >> $3.log 2>&1 && "
  done
  [ -n "$chain" ] && printf '%s\0' "${chain}true || echo 'failed: $3.log'"
  return 0
}

for seed in ${SEEDS:-1 2 3 4 5}; do
  n=${#recipes[@]}
  for ((i = 0; i < n; i++)); do
    recipe=${recipes[$(((i + seed - 1) % n))]}
    out=$dir/${recipe}_seed$seed
    if [ -n "${HORIZONS:-}" ]; then
      legs "$recipe" "$seed" "$out"
      continue
    fi
    finished "$out.time" && continue
    printf '%s\0' "/usr/bin/time -f '%U %S %e' -o $out.time dapo-train run $config $base $(args "$recipe") seed=$seed \
logging.progress_bar=false output_dir=$out > $out.log 2>&1 || echo 'failed: $out.log'"
  done
done | CUDA_VISIBLE_DEVICES= xargs -0 -r -P "$jobs" -I{} sh -c '{}'
