"""Side-by-side timing: candidates are interleaved round by round so drift hits all of them alike."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable


def interleaved_samples(fns: dict[str, Callable[[], object]], rounds: int = 5, warmup: int = 1,
                        tick: Callable[[], None] | None = None) -> dict[str, list[float]]:
    """Seconds per call of each function, `rounds` samples each: round r calls every function once, after `warmup`
    untimed rounds, in an order shuffled per round (seeded: the same orders at every run), so no function always
    follows the same one. The call after a large one pays for its caches: in a full run with a fixed order (git
    show 96157cd:docs/bench.json, smollm2 B=1 8k) kvarn-k2v2, always right after SDPA, took 0.58 ms and kvarn-auto,
    of the same cost, 0.35 ms; a fixed or rotated order keeps that on one contender. `tick` is called after each
    timed round (a progress bar)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    order = random.Random(0)
    for _ in range(rounds):
        names = list(fns)
        order.shuffle(names)
        for k in names:
            t0 = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t0)
        if tick is not None:
            tick()
    return times


def interleaved_median(fns: dict[str, Callable[[], object]], rounds: int = 5, warmup: int = 1) -> dict[str, float]:
    """Median seconds per call of each function, measured in interleaved rounds."""
    return {k: statistics.median(v) for k, v in interleaved_samples(fns, rounds, warmup).items()}


def spread(samples: list[float]) -> dict[str, float]:
    """Median and interquartile range of timing samples (seconds), as recorded in the JSON."""
    q = statistics.quantiles(samples, n=4) if len(samples) > 1 else [samples[0]] * 3
    return {"median_s": statistics.median(samples), "q1_s": q[0], "q3_s": q[2], "n": len(samples)}
