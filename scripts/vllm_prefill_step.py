"""CPU time of one layer of the vLLM backend's prefill step, without vLLM's engine: `observe_queries` + `write_step`
(the tile store of every completed block) and `attend_step` (the prompt pieces over their decoded pasts, one call of
vLLM's CPU attention where it serves them) for R prompts of P tokens arriving in one step, SmolLM2-135M's geometry
(3 KV heads, 9 query heads, D = 64, bf16, G = 128, one sink block), fresh page pools each time. Needs vLLM's CPU ops
for the pieces' attention (`make vllm-venv`); without them the pieces take PyTorch's SDPA.

    PYTHONPATH=$PWD .venv-vllm/bin/python scripts/vllm_prefill_step.py [PRESET] [--requests 8] [--prompt-tokens 512]
        [--threads 2] [--repeat 10] [--profile] [--save FILE]

Prints the median wall time (`time.perf_counter`) of the write and the attend over --repeat steps; --profile adds
cProfile's top lines of 5 steps; --save FILE writes the attend's output of one step (seed 0) with torch.save, to
compare two versions of the code bit for bit. Used for docs/VLLM.md ("The prompt path").
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

from kvarn.integrations.vllm import paged
from kvarn.integrations.vllm.layout import TileLayout, choose_geometry
from kvarn.integrations.vllm.pool import LayerPool, SlotTable
from kvarn.presets import get_preset

H, HQ, D, G, LAYERS = 3, 9, 64, 128, 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("preset", nargs="?", default="kvarn-k2v2-g128")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--save", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    r, p = args.requests, args.prompt_tokens
    bf = torch.bfloat16
    # oneDNN's first bf16 SDPA asks the kernel for the AMX tile state, which vLLM's AMX attention needs as well
    torch.nn.functional.scaled_dot_product_attention(*(torch.randn(1, 2, 256, D, dtype=bf),) * 3)
    lay = TileLayout(get_preset(args.preset), D, bf)
    geo = choose_geometry(lay, H, LAYERS, 2**30, slots=3 * 16)
    per = -(-p // G)

    def fresh():
        pool = LayerPool(torch.zeros(2000, H, G, geo.c, dtype=torch.uint8), geo)  # as vllm_layer_step.py
        table = SlotTable(pool.n_slots, G, 1)
        blocks = [list(range(1 + per * i, 1 + per * (i + 1))) for i in range(r)]
        plan = table.plan([(p * i, p * (i + 1)) for i in range(r)], [0] * r, [p] * r, blocks)
        return pool, plan

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(r * p, h, D, generator=gen).to(bf) for h in (HQ, H, H))

    def step(pool, plan, times: list) -> torch.Tensor:
        out = torch.zeros_like(q)
        t0 = time.perf_counter()
        paged.observe_queries(pool, q)
        exact = paged.write_step(pool, plan, k, v, "bench")
        t1 = time.perf_counter()
        paged.attend_step(pool, plan, q, out, exact, D ** -0.5, None, "bench")
        times.append((t1 - t0, time.perf_counter() - t1))
        return out

    for _ in range(3):
        step(*fresh(), [])
    times: list = []
    for _ in range(args.repeat):
        step(*fresh(), times)
    write, attend = (statistics.median(t[i] for t in times) * 1e3 for i in (0, 1))
    print(f"{args.preset}: {r} prompts of {p} tokens in one step, {args.threads} threads: write {write:.2f} ms, "
          f"attend {attend:.2f} ms a layer (median of {args.repeat})")
    if args.save:
        torch.save(step(*fresh(), []), args.save)
    if args.profile:
        steps = [fresh() for _ in range(5)]
        prof = cProfile.Profile()
        prof.enable()
        for s in steps:
            step(*s, [])
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
