"""KV memory really held at a given context length, per preset, vs an fp16 cache of the same tokens.

Bytes do not depend on the values (except tiles kept exact for non-finite input), so random K/V of the
model's shapes are appended through the same `LayerStore` the cache uses, and its tensors are counted.
"""

from __future__ import annotations

import torch

from kvarn.cache.store import Bytes, LayerStore
from kvarn.presets import get_preset


def bytes_at(preset: str, context: int, layers: int, kv_heads: int, head_dim: int, chunk: int = 1024) -> Bytes:
    p = get_preset(preset)
    total = Bytes()
    g = torch.Generator().manual_seed(0)
    first, last = p.fp_layers
    for layer in range(layers):
        fp_layer = layer < first or layer >= layers - last
        store = LayerStore(p if not fp_layer else "fp16", head_dim)
        done = 0
        while done < context:
            n = min(chunk, context - done)
            k = torch.randn(1, kv_heads, n, head_dim, generator=g, dtype=torch.float16)
            store.append(k, k.clone())
            done += n
        total = total + store.nbytes()
    return total


def bench_memory(presets: list[str], contexts: list[int], layers: int, kv_heads: int, head_dim: int) -> list[dict]:
    rows = []
    for name in presets:
        for ctx in contexts:
            b = bytes_at(name, ctx, layers, kv_heads, head_dim)
            fp16 = 2 * b.elements
            rows.append({"preset": name, "context": ctx, "bytes": b.total, "fp16_bytes": fp16,
                         "ratio_vs_fp16": b.total / fp16, "bits_per_element": b.bits_per_element,
                         **{f"{k}_bytes": v for k, v in b.as_dict().items() if k in ("packed", "sink", "tail")}})
    return rows
