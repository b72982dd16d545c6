"""Evaluation: a model's accuracy on fixed items with its uncertainty, pass@k and maj@k, and the
statistics that compare two evaluations of the same items.

generate.py  generate and grade: one record per completion (the trainer's evals and `dapo-train eval`)
stats.py     accuracy (strict and answer), standard error, Wilson interval, pass@k, maj@k; paired bootstrap,
             McNemar, t; an eval's change from its run's step 0
command.py   `dapo-train eval CHECKPOINT...`: resolve, check, evaluate, write, compare
table.py     rows of text cells as the aligned table eval and compare print; eval's table
"""
