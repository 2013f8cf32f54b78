"""The top operators of one call, by self CPU time (torch.profiler): the "why" next to a missed target."""

from __future__ import annotations

from collections.abc import Callable


def top_ops(fn: Callable[[], object], n: int = 8) -> list[dict]:
    """Run fn once under torch.profiler; the n operators with the most self CPU time, with their share."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    return [{"op": e.key, "self_ms": e.self_cpu_time_total / 1e3, "share": e.self_cpu_time_total / total,
             "calls": e.count} for e in events[:n]]
