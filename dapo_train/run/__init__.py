"""The run folder and what a run writes into it, below the training loop: logs, trackers, per-item
records, atomic files, where a run starts or resumes, whether its checkpoints fit on the disk, and the
signals that stop it gracefully.

folder.py      which folder a run writes, what --resume continues, which run is the latest
disk_space.py  a checkpoint's size and how many a run holds at once, against the free space
logs.py        metrics.jsonl and the two text logs, split at a resumed step; run.log, what the run said
trackers.py    TensorBoard, W&B and the others through accelerate; the no-op tracker
eval_items.py  per-item eval records (eval_items/), so runs compare item by item
rollouts.py    rollout records (rollouts/): what the policy wrote in training, each reward, the fate
files.py       JSON and JSON Lines written atomically; the JSON Lines reader
signals.py     SIGINT/SIGTERM: finish the step, save, say how to resume
console.py     log lines printed once; a console that cannot be written (`| tee` ended by the same Ctrl-C)
               never stops the run
"""
