"""Side-by-side timing: candidates are interleaved round by round so drift hits all of them alike."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def interleaved_median(fns: dict[str, Callable[[], object]], rounds: int = 5, warmup: int = 1) -> dict[str, float]:
    """Median seconds per call of each function, measured in interleaved rounds."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}
