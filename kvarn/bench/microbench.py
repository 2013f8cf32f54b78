"""Micro-benchmarks of the CPU kernels over one layer (not tests; `kvarn bench attention|store` are the tools).

    python -m kvarn.bench.microbench [--contexts 1024 8192] [--threads 1 2] [--repeats 15]
    python -m kvarn.bench.microbench --store [--calls 300]
    python -m kvarn.bench.microbench --prefill [--contexts 2048 4096] [--threads 2]

--prefill: one prefill chunk of 128 queries through `packed_attention` (PyTorch path; the fused kernel is a decode
kernel) over a kvarn-auto-k2v2-g128 past of `context` tokens, the task model's layer (Qwen2.5-0.5B: 14 query / 2 KV
heads, head_dim 64), float32: the two read orders of the same arithmetic, "fold" (scales folded into every query
row, `FOLD_MAX_ROWS` raised) and "decode" (the layer decoded, then fused SDPA: the default above FOLD_MAX_ROWS
rows), and SDPA over the dense K/V it was quantized from; interleaved rounds (`kvarn.bench.timing`), median.

--store: the tile-store kernel alone, one layer of the embedded model (3 KV heads: bf16 tiles [3, 128, 64] of keys,
then of values) for kvarn-k2v2-g128 and kvarn-auto-k2v2-g128, on one thread, CPU time per call (`time.thread_time`,
so time the other load on the machine takes is not counted), 10th percentile and median of `calls` calls after 20
untimed ones (random tiles, seed 0; the query weight of auto uniform in [0, 1)).

For each shape (the embedded model: 9 query / 3 KV heads, head_dim 64; a Qwen3-4B-like layer: 32 / 8, head_dim 128),
context and thread count, batch 1, times side by side in one process, interleaved, median of `repeats` rounds of
`inner` calls each: the fused kernel through `packed_attention` (kvarn-k2v2-g128 past: 128 sink tokens, tiles, a
tail), the PyTorch packed path (KVARN_KERNEL=torch), and SDPA over dense fp32 and bf16 K/V of the same length.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from functools import partial

import torch

SHAPES = {"embedded (9q/3kv, d64)": (9, 3, 64), "qwen3-4b-like (32q/8kv, d128)": (32, 8, 128)}


def _past(hkv: int, d: int, t: int, preset: str, gen: torch.Generator):
    from kvarn.attention.packed import KVarNPast
    from kvarn.attention.view import StoredKV
    from kvarn.cache.store import LayerStore
    from kvarn.presets import get_preset

    st = LayerStore.from_preset(get_preset(preset), d)
    k, v = torch.randn(1, hkv, t, d, generator=gen), torch.randn(1, hkv, t, d, generator=gen)
    st.append(k, v)
    return KVarNPast(StoredKV.of(st.keys), StoredKV.of(st.values)), k, v


def _time(fn, inner: int) -> float:
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner * 1e3


def _cases(q, kn, vn, past, kd, vd) -> dict:
    from kvarn.attention.packed import packed_attention

    kb, vb, qb = kd.bfloat16(), vd.bfloat16(), q.bfloat16()
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def fused():
        os.environ["KVARN_KERNEL"] = "cpu"
        packed_attention(q, kn, vn, past)

    def torch_path():
        os.environ["KVARN_KERNEL"] = "torch"
        packed_attention(q, kn, vn, past)

    return {"fused": fused, "torch packed": torch_path, "sdpa fp32": lambda: sdpa(q, kd, vd, enable_gqa=True),
            "sdpa bf16": lambda: sdpa(qb, kb, vb, enable_gqa=True)}


def run(contexts: list[int], threads: list[int], repeats: int, preset: str) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, (hq, hkv, d) in SHAPES.items():
        for t in contexts:
            past, k, v = _past(hkv, d, t - 1, preset, gen)
            q = torch.randn(1, hq, 1, d, generator=gen)
            kn, vn = torch.randn(1, hkv, 1, d, generator=gen), torch.randn(1, hkv, 1, d, generator=gen)
            kd, vd = torch.cat([k, kn], 2), torch.cat([v, vn], 2)
            cases = _cases(q, kn, vn, past, kd, vd)
            for nt in threads:
                torch.set_num_threads(nt)
                for fn in cases.values():  # warm up (and build the kernel)
                    fn()
                inner = max(3, int(2e-3 / max(1e-5, _time(cases["fused"], 3) / 1e3)))
                times = {c: [] for c in cases}
                for _ in range(repeats):
                    for c, fn in cases.items():
                        times[c].append(_time(fn, inner))
                med = {c: statistics.median(x) for c, x in times.items()}
                rows.append({"shape": name, "context": t, "threads": nt, **med})
                print(f"{name:30s} T={t:6d} threads={nt}  " + "  ".join(f"{c} {m:.3f} ms" for c, m in med.items())
                      + f"  fused/sdpa32 {med['fused'] / med['sdpa fp32']:.2f}x"
                      + f"  fused/sdpa bf16 {med['fused'] / med['sdpa bf16']:.2f}x", flush=True)
    os.environ.pop("KVARN_KERNEL", None)
    return rows


def run_store(calls: int, presets: tuple[str, ...] = ("kvarn-k2v2-g128", "kvarn-auto-k2v2-g128")) -> list[dict]:
    from kvarn.presets import get_preset

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 128, 64, generator=gen).bfloat16()
    w = torch.rand(3, 64, generator=gen)
    rows = []
    for name in presets:
        p = get_preset(name)
        for kind, q in (("keys", p.key(64)), ("values", p.value(64))):
            for _ in range(20):
                q.encode_kernel(x, w)
            ts = []
            for _ in range(calls):
                t0 = time.thread_time()
                q.encode_kernel(x, w)
                ts.append(time.thread_time() - t0)
            ts.sort()
            rows.append({"preset": name, "kind": kind, "p10_us": 1e6 * ts[len(ts) // 10],
                         "median_us": 1e6 * statistics.median(ts)})
            r = rows[-1]
            print(f"{name:22s} {kind:6s} 3 tiles: p10 {r['p10_us']:.0f} us, median {r['median_us']:.0f} us (CPU time, "
                  "1 thread)", flush=True)
    return rows


def _read_order(rows: int, args: tuple) -> None:
    """packed_attention's PyTorch path with FOLD_MAX_ROWS = rows (restored after the call)."""
    import kvarn.attention.packed as packed

    default, packed.FOLD_MAX_ROWS = packed.FOLD_MAX_ROWS, rows
    try:
        packed.packed_attention(*args, kernel=False)
    finally:
        packed.FOLD_MAX_ROWS = default


def run_prefill(contexts: list[int], threads: list[int], repeats: int, chunk: int = 128,
                preset: str = "kvarn-auto-k2v2-g128") -> list[dict]:
    from kvarn.bench.timing import interleaved_median

    gen = torch.Generator().manual_seed(0)
    hq, hkv, d = 14, 2, 64
    rows = []
    for t in contexts:
        past, k, v = _past(hkv, d, t, preset, gen)
        q = torch.randn(1, hq, chunk, d, generator=gen)
        kn, vn = torch.randn(1, hkv, chunk, d, generator=gen), torch.randn(1, hkv, chunk, d, generator=gen)
        kd, vd = torch.cat([k, kn], 2), torch.cat([v, vn], 2)
        causal = torch.ones(chunk, t + chunk, dtype=torch.bool).tril(t)
        args = (q, kn, vn, past)
        cases = {"fold": partial(_read_order, 1 << 30, args), "decode": partial(_read_order, 0, args),
                 "sdpa fp32": partial(torch.nn.functional.scaled_dot_product_attention, q, kd, vd, attn_mask=causal,
                                      enable_gqa=True)}
        for nt in threads:
            torch.set_num_threads(nt)
            med = {c: 1e3 * m for c, m in interleaved_median(cases, repeats).items()}
            rows.append({"context": t, "threads": nt, "chunk": chunk, **med})
            print(f"prefill chunk {chunk} over T={t:6d} threads={nt}  " + "  ".join(f"{c} {m:.2f} ms" for c, m in
                  med.items()) + f"  fold/decode {med['fold'] / med['decode']:.2f}x", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--preset", default="kvarn-k2v2-g128")
    ap.add_argument("--store", action="store_true", help="time the tile-store kernel instead (module docstring)")
    ap.add_argument("--calls", type=int, default=300, help="--store: timed calls per case")
    ap.add_argument("--prefill", action="store_true", help="time a prefill chunk's read orders (module docstring)")
    a = ap.parse_args()
    if a.store:
        run_store(a.calls)
    elif a.prefill:
        run_prefill(a.contexts, a.threads, a.repeats)
    else:
        run(a.contexts, a.threads, a.repeats, a.preset)


if __name__ == "__main__":
    main()
