"""Decode speed of the embedded model at ~1k context: DynamicCache vs KVarNCache (reference reads, packed reads).

    .venv/bin/python benchmarks/decode_speed.py [--context 1024] [--steps 32] [--preset kvarn-k2v2-g128] [--threads 1]

Each run prefills the first `context` tokens of WikiText-2 and then feeds the next `steps` tokens one at a time
(teacher forcing, so every method does the same work); tokens/s counts those decode steps only. Methods run
interleaved `--repeats` times and the best time of each is kept (the machine may be shared).
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import DynamicCache

import kvarn.attention
from kvarn.cache.hf import KVarNCache
from kvarn.eval.common import load_tokens, provenance
from kvarn.models import load_model


def run(model, ids, context, make_cache, impl):
    kvarn.attention.enable(model, impl)
    cache = make_cache()
    with torch.no_grad():
        model(ids[:, :context], cache=cache)
        t = time.perf_counter()
        for i in range(context, ids.shape[1]):
            model(ids[:, i:i + 1], cache=cache)
        return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--preset", default="kvarn-k2v2-g128")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model("default")
    before = model.config._attn_implementation
    ids = load_tokens(tok, None, args.context + args.steps)
    methods = {
        "DynamicCache (sdpa)": (lambda: DynamicCache(config=model.config), before),
        f"KVarNCache {args.preset} reference (sdpa)": (lambda: KVarNCache(model.config, args.preset), before),
        f"KVarNCache {args.preset} packed (kvarn)": (lambda: KVarNCache(model.config, args.preset), "kvarn"),
    }
    best = {name: float("inf") for name in methods}
    for _ in range(args.repeats):
        for name, (make, impl) in methods.items():
            best[name] = min(best[name], run(model, ids, args.context, make, impl))
    kvarn.attention.enable(model, before)
    rows = {name: {"seconds": t, "tokens_per_s": args.steps / t} for name, t in best.items()}
    for name, r in rows.items():
        print(f"{name:55s} {r['tokens_per_s']:7.2f} tok/s  ({r['seconds']:.2f} s for {args.steps} steps)")
    if args.json:
        from kvarn.eval.common import write_json

        write_json(args.json, {"provenance": provenance(**vars(args)), "results": rows})


if __name__ == "__main__":
    main()
