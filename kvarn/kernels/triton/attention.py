"""Decode attention entry points on top of `ops`: query regrouping (GQA), rotation of the query and of the output.

    paged_decode(query [B, Hq, D], keys, values: TileFields, block_table, n_blocks, exact)  -> [B, Hq, D]
        one query token per batch row (a vLLM decode batch); exact regions (k, v [B, Hkv, t, D], lengths [B] or
        None) share the softmax: the sink, the tile being filled, the fresh token.
    packed_decode(query [B, Hq, 1, D], key, value [B, Hkv, 1, D], past: KVarNPast)  -> [B, 1, Hq, D]
        the transformers cache (`kvarn.attention.packed.packed_attention` for one decode step, no mask).

Query head kv * g + j reads KV head kv (g = Hq / Hkv); its row in the kernel is j. q~ = q H (computed once when a
kind is rotated); o = out_rot H + out_plain.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvarn.kernels.triton.ops import Precision, TileFields, decode_attention, hadamard_f32

if TYPE_CHECKING:  # not imported at run time: kvarn.attention needs transformers, the vLLM path does not
    from kvarn.attention.packed import KVarNPast
    from kvarn.attention.view import StoredKV

Exact = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def paged_decode(query: torch.Tensor, keys: TileFields, values: TileFields, block_table: torch.Tensor,
                 n_blocks: torch.Tensor, exact: Sequence[Exact] = (), scaling: float | None = None,
                 blocks_per_split: int | None = None, precision: Precision = "auto",
                 splits: int | None = None) -> torch.Tensor:
    """softmax(q K^T * scaling) V for one query token per batch row over packed tiles + exact regions; splits: a
    fixed split count (`ops.decode_partials`)."""
    if query.dim() != 3:
        raise ValueError(f"query must be [B, Hq, D], got {tuple(query.shape)}")
    b, hq, d = query.shape
    hkv = keys.heads
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads")
    scale = d ** -0.5 if scaling is None else scaling
    qs = query.float().reshape(b, hkv, hq // hkv, d) * scale  # [B, Hkv, g, D]
    rotated = keys.rotate != "none" or values.rotate != "none"
    h = hadamard_f32(d, query.device) if rotated else None
    qh = qs @ h if rotated else None
    out_r, out_p = decode_attention(qs, qh, keys, values, block_table, n_blocks, exact, blocks_per_split, precision,
                                    splits)
    out = out_p + out_r @ h if values.rotate != "none" else out_p
    return out.reshape(b, hq, d).to(query.dtype)


def _refuse(view: StoredKV, kind: str) -> None:
    if view.post is not None:
        raise ValueError(f"the Triton decode reads post-RoPE {kind}; this cache stores them before RoPE")
    if len(view.exact_index):
        raise ValueError(f"the Triton decode does not read tiles kept exact (non-finite input); {kind} have "
                         f"{len(view.exact_index)}: use kvarn.attention.packed_attention")


def packed_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, past: KVarNPast,
                  scaling: float | None = None, blocks_per_split: int | None = None,
                  precision: Precision = "auto") -> torch.Tensor:
    """One decode step of the transformers cache: query [B, Hq, 1, D], fresh key/value [B, Hkv, 1, D], the stored
    past (sink | packed tiles | tail) -> [B, 1, Hq, D], as `packed_attention` with no mask."""
    if query.dim() != 4 or query.shape[2] != 1 or key.shape[2] != 1:
        raise ValueError(f"packed_decode takes one new token per row (query [B, Hq, 1, D]), got query "
                         f"{tuple(query.shape)}, key {tuple(key.shape)}")
    kv, vv = past.keys, past.values
    exact: list[Exact] = []
    if kv is None or not kv.n_tiles:
        raise ValueError("packed_decode needs at least one packed tile; attend with packed_attention before that")
    if kv.n_tiles != vv.n_tiles or kv.sink_len != vv.sink_len or kv.tail_len != vv.tail_len:
        raise ValueError("packed_decode needs keys and values stored with the same boundaries (sink, tiles, tail)")
    _refuse(kv, "keys")
    _refuse(vv, "values")
    keys = TileFields.from_cache(kv.packed)
    values = TileFields.from_cache(vv.packed)
    b = query.shape[0]
    table = torch.arange(kv.n_tiles, dtype=torch.int32, device=query.device).expand(b, -1)
    n_blocks = torch.full((b,), kv.n_tiles, dtype=torch.int32, device=query.device)
    if kv.sink_len:
        exact.append((kv.sink, vv.sink, None))
    if kv.tail_len:
        exact.append((kv.tail, vv.tail, None))
    exact.append((key, value, None))
    out = paged_decode(query[:, :, 0], keys, values, table, n_blocks, exact, scaling, blocks_per_split, precision)
    return out.unsqueeze(1)
