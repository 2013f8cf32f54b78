"""Prompt pieces over a decoded past, two ways, outside the engine: PyTorch's masked SDPA batched by shape (what
`paged._batched_pieces` does) against ONE call of vLLM's CPU attention over a scratch page cache whose block tables
share the decoded blocks (what `paged._vllm_pieces` does). Needs vLLM (`make vllm-venv`).

    .venv-vllm/bin/python scripts/vllm_pieces_bench.py [--requests 8] [--pieces 4]

SmolLM2-135M's geometry (3 KV heads, 9 query heads, D = 64, bf16, G = 128): R requests whose prompts are P pieces of
128 rows; piece j reads the request's j decoded blocks and its own exact block, causally. Prints the largest
difference of the two (bf16 rounding) and the wall time of each per layer (mean of 5 calls, this process's threads);
the scratch pages' fill (`cpu_attn_reshape_and_cache` of every block) is timed apart. Used for docs/VLLM.md.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

H, HQ, D, G = 3, 9, 64, 128


def main() -> None:
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--pieces", type=int, default=4)
    args = ap.parse_args()
    r_, p_ = args.requests, args.pieces
    gen = torch.Generator().manual_seed(0)
    dt = torch.bfloat16
    dk, dv, ek, ev = (torch.randn(r_, p_, H, G, D, generator=gen).to(dt) for _ in range(4))  # decoded / exact blocks
    q = torch.randn(r_, p_, G, HQ, D, generator=gen).to(dt)
    scale = D ** -0.5

    def sdpa() -> torch.Tensor:
        outs = []
        for j in range(p_):  # all requests' piece j in one call
            k = torch.cat([dk[:, :j].permute(0, 2, 1, 3, 4).reshape(r_, H, j * G, D), ek[:, j]], 2)
            v = torch.cat([dv[:, :j].permute(0, 2, 1, 3, 4).reshape(r_, H, j * G, D), ev[:, j]], 2)
            ok = torch.ones(G, (j + 1) * G, dtype=torch.bool).tril(j * G)
            o = F.scaled_dot_product_attention(q[:, j].transpose(1, 2), k, v, attn_mask=ok, scale=scale,
                                               enable_gqa=True)
            outs.append(o.transpose(1, 2))
        return torch.stack(outs, 1).reshape(-1, HQ, D)

    n = r_ * p_ * 2  # scratch blocks: request r's decoded block j at 2 (r P + j), its exact block j after it
    cache = torch.empty(n, H, 2 * G, D, dtype=dt)
    key_cache, value_cache = cache.chunk(2, dim=2)
    isa = _get_attn_isa(dt, G, D)
    keys = torch.stack([dk, ek], 2).permute(0, 1, 2, 4, 3, 5).reshape(n * G, H, D)  # [R, P, 2, G, H, D] flattened
    values = torch.stack([dv, ev], 2).permute(0, 1, 2, 4, 3, 5).reshape(n * G, H, D)
    slots = torch.arange(n * G)

    def fill() -> None:
        ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa)

    fill()
    table = torch.zeros(r_ * p_, p_, dtype=torch.int32)
    for r in range(r_):
        for j in range(p_):
            table[r * p_ + j, :j + 1] = torch.tensor([2 * (r * p_ + i) for i in range(j)] + [2 * (r * p_ + j) + 1])
    seq = torch.tensor([(j + 1) * G for _ in range(r_) for j in range(p_)], dtype=torch.int32)
    start = torch.arange(0, (r_ * p_ + 1) * G, G, dtype=torch.int32)
    query = q.reshape(-1, HQ, D).contiguous()
    out = torch.empty_like(query)
    meta = ops.cpu_attn_get_scheduler_metadata(num_reqs=r_ * p_, num_heads=HQ, num_kv_heads=H, head_dim=D,
                                               seq_lens=seq, dtype=dt, query_start_loc=start, causal=True,
                                               sliding_window_size=-1, isa=isa, enable_kv_split=False)

    def vllm() -> torch.Tensor:
        ops.cpu_attention_with_kv_cache(query=query, key_cache=key_cache, value_cache=value_cache, output=out,
                                        query_start_loc=start, seq_lens=seq, scale=scale, causal=True,
                                        alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0.0,
                                        scheduler_metadata=meta, s_aux=None)
        return out

    diff = (sdpa().float() - vllm().float()).abs().max().item()
    print(f"{r_} requests x {p_} pieces of {G} rows, isa {isa}: largest difference {diff:.4f} (bf16)")
    for name, f in (("SDPA by shape", sdpa), ("vLLM CPU attention, one call", vllm), ("the scratch pages' fill", fill)):
        f()
        t = time.perf_counter()
        for _ in range(5):
            f()
        print(f"  {name}: {(time.perf_counter() - t) / 5 * 1e3:.2f} ms a layer")


if __name__ == "__main__":
    main()
