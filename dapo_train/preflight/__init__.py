"""Preflight: the config's own pipeline rehearsed in about a minute on any machine, before GPU hours are
spent on it, on a small random model that has the real model's architecture, vocabulary and tokens.

command.py       `dapo-train preflight`: the phases in order; the rollout check, train, resume and export
report.py        the report's lines, each phase timed with its failure named, the warnings collected once
real_run.py      the config's real model and data, read without weights; a tool call; memory and disk
rehearsal.py     the rehearsal model (biased to stop at each EOS id) and the config shrunk to run fast
tool_check.py    a tool call through the rollout's code at the run's chat template
export_check.py  the export of the rehearsal's last checkpoint against the trained tensors
coverage.py      what the rehearsal ran and what it did not, for the report's last two rows

The memory estimate it prints is train/memory.py's (the run sizes its budget by it too: train/update/budget.py).
"""
