"""A policy objective outside the package, for the tests (dapo.policy_loss=objective_plugin:reinforce)."""


def reinforce(logprobs, old_logprobs, advantages, valid, settings):
    """Plain REINFORCE: -A * log pi per token, no ratio and no clip."""
    return -advantages * logprobs, {}
