"""Training: the DAPO loop and the stages of one step. loop.py is the only module that knows their order:

  1 collect/               generation rounds until the batch holds informative groups (Eq. 9, 11)
  2 update/old_policy.py   the old log-probs of the policy that sampled (or the rollout's own), and the
                           behaviour policy they rest on
  3 update/                mini-batches x passes, each one optimizer step on the token-level objective
                           (Eq. 10, 12), redone smaller when it runs out of memory
  4 sync                   the rollout engine takes the new weights
  5 log                    progress.py (and run/logs.py); collect/rollout_sample.py: the step's sampled
                           groups, kept or dropped, for the rollout records (run/rollouts.py)

Around the steps: evals.py the evals (greedy, and sampled with eval.samples) and their change from step 0;
summary.py what a run says when it ends. records.py holds the typed records
the stages pass each other, ranks.py everything a step agrees on across processes (the one module of a step
that calls a collective, read by both stages; distributed.py holds the primitives), session.py builds the
objects once (determinism.py: train.deterministic and what it needs on CUDA), state.py saves and restores the
run across checkpoints. health.py and regression.py are the run's own verdicts: a run broken, solved, or making
its model worse than at step 0. memory.py is the memory model (a config's peak on a card, term by term, from the
model's shape alone: generation and update), which update/budget.py and update/card.py read for the update's
token budget (train.micro_batch_tokens=auto); card_memory.py records what the card held each step beside that estimate.
"""
