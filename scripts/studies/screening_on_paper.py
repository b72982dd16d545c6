"""What screening (dapo.screen_size) saves on paper, for per-prompt pass rates p ~ Beta(a, b).

    python scripts/studies/screening_on_paper.py                 # the table of docs/studies.md
    python scripts/studies/screening_on_paper.py --mean 0.7 --concentration 10 --group 16 --screen 4
    python scripts/studies/screening_on_paper.py --kept                  # what a kept group holds (training.md)

Per prompt, a group of G is all right with probability E[p^G] and all wrong with E[(1-p)^G] (for
p ~ Beta(a, b), E[p^n] = B(a + n, b) / B(a, b)). Without a screen every prompt costs G completions and
trains 1 - E[p^G] - E[(1-p)^G] groups. With a screen of k ruling out the sides in `drop`, a prompt costs
k + (G - k) P(continued) completions and trains the groups mixed at G whose screen was not ruled out:
P(first k all right, group mixed) = E[p^k] - E[p^G], and the same for all wrong. Completions are
counted as if all had the same length.

What a kept group holds (--kept), for one prompt of pass rate p: its correct count c = s + r, s ~ Bin(k, p)
in the screen and r ~ Bin(G - k, p) in the rest. Without a screen a group is kept when 0 < c < G; with one,
when its screen is not ruled out and 0 < c < G. Eq. 9 on correct bits gives a right completion of a
group with c right (G - c)/(G std) = sqrt((G - c)/c) and a wrong one -sqrt(c/(G - c)) (population std).
Given its bits, each completion is a policy draw (the screen reads bits only), so with s the score
grad log pi: E[s | right] = grad p / p, E[s | wrong] = -grad p / (1 - p), and a group's expected update
sum_i A_i s(o_i) is sqrt(c (G - c)) grad p / (p (1 - p)): the prompt's update per prompt drawn is
E[sqrt(c (G - c)); kept] in units of grad p / (p (1 - p)), in the direction of grad p with or without a screen.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from math import comb, exp, lgamma, sqrt

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


@dataclass
class Kept:
    """What the kept groups of one prompt of pass rate p hold, in expectation."""

    per_prompt: float  # P(the prompt's group is kept)
    right: float  # E[correct completions | kept]
    advantage_right: float  # the mean Eq. 9 advantage of a right completion in the kept groups
    advantage_wrong: float  # and of a wrong one
    update: float  # E[sqrt(c (G - c)); kept]: the expected update per prompt drawn, in grad p / (p (1 - p))


def binomial(n: int, p: float) -> list[float]:
    return [comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(n + 1)]


def kept(p: float, group: int, screen: int = 0, drop: tuple[str, ...] = ("all_wrong", "all_right")) -> Kept:
    """Kept for a prompt of pass rate p, a group of `group`, a screen of `screen` (0: none) ruling out `drop`."""
    mass = [0.0] * (group + 1)  # P(kept, c right), c = 0 .. G
    for s, p_screen in enumerate(binomial(screen, p)):
        if (s == screen and "all_right" in drop or s == 0 and "all_wrong" in drop) and screen:
            continue
        for r, p_rest in enumerate(binomial(group - screen, p)):
            if 0 < s + r < group:
                mass[s + r] += p_screen * p_rest
    total = sum(mass)
    rights, wrongs = sum(m * c for c, m in enumerate(mass)), sum(m * (group - c) for c, m in enumerate(mass))
    return Kept(total, rights / total,
                sum(m * c * sqrt((group - c) / c) for c, m in enumerate(mass) if m) / rights,
                -sum(m * (group - c) * sqrt(c / (group - c)) for c, m in enumerate(mass) if m) / wrongs,
                sum(m * sqrt(c * (group - c)) for c, m in enumerate(mass)))


def kept_table(group: int, screen: int, rates: tuple[float, ...] = (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9)) -> str:
    """docs/training.md's table: per pass rate, the kept groups without a screen, with one ruling out both
    sides, and with one ruling out all-wrong screens only; the update per prompt drawn against no screen's."""
    lines = ["| p | kept per prompt | right answers per kept group | advantage of a right answer | "
             "advantage of a wrong answer | update per prompt drawn |", "|---|---|---|---|---|---|"]
    for p in rates:
        cells = [kept(p, group), kept(p, group, screen), kept(p, group, screen, ("all_wrong",))]
        shown = [" / ".join(f"{getattr(c, name):.2f}" for c in cells)
                 for name in ("per_prompt", "right", "advantage_right", "advantage_wrong")]
        shown.append(" / ".join(f"{c.update / cells[0].update:.2f}" for c in cells))
        lines.append(f"| {p:g} | " + " | ".join(shown) + " |")
    return "\n".join(lines)


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
    parser.add_argument("--kept", action="store_true",
                        help="what a kept group holds per pass rate, off / both sides / all_wrong only (G 8, k 2 "
                             "unless --group and --screen say)")
    args = parser.parse_args()
    if args.kept:
        print(kept_table(args.group or 8, args.screen or 2))
        return
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
