"""Studies over many runs, reading only their folders: grids of runs, tables, paired comparisons, plots.

sweep.py    `dapo-train sweep`: a grid of runs of one config, trained one after another, resumable
runs.py     run folders and sweep folders read back, runs grouped into points
compare.py  `dapo-train compare`: points side by side; `--baseline` with paired intervals
plot.py     `dapo-train plot`: the metrics over steps, one colour per point
show.py     `dapo-train show`: one run's rollout records, what the policy wrote and why it scored so
"""
