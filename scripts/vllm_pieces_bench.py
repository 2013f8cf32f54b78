"""Prompt pieces over a decoded past, the backend's two routes, outside the engine: `paged._batched_pieces` (PyTorch's
masked SDPA, one call per shape) against `paged._vllm_pieces` (ONE call of vLLM's CPU attention over a scratch page
cache, its fill included). Needs vLLM (`make vllm-venv`).

    .venv-vllm/bin/python scripts/vllm_pieces_bench.py [--requests 8] [--pieces 4]

SmolLM2-135M's geometry (3 KV heads, 9 query heads, D = 64, bf16, G = 128): R requests whose prompts are P pieces of
128 rows; pieces 1 .. P-1 each read their request's decoded past (random rows standing for decoded tiles) and their
own exact block, causally, as in a prefill step (piece 0 reads no past: neither route serves it). Prints the largest
difference of the two routes (bf16 rounding) and the wall time of each per layer (mean of 5 calls, this process's
threads). Used for docs/VLLM.md.
"""

from __future__ import annotations

import argparse
import time

import torch

from kvarn.integrations.vllm import paged

H, HQ, D, G = 3, 9, 64, 128


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--pieces", type=int, default=4)
    args = ap.parse_args()
    dt = torch.bfloat16
    ops = paged.vllm_cpu_attention(dt, G, D)
    if ops is None:
        raise SystemExit("vLLM's CPU attention is not available here (install vLLM: make vllm-venv)")
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dt)

    decoded = {i: (rand(1, H, (args.pieces - 1) * G, D), rand(1, H, (args.pieces - 1) * G, D))
               for i in range(args.requests)}
    waiting = []  # as attend_step lists them: (request, plan, block j, rows, q [1, Hq, G, D], k, v [H, G, D])
    query = rand(args.requests * (args.pieces - 1) * G, HQ, D)  # the step's queries [T, Hq, D]
    for j in range(1, args.pieces):
        for i in range(args.requests):
            rows = slice(len(waiting) * G, (len(waiting) + 1) * G)
            waiting.append((i, None, j, rows, query[rows].transpose(0, 1)[None], rand(H, G, D), rand(H, G, D)))
    scale = D ** -0.5

    def sdpa() -> torch.Tensor:
        outs = []
        for j in range(1, args.pieces):  # every request's piece j: one shape, one call
            pieces = [(rows, q, k, v, tuple(x[:, :, :j * G] for x in decoded[i]))
                      for i, _, jj, rows, q, k, v in waiting if jj == j]
            outs.append(paged._batched_pieces(None, pieces, scale, None, dt).flatten(0, 1))
        return torch.cat(outs)

    def vllm() -> torch.Tensor:
        out = torch.empty_like(query)
        paged._vllm_pieces(ops, waiting, None, decoded, scale, G, query, out)
        return out

    diff = (sdpa().float() - vllm().float()).abs().max().item()
    print(f"{args.requests} requests x {args.pieces} pieces of {G} rows, isa {ops[1]}: largest difference {diff:.4f}")
    for name, f in (("SDPA by shape (`_batched_pieces`)", sdpa), ("vLLM's CPU attention (`_vllm_pieces`)", vllm)):
        f()
        t = time.perf_counter()
        for _ in range(5):
            f()
        print(f"  {name}: {(time.perf_counter() - t) / 5 * 1e3:.2f} ms a layer")


if __name__ == "__main__":
    main()
