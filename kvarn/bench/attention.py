"""Decode attention alone: kvarn's packed attention vs SDPA over dense fp32 and bf16 K/V, side by side.

One decode step (one query token per sequence) over a context of T stored tokens plus the fresh one:

    kvarn <preset>   `kvarn.attention.packed_attention` on a `LayerStore` holding the T tokens under the preset
                     (sink exact in fp16, packed tiles, exact tail), exactly what a `KVarNCache` layer hands it
    sdpa fp32/bf16   torch's scaled_dot_product_attention over dense [B, Hkv, T + 1, D] K/V (GQA, no repeat)

K/V are `kvarn.synthetic` activations (heavy tails, outlier channels, rare large tokens) of one block of
`SYNTHETIC_BLOCK` tokens per KV head, repeated along the sequence and the batch; the store quantizes the tiles of
that block once (batch row 0) and repeats the packed tiles to the context and the batch (the layout is
[B, H, n_tiles, ...], `kvarn.cache.store`). Timing does not depend on the values, and quantizing 32k distinct
tokens of 8 batch rows would dominate the run. Queries are seeded normals.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvarn.attention.packed import KVarNPast, packed_attention
from kvarn.attention.view import StoredKV
from kvarn.bench.profile import top_ops
from kvarn.bench.timing import interleaved_samples, spread
from kvarn.cache.store import LayerStore
from kvarn.presets import get_preset
from kvarn.synthetic import synthetic_kv


@dataclass(frozen=True)
class HeadShape:
    name: str
    q_heads: int
    kv_heads: int
    head_dim: int


SHAPES = {
    "smollm2": HeadShape("smollm2", 9, 3, 64),  # the embedded model
    "qwen3-4b": HeadShape("qwen3-4b", 32, 8, 128),  # a Qwen3-4B-like layer
}
SYNTHETIC_BLOCK = 2048  # distinct synthetic tokens per KV head after the sink, repeated to the context


def attention_path() -> str:
    """Which implementation `packed_attention` runs for decode queries here: the fused C++ kernel unless
    KVARN_KERNEL=torch or the extension cannot be built (then the PyTorch tile path, saying why)."""
    from kvarn.kernels.cpu import build

    if build.mode() == "torch":
        return "PyTorch tile path (KVARN_KERNEL=torch)"
    if build.load() is None:
        return f"PyTorch tile path (the C++ kernel is unavailable: {build.error()})"
    return "fused C++ kernel (kvarn.kernels.cpu)"


def _dense_kv(shape: HeadShape, batch: int, context: int, sink: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, Hkv, context + 1, D] float32 keys and values (the last token is the fresh one): `sink` synthetic tokens,
    then one block of SYNTHETIC_BLOCK synthetic tokens repeated; every batch row the same."""
    n = min(sink + SYNTHETIC_BLOCK, context + 1)
    s = synthetic_kv(n, shape.head_dim, heads=shape.kv_heads, seed=seed)

    def fill(x: torch.Tensor) -> torch.Tensor:  # [H, n, D] -> [B, H, context + 1, D]
        head, body = x[:, :sink], x[:, sink:]
        reps = -(-(context + 1 - head.shape[1]) // max(1, body.shape[1]))
        out = torch.cat([head, body.repeat(1, reps, 1)], dim=1)[:, : context + 1]
        return out.unsqueeze(0).expand(batch, -1, -1, -1).contiguous()

    return fill(s.keys), fill(s.values)


def _filled_store(preset: str, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor) -> LayerStore:
    """A LayerStore of k, v [B, H, T, D] as a KVarNCache layer holds them (sink in fp16), where k, v repeat the
    tokens of one block after the sink and every batch row is row 0 (`_dense_kv`): the store quantizes the tiles
    of one block of row 0 and repeats them. q feeds the key-rotation policy of rotate="auto" presets."""
    b, _, t, _ = k.shape
    store = LayerStore.from_preset(get_preset(preset), k.shape[-1], exact_dtype=torch.float16)
    g = store.keys.quantizer.tile if store.keys.quantizer is not None else t
    sink = store.keys.sink_len
    block = min(t, sink + SYNTHETIC_BLOCK // g * g)
    store.append(k[:1, :, :block], v[:1, :, :block], defer_keys=True)
    store.observe_queries(q[:1])
    n = max(t - sink, 0) // g  # tiles at the full context; the rest is the exact tail
    for ts, x in ((store.keys, k), (store.values, v)):
        if ts.quantizer is None or n <= ts.n_tiles:
            continue
        if len(ts.exact_index) or (ts.tail is not None and ts.tail.shape[2]):
            raise ValueError("repeating tiles needs a block of whole, finite tiles")
        reps = -(-n // ts.n_tiles)
        ts._packed.replace(ts.packed.map(lambda f, r=reps: f.repeat(1, 1, r, *[1] * (f.dim() - 3))[:, :, :n]))
        ts.tail, ts.length = x[:1, :, sink + n * g:].clone(), t
    index = torch.zeros(b, dtype=torch.long)
    store.keys.index_batch(index)
    store.values.index_batch(index)
    if store.queries is not None:
        store.queries.index_batch(index)
    return store


def bench_attention_case(shape: HeadShape, batch: int, context: int, presets: list[str], rounds: int,
                         warmup: int = 1, seed: int = 0, profile: bool = False, tick=None) -> dict:
    """One (shape, batch, context): median seconds per decode-attention call of each contender and the ratios
    kvarn / sdpa fp32 and kvarn / sdpa bf16."""
    g = torch.Generator().manual_seed(seed)
    sink = max(get_preset(p).sink for p in presets)
    if any(get_preset(p).sink != sink for p in presets):
        raise ValueError("the attention presets must share one sink length (the K/V repeat after it)")
    k, v = _dense_kv(shape, batch, context, sink, seed)
    q = torch.randn(batch, shape.q_heads, 1, shape.head_dim, generator=g)
    fns = {}
    stores = {}
    for p in presets:
        stores[p] = _filled_store(p, k[:, :, :context], v[:, :, :context], q)
        past = KVarNPast(StoredKV.of(stores[p].keys), StoredKV.of(stores[p].values))
        kn, vn = k[:, :, context:], v[:, :, context:]
        fns[f"kvarn {p}"] = lambda past=past, kn=kn, vn=vn: packed_attention(q, kn, vn, past)
    kb, vb, qb = k.bfloat16(), v.bfloat16(), q.bfloat16()
    fns["sdpa fp32"] = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    fns["sdpa bf16"] = lambda: F.scaled_dot_product_attention(qb, kb, vb, enable_gqa=True)
    with torch.inference_mode():
        samples = interleaved_samples(fns, rounds=rounds, warmup=warmup, tick=tick)
        prof = {name: top_ops(fns[f"kvarn {name}"]) for name in presets} if profile else {}
    times = {name: spread(s) for name, s in samples.items()}
    fp32, bf16 = times["sdpa fp32"]["median_s"], times["sdpa bf16"]["median_s"]
    rows = []
    for p in presets:
        t = times[f"kvarn {p}"]["median_s"]
        held = stores[p].nbytes()
        rows.append({"preset": p, "kvarn_ms": 1e3 * t, "ratio_vs_sdpa_fp32": t / fp32, "ratio_vs_sdpa_bf16": t / bf16,
                     "kv_bytes": held.total, "profile": prof.get(p)})
    return {"shape": shape.name, "q_heads": shape.q_heads, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim,
            "batch": batch, "context": context, "sdpa_fp32_ms": 1e3 * fp32, "sdpa_bf16_ms": 1e3 * bf16,
            "dense_fp32_bytes": k.numel() * 4 * 2, "timings": times, "kvarn": rows}


def bench_attention(shapes: list[str], batches: list[int], contexts: list[int], presets: list[str], rounds: int,
                    warmup: int = 1, seed: int = 0, profile_context: int | None = None) -> dict:
    """Every (shape, batch, context) case; the kvarn contender is profiled at `profile_context`, batch 1."""
    from kvarn.eval.progress import progress

    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        raise ValueError(f"unknown attention shape(s) {unknown}; known: {sorted(SHAPES)}")
    cases = [(SHAPES[s], b, c) for s in shapes for b in batches for c in contexts]
    out = []
    with progress(total=len(cases) * rounds, desc="attention") as bar:
        for shape, b, c in cases:
            bar.set_postfix_str(f"{shape.name} B={b} T={c}")
            out.append(bench_attention_case(shape, b, c, presets, rounds, warmup, seed,
                                            profile=(c == profile_context and b == min(batches)),
                                            tick=lambda: bar.update(1)))
    return {"path": attention_path(), "rounds": rounds, "warmup": warmup, "presets": presets,
            "synthetic_block": SYNTHETIC_BLOCK, "threads": torch.get_num_threads(), "cases": out}
