"""The reference read path: dequantize the whole stored layer, then plain softmax attention (the oracle).

    K = [stored keys dequantized | fresh keys],  V likewise                       [B, Hkv, T, D]
    S = q K^T * scaling (per query head, KV head = query head // (Hq / Hkv))     [B, Hq, L, T]
    S = softcap * tanh(S / softcap)                                               if softcap
    P = softmax(S + mask) (masked entries -inf; rows with nothing allowed give 0, as SDPA does)
    out = P V                                                                      [B, L, Hq, D]

This is what `KVarNLayer.update` hands to non-"kvarn" attention implementations (as dequantized K/V), and what the
packed path is checked against. Computed in `dtype` (float64 by default), written plainly.
"""

from __future__ import annotations

import torch

from kvarn.attention.packed import KVarNPast, allowed


def past_kv(past: KVarNPast | None, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor | None, ...]:
    """Stored keys and values dequantized, [B, Hkv, T_past, D] each, or (None, None)."""
    if past is None or past.keys is None:
        return None, None
    return past.keys.dequantized(dtype), past.values.dequantized(dtype)


def reference_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None = None, scaling: float | None = None,
                        softcap: float | None = None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """query [B, Hq, L, D], key/value [B, Hkv, T, D] (all of them), mask as in `packed_attention`; -> [B, L, Hq, D]."""
    b, hq, length, d = query.shape
    g = hq // key.shape[1]
    k = key.to(dtype).repeat_interleave(g, dim=1)
    v = value.to(dtype).repeat_interleave(g, dim=1)
    s = query.to(dtype) @ k.transpose(-1, -2) * (d ** -0.5 if scaling is None else scaling)
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        s = s + attention_mask.to(dtype)
    ok = allowed(attention_mask, b, length, k.shape[2], query.device)
    s = s.masked_fill(~ok, float("-inf"))
    p = torch.where(ok.any(-1, keepdim=True), torch.softmax(s, dim=-1), 0)
    return (p @ v).transpose(1, 2)


def reference_from_past(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, past: KVarNPast | None,
                        attention_mask: torch.Tensor | None = None, scaling: float | None = None,
                        softcap: float | None = None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Same inputs as `packed_attention`: dequantize the past, concatenate the fresh K/V, attend."""
    pk, pv = past_kv(past, dtype)
    k = key.to(dtype) if pk is None else torch.cat([pk, key.to(dtype)], dim=2)
    v = value.to(dtype) if pv is None else torch.cat([pv, value.to(dtype)], dim=2)
    return reference_attention(query, k, v, attention_mask, scaling, softcap, dtype)
