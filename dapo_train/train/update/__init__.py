"""The update of a step: old log-probs, then mini-batches x passes on the token-level objective.

  old_policy.py  the old log-probs of the policy that sampled (or the rollout's own), and the behaviour
                 policy they rest on
  passes.py      mini-batches x passes, each one optimizer step (Eq. 10, 12)
  batching.py    how completions become micro- and mini-batches (packed rows, the token budget)
  objective.py   the config's policy objective resolved (algo.objectives' registry)
  optim.py       AdamW and the learning-rate schedule
  budget.py      the arithmetic of the update's token budget a card holds (train.micro_batch_tokens=auto)
  card.py        the budget on this run's card at start, vLLM's share checked; a refusal advises what fits
  out_of_memory.py  an update (or a decode) out of memory redone at half the budget on the same groups
"""
