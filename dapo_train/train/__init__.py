"""Training: the DAPO loop and the stages of one step. loop.py is the only module that knows their order:

  1 collect.py     generation rounds until the batch holds informative groups (Eq. 9, 11)
  2 old_policy.py  the old log-probs of the policy that sampled (or the rollout's own), and the
                   behaviour policy they rest on
  3 update.py      mini-batches x passes, each one optimizer step on the token-level objective
                   (Eq. 10, 12); objective.py resolves the config's objective, optim.py steps
  4 sync           the rollout engine takes the new weights
  5 log            progress.py (and run/logs.py); rollout_sample.py: the step's sampled groups, kept
                   or dropped, for the rollout records (run/rollouts.py)

records.py holds the typed records the stages pass each other, batching.py how completions become
micro- and mini-batches, ranks.py everything a step agrees on across processes (the one module of
a step that calls a collective; distributed.py holds the primitives), session.py builds the
objects once, state.py saves and restores the run across checkpoints. health.py and regression.py are
the run's own verdicts: a run broken, solved, or making its model worse than at step 0. memory.py is the memory model (a
config's peak on a card, term by term, from the model's shape alone), budget.py the update's token budget
a card holds (train.micro_batch_tokens=auto) and rollout.vllm_memory's check, out_of_memory.py step 3
redone smaller when it runs out of memory.
"""
