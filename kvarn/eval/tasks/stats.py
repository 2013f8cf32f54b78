"""Statistics of the task tables: Wilson intervals, the exact McNemar test of paired outcomes, a seeded bootstrap
interval of a mean (used for the gold answer's log-probability and its paired difference to full precision)."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (95% by default); (0, 1) when n is 0."""
    if not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n, got {successes} of {n}")
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    z2 = z * z
    center = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    lo = 0.0 if successes == 0 else max(0.0, center - half)  # exact ends where rounding would miss them
    hi = 1.0 if successes == n else min(1.0, center + half)
    return lo, hi


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """Two-sided exact McNemar p: the discordant pairs (a right and b wrong; the reverse) against Binomial(n, 1/2)."""
    if only_a < 0 or only_b < 0:
        raise ValueError(f"discordant counts must be >= 0, got {only_a}, {only_b}")
    n = only_a + only_b
    if n == 0:
        return 1.0
    k = min(only_a, only_b)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired(a: Sequence[bool], b: Sequence[bool]) -> dict:
    """Paired outcomes of two methods on the same samples: the discordant counts, the accuracy difference a - b and
    the exact McNemar p."""
    if len(a) != len(b):
        raise ValueError(f"paired outcomes need the same samples, got {len(a)} and {len(b)}")
    only_a = sum(x and not y for x, y in zip(a, b))
    only_b = sum(y and not x for x, y in zip(a, b))
    n = len(a)
    return {"n": n, "only_a": only_a, "only_b": only_b, "difference": (only_a - only_b) / n if n else 0.0,
            "mcnemar_p": mcnemar_exact(only_a, only_b)}


def bootstrap_mean(values: Sequence[float], seed: int = 0, rounds: int = 2000,
                   level: float = 0.95) -> tuple[float, float, float]:
    """(mean, lower, upper): the percentile bootstrap interval of the mean, resampled with `seed`."""
    if not values:
        raise ValueError("bootstrap of no values")
    n = len(values)
    mean = sum(values) / n
    rng = random.Random(seed)
    means = sorted(sum(values[rng.randrange(n)] for _ in range(n)) / n for _ in range(rounds))
    lo = means[math.floor((1 - level) / 2 * (rounds - 1))]
    hi = means[math.ceil((1 + level) / 2 * (rounds - 1))]
    return mean, lo, hi
