"""A rollout engine defined outside the package, named in a config as 'engine_plugin:CountingEngine':
it wraps the built-in loop and records what the trainer asks of it."""

from dapo_train.rollout import DecodeLoopEngine, EngineSetup

CALLS: list[str] = []


class CountingEngine(DecodeLoopEngine):
    def __init__(self, setup: EngineSetup) -> None:
        super().__init__(setup)
        CALLS.clear()

    def generate(self, prompts, settings, group_size):
        CALLS.append(f"generate {len(prompts)}x{group_size}")
        return super().generate(prompts, settings, group_size)

    def sync_weights(self) -> None:
        CALLS.append("sync")
        super().sync_weights()


class EvalServingEngine(DecodeLoopEngine):
    """An engine evals generate through (as vllm's do): `dapo-train eval` names its results by it."""

    serves_eval = True
