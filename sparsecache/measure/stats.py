"""Intervals for the figures the product and the benchmarks report: the Wilson interval of a
proportion and seeded bootstrap percentiles of any statistic."""

from __future__ import annotations

import math
import random

BOOTSTRAP = 2000  # resamples of the questions for the intervals of ratios and means


def mean(xs) -> float:
    return sum(xs) / len(xs)



def bootstrap(items: list, statistic, resamples: int = BOOTSTRAP) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles of `statistic` over resamples of `items` (seeded: the
    same rows give the same interval)."""
    rng = random.Random(0)
    stats = sorted(s for s in (statistic(rng.choices(items, k=len(items))) for _ in range(resamples)) if s == s)
    if not stats:
        return (float("nan"), float("nan"))
    return round(stats[int(0.025 * (len(stats) - 1))], 3), round(stats[int(0.975 * (len(stats) - 1))], 3)



def wilson(correct: int, n: int, z: float = 1.96, digits: int | None = 3) -> tuple[float, float]:
    """The 95% Wilson score interval of a binomial proportion, rounded to `digits` for a report
    (None: unrounded, which is what a comparison with a target must use: 0.79969 is not 0.8)."""
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    lo, hi = max(0.0, centre - half), min(1.0, centre + half)
    return (lo, hi) if digits is None else (round(lo, digits), round(hi, digits))

