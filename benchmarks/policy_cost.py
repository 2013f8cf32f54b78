"""What the per-tile rotation choice costs at store time: encode of kvarn vs kvarn-auto tiles, one run.

    .venv/bin/python benchmarks/policy_cost.py [--tiles 90,1024] [--head-dim 64] [--repeats 15] [--json FILE]

One "tile" here is a key tile plus a value tile, as the cache stores them. kvarn-auto encodes each tile twice
(rotated and plain, both VarN + RTN), decodes both and compares their errors (kvarn.quant.policy), so about 2x
the work of kvarn is expected. The two are timed alternately (kvarn, auto, kvarn, auto, ...) so that load from
other processes hits both alike; the report is the median per tile and the ratio of medians. 90 tiles = one
flush of SmolLM2 (30 layers x 3 KV heads).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from tqdm import tqdm

from kvarn.eval.common import provenance
from kvarn.presets import get_preset


def timed(fn, *args, **kwargs) -> float:
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - t0


def measure(n: int, d: int, repeats: int, g: int = 128) -> dict:
    """Median seconds of encoding n key tiles and n value tiles [n, g, d], kvarn vs kvarn-auto (alternating)."""
    (kk, kv), (ak, av) = get_preset(f"kvarn-k2v2-g{g}").quantizers(d), get_preset(f"kvarn-auto-k2v2-g{g}").quantizers(d)
    gen = torch.Generator().manual_seed(n)
    # heavy-tailed tiles with a few high-variance channels, and a query energy per channel
    x = torch.randn(n, g, d, generator=gen) / torch.rand(n, g, d, generator=gen).clamp_min(0.05).sqrt()
    x[..., :4] *= 20
    w = torch.rand(n, d, generator=gen) + 0.1

    def kvarn_store() -> None:
        kk.encode(x)
        kv.encode(x)

    def auto_store() -> None:
        ak.encode(x, weight=w)
        av.encode(x)

    kvarn_store()
    auto_store()  # warm-up
    t_k, t_a = [], []
    for _ in tqdm(range(repeats), desc=f"{n} tiles", leave=False):
        t_k.append(timed(kvarn_store))
        t_a.append(timed(auto_store))
    mk, ma = statistics.median(t_k), statistics.median(t_a)
    return {"tiles": n, "head_dim": d, "tile": g, "repeats": repeats, "kvarn_ms_per_tile": 1e3 * mk / n,
            "auto_ms_per_tile": 1e3 * ma / n, "ratio": ma / mk}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiles", default="90,1024", help="comma-separated numbers of tiles per encode call")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results (with provenance)")
    a = p.parse_args()
    rows = [measure(int(n), a.head_dim, a.repeats) for n in a.tiles.split(",")]
    print(f"threads={torch.get_num_threads()}")
    print("| K+V tiles per call | kvarn ms/tile | kvarn-auto ms/tile | ratio |\n| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['tiles']} | {r['kvarn_ms_per_tile']:.3f} | {r['auto_ms_per_tile']:.3f} | {r['ratio']:.2f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"provenance": provenance(**vars(a)), "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
