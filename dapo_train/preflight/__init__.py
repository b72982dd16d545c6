"""Preflight: the config's own pipeline rehearsed in about a minute on any machine, before GPU hours are
spent on it, on a small random model that has the real model's architecture, vocabulary and tokens.

rehearsal.py  the rehearsal model (biased to stop at each EOS id) and the config shrunk to run fast
command.py    `dapo-train preflight`: read, data, rollout check, train, resume, export, memory; the report
memory.py     the real model's peak memory on the card, term by term, from its shape alone
"""
