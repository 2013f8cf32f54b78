"""End-to-end decode speed: tokens/s of a model with each cache, side by side in one process.

Per context N: every contender prefills the first N tokens of the same text with its own cache (the model's real
forward, `logits_to_keep=1`), then the next tokens are fed one at a time (teacher forcing, so every cache does the
same work). Steps are interleaved across contenders (step i of every cache before step i + 1 of any), after
`warmup` untimed steps; tokens/s = 1 / median seconds per step.

Contenders: `KVarNCache(config, preset)` passed as a user passes it (no other call), transformers' DynamicCache,
StaticCache (preallocated to the final length) and QuantizedCache (2-bit, quanto or HQQ backend, transformers'
defaults otherwise: group 64, residual 128). A backend that is not installed is skipped with a warning.
"""

from __future__ import annotations

import gc
import importlib.util
import warnings
from collections.abc import Callable

import torch

from kvarn.bench.profile import top_ops
from kvarn.bench.timing import interleaved_samples, spread

BASELINES = ("dynamic", "static", "quanto-2bit", "hqq-2bit")
_BACKEND_MODULE = {"quanto-2bit": "optimum.quanto", "hqq-2bit": "hqq"}


def unavailable(name: str) -> str | None:
    """Why cache `name` cannot run here (its backend is not installed), or None."""
    module = _BACKEND_MODULE.get(name)
    if module is None:
        return None
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    return None if found else f"{module} is not installed (pip install 'kvarn[bench]')"


def make_cache(name: str, model, max_len: int):
    """A fresh cache for `model`: a baseline name (`BASELINES`) or a kvarn preset name."""
    from transformers import DynamicCache, QuantizedCache, StaticCache

    if name == "dynamic":
        return DynamicCache(config=model.config)
    if name == "static":
        return StaticCache(config=model.config, max_cache_len=max_len)
    if name in _BACKEND_MODULE:
        return QuantizedCache(name.split("-")[0], model.config, nbits=2)
    from kvarn.integrations.transformers import KVarNCache

    return KVarNCache(model.config, name)


def usable(names: list[str]) -> tuple[list[str], dict[str, str]]:
    """The caches that can run, and {name: reason} for those skipped (each warned once)."""
    from kvarn.presets import get_preset

    ok, skipped = [], {}
    for n in names:
        if n not in BASELINES:
            get_preset(n)  # a clear error for a bad name
        why = unavailable(n)
        if why:
            warnings.warn(f"kvarn bench: skipping {n}: {why}", stacklevel=2)
            skipped[n] = why
        else:
            ok.append(n)
    return ok, skipped


@torch.no_grad()
def prefilled(model, ids: torch.Tensor, context: int, name: str, max_len: int):
    """A cache `name` holding the first `context` tokens of ids (one forward) and the seconds the prefill took."""
    import time

    cache = make_cache(name, model, max_len)
    t0 = time.perf_counter()
    from kvarn.integrations.transformers import cache_kwarg

    model(ids[:, :context], use_cache=True, logits_to_keep=1, **{cache_kwarg(model): cache})
    return cache, time.perf_counter() - t0


def stepper(model, ids: torch.Tensor, context: int, cache) -> Callable[[], None]:
    """A function that feeds the next token of ids (from position `context` on) to the model with `cache`."""
    from kvarn.integrations.transformers import cache_kwarg

    kw = {cache_kwarg(model): cache}  # resolved once: the step is timed
    at = [context]

    @torch.no_grad()
    def step() -> None:
        i = at[0]
        if i >= ids.shape[1]:
            raise ValueError(f"ran out of tokens: the text was loaded for {ids.shape[1]} tokens")
        model(ids[:, i:i + 1], use_cache=True, **kw)
        at[0] = i + 1

    return step


def bench_e2e(model, load_ids: Callable[[int], torch.Tensor], contexts: list[int], caches: list[str], steps: int,
              warmup: int = 1, profile: str | None = None) -> dict:
    """Tokens/s of every cache at every context; `load_ids(n)` gives the first n tokens of the text, [1, n].
    `profile`: a cache whose extra decode step at the longest context is profiled (top operators)."""
    from kvarn.eval.progress import progress

    names, skipped = usable(caches)
    out = []
    for n in contexts:
        ids = load_ids(n + warmup + steps + 1)
        live, prefill = {}, {}
        for name in progress(names, desc=f"prefill {n}", leave=False):
            live[name], prefill[name] = prefilled(model, ids, n, name, ids.shape[1])
        fns = {name: stepper(model, ids, n, c) for name, c in live.items()}
        with progress(total=steps, desc=f"decode {n}", leave=False) as bar:
            samples = interleaved_samples(fns, rounds=steps, warmup=warmup, tick=lambda: bar.update(1))
        prof = top_ops(fns[profile]) if profile in fns and n == max(contexts) else None
        times = {k: spread(v) for k, v in samples.items()}
        tps = {k: 1.0 / t["median_s"] for k, t in times.items()}
        rows = [{"cache": k, "context": n, "tokens_per_s": tps[k], "ms_per_token": 1e3 * times[k]["median_s"],
                 "vs_dynamic": tps[k] / tps["dynamic"] if "dynamic" in tps else None,
                 "vs_quanto": tps[k] / tps["quanto-2bit"] if "quanto-2bit" in tps else None,
                 "prefill_s": prefill[k], "timing": times[k]} for k in names]
        out.append({"context": n, "rows": rows, "profile": {"cache": profile, "ops": prof} if prof else None})
        del live, fns
        gc.collect()
    return {"steps": steps, "warmup": warmup, "threads": torch.get_num_threads(), "caches": names,
            "skipped": skipped, "contexts": out}
