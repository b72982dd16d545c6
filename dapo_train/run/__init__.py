"""The run folder and what a run writes into it, below the training loop: the rule that keeps every
command's output folder off what the user owns, checkpoints, logs, trackers, per-item records, atomic
files, where a run starts or resumes, whether its checkpoints fit on the disk, and the signals that stop
it gracefully.

outputs.py     the folders a command may write into or replace (run, sweep, preflight --keep, export -o)
layout.py      what a run writes in its folder, by exact name: its marker, files, checkpoints and records
folder.py      which folder a run writes, what --resume continues, which run is the latest
checkpoint.py  checkpoint_<step>/ on disk: atomic save, discovery, pruning, the state files, the best one
export.py      `dapo-train export`: a checkpoint as a folder other tools load
lock.py        one command at a time in a folder
config_changes.py  every change to a resumed run's config, named
disk_space.py  a checkpoint's size and how many a run holds at once, against the free space
logs.py        metrics.jsonl and the two text logs, split at a resumed step; run.log, what the run said
trackers.py    TensorBoard, W&B and the others through accelerate; the no-op tracker
eval_items.py  per-item eval records (eval_items/), so runs compare item by item
rollouts.py    rollout records (rollouts/): what the policy wrote in training, each reward, the fate
files.py       JSON and JSON Lines written atomically; the JSON Lines reader
signals.py     SIGINT/SIGTERM/SIGHUP: finish the step, save, say how to resume
console.py     log lines printed once; a console that cannot be written (`| tee` ended by the same Ctrl-C)
               never stops the run
"""
