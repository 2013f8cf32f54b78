"""Memory per cache type: KV bytes held and peak process memory, each cache in its own fresh process.

For each cache, a spawned process loads the model, prefills N tokens of the text and decodes `steps` more (the
e2e protocol, `kvarn.bench.e2e`), then reports:
    kv_bytes        bytes of the unique tensor storages reachable from the cache (`kvarn.cache.memory.held_bytes`)
    rss_model       resident memory after loading the model, before any cache
    rss_peak        peak resident memory from the end of the model load on (Linux VmHWM after resetting it through
                    /proc/self/clear_refs; elsewhere ru_maxrss, which includes the load, with a warning)
    peak_over_model rss_peak - rss_model: what prefill and decode with this cache added at their peak
A process per cache, because a process's peak memory only grows.
"""

from __future__ import annotations

import warnings
from concurrent.futures import ProcessPoolExecutor

import torch


def held_bytes(obj) -> int:
    """Bytes of the unique tensor storages reachable from obj (quanto/HQQ wrapper tensors through their inner ones)."""
    from kvarn.cache.memory import held_bytes as reachable

    return reachable(obj)


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _reset_peak() -> bool:
    """Linux: restart the process's peak-RSS count (VmHWM) now, so loading the model does not set the peak."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss(reset: bool) -> int:
    """Peak RSS since `_reset_peak` (VmHWM) when it worked, else since the process started (ru_maxrss)."""
    if reset:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    import resource
    import sys

    warnings.warn("kvarn bench: cannot reset the peak RSS here; it includes loading the model", stacklevel=2)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # kilobytes on Linux


def measure_one(model_name: str, ids: torch.Tensor, context: int, cache: str, steps: int, threads: int) -> dict:
    """Run in a fresh process: the memory figures of one cache (see the module docstring)."""
    from kvarn.bench.e2e import prefilled, stepper
    from kvarn.models import load_model

    torch.set_num_threads(threads)
    model, _ = load_model(model_name)
    rss_model = _rss()
    reset = _reset_peak()
    c, _ = prefilled(model, ids, context, cache, ids.shape[1])
    step = stepper(model, ids, context, c)
    for _ in range(steps):
        step()
    kv = held_bytes(c)
    peak = _peak_rss(reset)
    return {"cache": cache, "context": context, "tokens": context + steps, "kv_bytes": kv, "rss_model": rss_model,
            "rss_peak": peak, "peak_over_model": peak - rss_model}


def bench_memory(model_name: str, load_ids, contexts: list[int], caches: list[str], steps: int) -> dict:
    import multiprocessing

    from kvarn.bench.e2e import usable
    from kvarn.eval.progress import progress

    names, skipped = usable(caches)
    rows = []
    spawn = multiprocessing.get_context("spawn")
    jobs = [(n, c) for n in contexts for c in names]
    for n, c in progress(jobs, desc="memory"):
        ids = load_ids(n + steps)
        with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
            rows.append(pool.submit(measure_one, model_name, ids, n, c, steps, torch.get_num_threads()).result())
    for n in contexts:
        ref = next((r for r in rows if r["context"] == n and r["cache"] == "dynamic"), None)
        for r in rows:
            if r["context"] == n:
                r["kv_vs_dynamic"] = r["kv_bytes"] / ref["kv_bytes"] if ref else None
    return {"steps": steps, "skipped": skipped, "rows": rows}
