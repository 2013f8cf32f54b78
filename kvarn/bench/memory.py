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
        store = LayerStore.from_preset(p if not fp_layer else get_preset("fp16"), head_dim)
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


# -- long run: bytes held vs nbytes()'s formula every `every` tokens --------------------------------------------
LONG_CHUNKS = (1, 1, 1, 1, 2, 5, 17, 64, 128, 300)  # decode steps mixed with prefill-like chunks
POOL = 8  # distinct synthetic blocks, reused across layers and blocks (bytes do not depend on the values)


def long_run(preset: str = "kvarn-k2v2-g128", tokens: int = 32768, every: int = 1024, layers: int = 30,
             kv_heads: int = 3, head_dim: int = 64, dtype: torch.dtype = torch.float16, seed: int = 0,
             progress: bool = True) -> list[dict]:
    """Feed `tokens` synthetic K/V (kvarn.synthetic) through a `KVarNCache` of the given shapes in random chunks
    (one-token decode steps and longer chunks, seeded) and measure, after every `every` tokens, the bytes really
    held (`held_bytes`) against `nbytes()`: its total (reserved capacity included) and its content (the formula
    of the regions without reserved capacity). Packed reads: `update` returns the fresh K/V only, as under the
    "kvarn" attention."""
    import random

    from tqdm import tqdm
    from transformers import LlamaConfig

    from kvarn.cache.memory import held_bytes
    from kvarn.integrations.transformers import KVarNCache
    from kvarn.synthetic import synthetic_kv

    config = LlamaConfig(num_hidden_layers=layers, num_attention_heads=kv_heads, num_key_value_heads=kv_heads,
                         hidden_size=kv_heads * head_dim, head_dim=head_dim)
    config._attn_implementation = "kvarn"
    cache = KVarNCache(config, preset)
    pool = []
    for i in range(POOL):
        s = synthetic_kv(every, head_dim, kv_heads, seed=seed * POOL + i)
        pool.append((s.keys.unsqueeze(0).to(dtype), s.values.unsqueeze(0).to(dtype)))
    rng = random.Random(seed)
    rows = []
    done = 0
    bar = tqdm(total=tokens, desc=f"long run {preset}", unit="tok", disable=not progress)
    while done < tokens:
        n = min(every, tokens - done)
        block = done // every
        at = 0
        while at < n:
            c = n - at if done == 0 and at == 0 else min(rng.choice(LONG_CHUNKS), n - at)  # first: a prefill
            for i in range(layers):
                k, v = pool[(block * 7 + i) % POOL]
                k, v = k[:, :, at:at + c], v[:, :, at:at + c]
                cache.update(k, v, i)
                store = cache.layers[i].store
                if store.queries is not None:  # rotate="auto": the attention would observe this step's queries
                    store.observe_queries(k)
            at += c
            bar.update(c)
        done += n
        nb = cache.nbytes()
        held = held_bytes(cache)
        rows.append({"tokens": done, "held": held, "nbytes_total": nb.total, "nbytes_content": nb.content,
                     "reserved": nb.reserved, "fp16": cache.fp16_nbytes(), "held_vs_content": held / nb.content,
                     "held_vs_total": held / nb.total, "held_vs_fp16": held / cache.fp16_nbytes(),
                     "exact_tiles": nb.exact_tiles})
    bar.close()
    return rows


def largest_deviation(rows: list[dict]) -> dict[str, float]:
    """max |held / formula - 1| over the rows, for nbytes()'s content and total."""
    return {"vs_content": max(abs(r["held_vs_content"] - 1) for r in rows),
            "vs_total": max(abs(r["held_vs_total"] - 1) for r in rows)}


def run_long(args, layers: int, kv_heads: int, head_dim: int) -> int:
    """`kvarn bench memory-long`: the long run on the model's cache shapes, a table, optional JSON."""
    from rich.table import Table

    from kvarn.console import console
    from kvarn.eval.provenance import provenance
    from kvarn.eval.results import write_json

    preset = get_preset(args.preset).name
    rows = long_run(preset, args.tokens, 1024, layers, kv_heads, head_dim)
    dev = largest_deviation(rows)
    t = Table(title=f"bytes held vs nbytes() every 1k tokens, {preset}, {layers} layers x {kv_heads} heads x "
                 f"{head_dim}, float16 K/V")
    for k in rows[0]:
        t.add_column(k, justify="right")
    for r in rows:
        t.add_row(*[f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.values()])
    console().print(t)
    print(f"largest deviation of held bytes: {100 * dev['vs_content']:.3f}% from nbytes()'s formula (content), "
          f"{100 * dev['vs_total']:.3f}% from nbytes().total (reserved included)")
    if args.json:
        write_json(args.json, {"provenance": provenance(**vars(args) | {"func": None}), "rows": rows,
                               "largest_deviation": dev})
    return 0 if dev["vs_content"] <= 0.05 else 1
