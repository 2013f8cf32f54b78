"""Prefill time of budget presets against their base, and where a budget preset's prefill goes: one forward over a
prompt of random token ids, the cache passed as a user passes it, 1 thread, presets alternated for `--rounds`
rounds (registered presets and scripts/budget_variants.py's); then cProfile's top lines (cumulative) of one more
prefill with `--profile`'s preset. Used for docs/TASKS.md
("Speed of version 3": the allocation's scoring in prefill).

    PYTHONPATH=$PWD .venv/bin/python scripts/budget_prefill.py [--model default] [--tokens 4096] \\
        [--presets kvarn-auto-k2v2-g128,kvarn-b2.5] [--rounds 2] [--profile kvarn-b2.5]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
from budget_variants import register_variants  # the lab variants (this folder) by name too

from kvarn.integrations.transformers import KVarNCache
from kvarn.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--presets", default="kvarn-auto-k2v2-g128,kvarn-b2.5")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--profile", default="kvarn-b2.5", help="preset profiled after the timing ('' for none)")
    args = ap.parse_args()
    register_variants()
    torch.set_num_threads(1)
    model, _ = load_model(args.model)
    ids = torch.randint(100, 20000, (1, args.tokens), generator=torch.Generator().manual_seed(0))

    @torch.no_grad()
    def prefill(preset: str) -> None:
        model(ids, cache=KVarNCache(model.config, preset), use_cache=True, logits_to_keep=1)

    for r in range(args.rounds):
        for preset in args.presets.split(","):
            t0 = time.perf_counter()
            prefill(preset)
            print(f"round {r}: {preset} prefill of {args.tokens} tokens {time.perf_counter() - t0:.2f} s", flush=True)
    if args.profile:
        prof = cProfile.Profile()
        prof.runcall(prefill, args.profile)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
