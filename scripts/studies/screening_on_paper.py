"""What screening (dapo.screen_size) saves on paper, for per-prompt pass rates p ~ Beta(a, b).

    python scripts/studies/screening_on_paper.py                 # the table of docs/studies.md
    python scripts/studies/screening_on_paper.py --mean 0.7 --concentration 10 --group 16 --screen 4

Per prompt, a group of G is all right with probability E[p^G] and all wrong with E[(1-p)^G] (for
p ~ Beta(a, b), E[p^n] = B(a + n, b) / B(a, b)). Without a screen every prompt costs G completions and
trains 1 - E[p^G] - E[(1-p)^G] groups. With a screen of k ruling out the sides in `drop`, a prompt costs
k + (G - k) P(continued) completions and trains the groups mixed at G whose screen was not ruled out:
P(first k all right, group mixed) = E[p^k] - E[p^G], and the same for all wrong. Completions are
counted as if all had the same length.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from math import exp, lgamma

SIDES = {"all_right": "R", "all_wrong": "W"}


def moment(a: float, b: float, n: int) -> float:
    """E[p^n] for p ~ Beta(a, b)."""
    return exp(lgamma(a + n) + lgamma(a + b) - lgamma(a) - lgamma(a + b + n))


@dataclass
class Cost:
    generated_per_trained: float  # completions generated per completion trained
    trained_groups: float  # informative groups trained per prompt drawn


def cost(a: float, b: float, group: int, screen: int = 0, drop: tuple[str, ...] = ("all_wrong", "all_right")) -> Cost:
    """Expected cost per prompt of a group of `group` with a screen of `screen` (0: none) ruling out `drop`."""
    right, wrong = (lambda n: moment(a, b, n)), (lambda n: moment(b, a, n))
    mixed = 1 - right(group) - wrong(group)
    if screen == 0:
        return Cost(1 / mixed, mixed)
    out = (right(screen) if "all_right" in drop else 0) + (wrong(screen) if "all_wrong" in drop else 0)
    lost = ((right(screen) - right(group)) if "all_right" in drop else 0) + \
        ((wrong(screen) - wrong(group)) if "all_wrong" in drop else 0)
    generated = screen + (group - screen) * (1 - out)
    trained = mixed - lost
    return Cost(generated / (group * trained), trained)


def beta(mean: float, concentration: float) -> tuple[float, float]:
    return mean * concentration, (1 - mean) * concentration


def table(mean: float, concentrations: list[float]) -> str:
    lines = ["| pass rates | G | all right / all wrong at G | off | k=2 | k=G/2 | k=G/2, all_wrong only | "
             "k=G/2, all_right only |", "|---|---|---|---|---|---|---|---|"]
    for concentration in concentrations:
        a, b = beta(mean, concentration)
        for group in (4, 16):
            cells = [cost(a, b, group), cost(a, b, group, 2), cost(a, b, group, group // 2),
                     cost(a, b, group, group // 2, ("all_wrong",)), cost(a, b, group, group // 2, ("all_right",))]
            shown = " | ".join(f"{c.generated_per_trained:.2f} ({c.trained_groups:.2f})" for c in cells)
            lines.append(f"| Beta({a:g}, {b:g}) | {group} | {moment(a, b, group):.2f} / {moment(b, a, group):.2f} | "
                         f"{shown} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mean", type=float, default=0.7, help="mean pass rate (the model's accuracy)")
    parser.add_argument("--concentration", type=float, action="append",
                        help="a + b of the Beta (repeatable; default 10, 2 and 0.5: concentrated to polarised)")
    parser.add_argument("--group", type=int, help="one G (with --screen): print its cost alone")
    parser.add_argument("--screen", type=int, default=0)
    args = parser.parse_args()
    concentrations = args.concentration or [10.0, 2.0, 0.5]
    if args.group is None:
        print(table(args.mean, concentrations))
        return
    for concentration in concentrations:
        a, b = beta(args.mean, concentration)
        off, on = cost(a, b, args.group), cost(a, b, args.group, args.screen)
        print(f"Beta({a:g}, {b:g}) G={args.group} k={args.screen}: generated per trained "
              f"{off.generated_per_trained:.2f} -> {on.generated_per_trained:.2f}, trained groups per prompt "
              f"{off.trained_groups:.3f} -> {on.trained_groups:.3f}")


if __name__ == "__main__":
    main()
