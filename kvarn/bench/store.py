"""Tile-store cost: time to encode (quantize + pack) one flush of tiles of every layer and KV head,
per preset, side by side with the paper's KVarN preset, plus the bits it stores."""

from __future__ import annotations

import torch

from kvarn.bench.timing import interleaved_median
from kvarn.presets import get_preset


def bench_store(kv: list[tuple[torch.Tensor, torch.Tensor]], presets: list[str], rounds: int = 5,
                baseline: str = "kvarn-k2v2-g128") -> list[dict]:
    """kv: per layer (keys, values) [B, H, T, D] (real activations); one flush = the first `tile` tokens of
    every layer and head, keys and values."""
    head_dim = kv[0][0].shape[-1]
    fns = {}
    for name in dict.fromkeys([baseline, *presets]):
        p = get_preset(name)
        if not p.quantized:
            continue
        if kv[0][0].shape[2] < p.tile:
            raise ValueError(f"need at least {p.tile} tokens of K/V for preset {name}, got {kv[0][0].shape[2]}")
        kq, vq = p.quantizers(head_dim)
        kt = torch.cat([k[:, :, : p.tile].reshape(-1, kq.tile, head_dim) for k, _ in kv])
        vt = torch.cat([v[:, :, : p.tile].reshape(-1, vq.tile, head_dim) for _, v in kv])
        fns[p.name] = lambda kq=kq, vq=vq, kt=kt, vt=vt: (kq.encode(kt), vq.encode(vt))
    with torch.inference_mode():
        times = interleaved_median(fns, rounds=rounds)
    base = times[get_preset(baseline).name]
    return [{"preset": name, "ms_per_flush": 1e3 * t, "ratio_vs_baseline": t / base, "baseline": baseline,
             "bits_per_element": get_preset(name).bits_per_element(head_dim)} for name, t in times.items()]
