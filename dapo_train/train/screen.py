"""A round's completions, generated and scored per prompt; with dapo.screen_size k > 0, screened first.

Screening (SPEED, arXiv 2506.09016) moves part of Eq. 11's decision before most of the generation: a
round first samples k completions of every prompt; a prompt whose k are all correct or all wrong
(dapo.screen_drop says which side rules a prompt out) gets no more, and the others are completed to G
with G - k further samples. The k screening completions stay in the group: both calls sample the
same policy (no update runs between them) with the same settings, so a completed group is G draws
of the policy, as if sampled at once; Eq. 9 and Eq. 11 then see the whole group as without a screen.

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
from dapo_train.rollout.decoding import SamplingSettings
from dapo_train.rollout.engines import Completion, RolloutEngine
from dapo_train.task.prompts import Prompt

# dapo.screen_drop side -> the fate of a prompt its screen rules out (run/rollouts.FATES).
SCREEN_FATES = {"all_right": "screened_all_right", "all_wrong": "screened_all_wrong"}


@dataclass
class Scored:
    """One prompt's scored completions, in sample order: a screen's k, their continuation's G - k, or
    both joined (`+`)."""

    completions: list[Completion]
    rewards: list[float]  # total reward per completion
    correct: list[bool]
    per_reward: dict[str, list[float]]  # reward key -> one unweighted value per completion

    def __add__(self, other: Scored) -> Scored:
        return Scored(self.completions + other.completions, self.rewards + other.rewards,
                      self.correct + other.correct,
                      {key: values + other.per_reward[key] for key, values in self.per_reward.items()})


@dataclass
class RoundDraws:
    """A round's prompts on this rank: those completed to G (`complete`), and those a screen ruled out,
    with their k completions and fate (`ruled_out`); `index` is a prompt's place in the round's list."""

    complete: list[tuple[int, Scored]]
    ruled_out: list[tuple[int, Scored, str]]


def sampling_settings(cfg: Config) -> SamplingSettings:
    return SamplingSettings(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                            top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k)


def row_seeds(seed: int, draws: Sequence[int], samples: range) -> list[int]:
    """One seed per row, prompt-major: completion j of the run's draws[b]-th prompt (Random seeds a
    string through SHA-512: the same in every process and session)."""
    return [random.Random(f"draw:{seed}:{draw}:{j}").getrandbits(63) for draw in draws for j in samples]


def generate_scored(engine: RolloutEngine, reward_set, prompts: list[Prompt], cfg: Config, stats,
                    samples: range, draws: Sequence[int]) -> list[Scored]:
    """Completions samples.start .. samples.stop - 1 of each prompt (draws: each prompt's index among
    the run's draws), generated and scored, added to the round's stats. -> one Scored per prompt."""
    n = len(samples)
    if not prompts or n == 0:
        return [Scored([], [], [], {key: [] for key in reward_set.keys}) for _ in prompts]
    keyed = cfg.dapo.screen_size > 0 and getattr(engine, "keyed_draws", False)
    keyed = {"seeds": row_seeds(cfg.seed, draws, samples)} if keyed else {}
    start = time.perf_counter()
    completions = engine.generate([p.input_ids for p in prompts], sampling_settings(cfg), n, **keyed)
    stats.seconds_generate += time.perf_counter() - start
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
    side = "all_right" if all(screen.correct) else "all_wrong" if not any(screen.correct) else None
    return SCREEN_FATES[side] if side in drop else None


def draw_round(engine: RolloutEngine, reward_set, prompts: list[Prompt], cfg: Config, stats,
               draws: Sequence[int]) -> RoundDraws:
    """A round's completions: G per prompt at once, or with dapo.screen_size k a screen of k per prompt,
    then G - k more for each prompt it does not rule out."""
    group_size, k = cfg.rollout.group_size, cfg.dapo.screen_size
    if k == 0:
        scored = generate_scored(engine, reward_set, prompts, cfg, stats, range(group_size), draws)
        return RoundDraws(list(enumerate(scored)), [])
    screens = generate_scored(engine, reward_set, prompts, cfg, stats, range(k), draws)
    verdicts = [screen_verdict(screen, cfg.dapo.screen_drop) for screen in screens]
    going = [b for b, verdict in enumerate(verdicts) if verdict is None]
    rest = generate_scored(engine, reward_set, [prompts[b] for b in going], cfg, stats, range(k, group_size),
                           [draws[b] for b in going])
    return RoundDraws([(b, screens[b] + more) for b, more in zip(going, rest)],
                      [(b, screens[b], verdict) for b, verdict in enumerate(verdicts) if verdict is not None])
