"""The collect stage of a step: generation rounds until the batch holds informative groups (Eq. 9, 11).

  rounds.py            fill_batch: rounds of prompts x G, the group buffer that carries surplus groups over
  screen.py            a few samples per prompt first, the rest only for prompts that may be informative
  history.py           each prompt's last all-alike side across epochs (dapo.skip_history)
  generation_stats.py  what the rounds generated and kept, for the step's metrics
  rollout_sample.py    the step's sampled groups, kept or dropped, for the rollout records
"""
