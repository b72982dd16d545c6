"""The task: where models and data sets are, data sets -> Prompt records, and what a correct answer is.
Imports no model code: a tokenizer is passed in.

locations.py  `builtin:` names, local paths and Hub ids for models and data sets; the Hub probe
sources.py    `data.path` -> one datasets.Dataset per split (Hub, folder, file, builtin)
prompts.py    a split -> Prompt records under the chat template, dropped (never cut) past the budget
answers.py    answer extraction and equivalence; the task's check (data.correctness)
"""
