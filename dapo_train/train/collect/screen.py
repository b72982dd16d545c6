"""Stages 2 and 3 of a round (rounds.py): its completions, generated and scored per prompt; with
dapo.screen_size k > 0, screened first.

Screening (SPEED, arXiv 2506.09016) moves part of Eq. 11's decision before most of the generation: a
round first samples k completions of every prompt; a prompt whose k are all correct or all wrong
(dapo.screen_drop says which side rules a prompt out) gets no more, and the others are completed to G
with G - k further samples. The k screening completions stay in the group: both calls sample the
same policy (no update runs between them) with the same settings, so each of a completed group's G
completions is a draw of the policy, and Eq. 9 and Eq. 11 run on all G. The kept groups are not those
of no screen, though: only groups whose first k were mixed are kept (ruling out both sides), so at a
pass rate of 0.1, G = 8, k = 2 they hold 1.60 right answers on average against 1.40, and Eq. 9 gives
each right answer less (docs/training.md, Screening, has the table over pass rates).

Exact as if at once, draw for draw, where the engine keys its draws (an engine with `keyed_draws`:
the decode loop); with screening on, completion j of the n-th prompt the run draws comes from its own random stream,
seeded by (seed, n, j) (row_seeds), so which call sampled it, and what else was in the batch, does
not change its tokens. An engine without keyed draws samples from the global stream: the completed
groups are then still G independent draws of the policy, only not the same ones.

What a screen costs (docs/training.md, Screening): a prompt ruled out at k might have been
informative at G. With pass rate p, a screen of k is all wrong with probability (1-p)^k and the
group it cut would have held a correct completion with probability 1 - (1-p)^(G-k).
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from dapo_train.config.schema import Config
from dapo_train.rewards.scoring import score
from dapo_train.rollout.completions import Completion
from dapo_train.rollout.engines import RolloutEngine
from dapo_train.rollout.sampling import SamplingSettings
from dapo_train.task.prompts import Prompt
from dapo_train.train.collect.history import RIGHT, WRONG, alike_side

# dapo.screen_drop side -> the fate of a prompt its screen rules out (run/rollouts.FATES).
SCREEN_FATES = {RIGHT: "screened_all_right", WRONG: "screened_all_wrong"}


@dataclass
class Scored:
    """One prompt's scored completions, in sample order: a screen's k, their continuation's G - k, or
    both joined (`+`). fate: the SCREEN_FATES name of a screen that ruled the prompt out (its k
    completions are all it gets), None when the prompt holds its G."""

    completions: list[Completion]
    rewards: list[float]  # total reward per completion
    correct: list[bool]
    per_reward: dict[str, list[float]]  # reward key -> one unweighted value per completion
    fate: str | None = None

    def __add__(self, other: Scored) -> Scored:
        return Scored(self.completions + other.completions, self.rewards + other.rewards,
                      self.correct + other.correct,
                      {key: values + other.per_reward[key] for key, values in self.per_reward.items()})


def sampling_settings(cfg: Config) -> SamplingSettings:
    return SamplingSettings(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                            top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k)


def row_seeds(seed: int, draws: Sequence[int], samples: range) -> list[int]:
    """One seed per row, prompt-major: completion j of the run's draws[b]-th prompt (Random seeds a
    string through SHA-512: the same in every process and session)."""
    return [random.Random(f"draw:{seed}:{draw}:{j}").getrandbits(63) for draw in draws for j in samples]


def generate_round(engine: RolloutEngine, reward_set, prompts: list[Prompt], draws: Sequence[int], cfg: Config,
                   stats) -> list[Scored]:
    """A round's stages 2 and 3 (rounds.py): each prompt's completions, generated and scored, in order
    (draws: each prompt's index among the run's draws). G per prompt at once; or with dapo.screen_size k a
    screen of k per prompt, then G - k more for each prompt its screen does not rule out."""
    group_size, k = cfg.rollout.group_size, cfg.dapo.screen_size
    if k == 0:
        return generate_scored(engine, reward_set, prompts, draws, cfg, stats, range(group_size))
    screens = generate_scored(engine, reward_set, prompts, draws, cfg, stats, range(k))
    for screen in screens:
        screen.fate = screen_verdict(screen, cfg.dapo.screen_drop)
    going = [b for b, screen in enumerate(screens) if screen.fate is None]
    rest = iter(generate_scored(engine, reward_set, [prompts[b] for b in going], [draws[b] for b in going], cfg,
                                stats, range(k, group_size)))
    return [screen if screen.fate is not None else screen + next(rest) for screen in screens]


def generate_scored(engine: RolloutEngine, reward_set, prompts: list[Prompt], draws: Sequence[int], cfg: Config,
                    stats, samples: range) -> list[Scored]:
    """Completions samples.start .. samples.stop - 1 of each prompt, generated in one engine call and
    scored in one, both added to the round's stats. -> one Scored per prompt."""
    completions = generate(engine, prompts, draws, cfg, stats, samples)
    return score_completions(reward_set, prompts, completions, len(samples), stats)


def generate(engine: RolloutEngine, prompts: list[Prompt], draws: Sequence[int], cfg: Config, stats,
             samples: range) -> list[Completion]:
    """Stage 2: len(samples) completions per prompt, prompt-major; none (and no engine call) for none.
    Under screening an engine with keyed draws samples row j of the draws[b]-th prompt from row_seeds."""
    if not prompts or not samples:
        return []
    keyed = cfg.dapo.screen_size > 0 and getattr(engine, "keyed_draws", False)
    keyed = {"seeds": row_seeds(cfg.seed, draws, samples)} if keyed else {}
    start = time.perf_counter()
    completions = engine.generate([p.input_ids for p in prompts], sampling_settings(cfg), len(samples), **keyed)
    stats.seconds_generate += time.perf_counter() - start
    return completions


def score_completions(reward_set, prompts: list[Prompt], completions: list[Completion], n: int,
                      stats) -> list[Scored]:
    """Stage 3: every reward on a call's completions (n per prompt, prompt-major), counted in the round's
    stats kept or not. -> one Scored per prompt."""
    if not completions:
        return [Scored([], [], [], {key: [] for key in reward_set.keys}) for _ in prompts]
    start = time.perf_counter()
    scores = score(
        reward_set, [c.policy_text for c in completions], [p.gold for p in prompts for _ in range(n)],
        lengths=[c.length for c in completions], prompts=[p.text for p in prompts for _ in range(n)],
        questions=[p.question for p in prompts for _ in range(n)],
    )
    stats.seconds_score += time.perf_counter() - start
    stats.seconds_reward_model += sum(scores.seconds[r.key] for r in reward_set.rewards if r.owns_model)
    stats.add_generated(completions, scores)
    return [Scored(completions[b * n : (b + 1) * n], scores.total[b * n : (b + 1) * n],
                   scores.correct[b * n : (b + 1) * n],
                   {key: values[b * n : (b + 1) * n] for key, values in scores.per_reward.items()})
            for b in range(len(prompts))]


def screen_verdict(screen: Scored, drop: Sequence[str]) -> str | None:
    """The fate of a prompt whose screen is `screen` (SCREEN_FATES), or None when it continues: its
    correct bits all alike, on a side dapo.screen_drop names."""
    side = alike_side(screen.correct)
    return SCREEN_FATES[side] if side in drop else None
