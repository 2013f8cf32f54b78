"""Tile-store cost relative to the decode steps that produce the tile, per preset, side by side.

    store    the cache's real store call: `LayerStore.append` of one tile (G tokens) of keys and values to the
             store of every quantized layer, which quantizes and packs all KV heads of that tile (for
             rotate="auto" presets, both candidates and the choice, weighted by the query statistics the
             model's own prefill left in the cache); the K/V are the model's, on the text
    decode   one decode step of the model with `KVarNCache(config, preset)` at `context` tokens
    ratio    store / (G x decode): the share of the generation time of the G tokens the tile covers

Store and decode calls are interleaved round by round; each store round appends to fresh copies of the
layer stores, prepared untimed, holding the sink as the cache does. One more store call per preset is profiled
(top operators), the "why" beside a missed target.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvarn.bench.e2e import prefilled, stepper
from kvarn.bench.profile import top_ops
from kvarn.bench.timing import interleaved_samples, spread
from kvarn.cache.store import LayerStore
from kvarn.eval.forward import capture_kv
from kvarn.integrations.transformers import KVarNCache, KVarNLayer
from kvarn.presets import get_preset


def _quantized_layers(cache: KVarNCache) -> list[tuple[int, KVarNLayer]]:
    return [(i, layer) for i, layer in enumerate(cache.layers)
            if isinstance(layer, KVarNLayer) and layer.store.keys.quantizer is not None]


def _fresh_store(layer: KVarNLayer, k_sink: torch.Tensor, v_sink: torch.Tensor) -> LayerStore:
    """A store built like `layer`'s, holding the sink, with a copy of its query statistics."""
    store = LayerStore(*layer._store_args)
    store.append(k_sink, v_sink)
    src = layer.store.queries
    if src is not None and src.sum is not None:
        store.queries.sum, store.queries.count = src.sum.clone(), src.count
    return store


def _store_call(model, ids: torch.Tensor, preset: str, kv, calls: int) -> Callable[[], None]:
    """A function that, at each of `calls` calls, stores one tile of every quantized layer (fresh stores)."""
    p = get_preset(preset)
    n = p.sink + p.tile
    ref, _ = prefilled(model, ids, n, preset, n)  # the model's queries go through the cache's policy statistics
    layers = _quantized_layers(ref)
    if not layers:
        raise ValueError(f"preset {preset} quantizes no layer of this model")
    s = ref.layers[layers[0][0]].store.keys.sink_len
    rounds = [[(_fresh_store(layer, kv[i][0][:, :, :s], kv[i][1][:, :, :s]),
                kv[i][0][:, :, s:s + p.tile], kv[i][1][:, :, s:s + p.tile]) for i, layer in layers]
              for _ in range(calls)]

    def store() -> None:
        for st, k, v in rounds.pop():
            st.append(k, v)
            assert st.keys.n_tiles == 1 and st.values.n_tiles == 1, "one tile per layer was meant to be stored"

    store.layers = len(layers)
    return store


def bench_store(model, load_ids: Callable[[int], torch.Tensor], presets: list[str], context: int, rounds: int,
                warmup: int = 1) -> dict:
    from kvarn.eval.progress import progress

    presets = [get_preset(p).name for p in presets]
    longest = max(get_preset(p).sink + get_preset(p).tile for p in presets)
    ids = load_ids(max(longest, context + warmup + rounds + 1))
    with torch.no_grad():
        kv = capture_kv(model, ids[:, :longest])
    fns, layers = {}, {}
    for p in presets:
        fns[f"store {p}"] = _store_call(model, ids, p, kv, rounds + warmup + 1)  # + 1 profiled
        layers[p] = fns[f"store {p}"].layers
        cache, _ = prefilled(model, ids, context, p, ids.shape[1])
        fns[f"decode {p}"] = stepper(model, ids, context, cache)
    with progress(total=rounds, desc="store", leave=False) as bar, torch.no_grad():
        samples = interleaved_samples(fns, rounds=rounds, warmup=warmup, tick=lambda: bar.update(1))
        profiles = {p: top_ops(fns[f"store {p}"]) for p in presets}
    times = {k: spread(v) for k, v in samples.items()}
    rows = []
    kv_heads, head_dim = kv[0][0].shape[1], kv[0][0].shape[-1]
    for p in presets:
        g = get_preset(p).tile
        st, dec = times[f"store {p}"]["median_s"], times[f"decode {p}"]["median_s"]
        rows.append({"preset": p, "store_ms": 1e3 * st, "decode_ms_per_token": 1e3 * dec, "tile": g,
                     "store_pct_of_decode": 100 * st / (g * dec), "layers": layers[p], "kv_heads": kv_heads,
                     "store_vs_first": st / times[f"store {presets[0]}"]["median_s"],
                     "bits_per_element": get_preset(p).bits_per_element(head_dim), "profile": profiles[p]})
    return {"context": context, "rounds": rounds, "warmup": warmup, "threads": torch.get_num_threads(),
            "timings": times, "rows": rows}
