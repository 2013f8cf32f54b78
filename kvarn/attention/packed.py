"""Attention straight from the packed cache (docs/SPEC.md §4): attn_implementation "kvarn", and every implementation of
transformers' AttentionInterface once wrapped by `reading_packed` (kvarn.attention does it for "sdpa" and the rest).

Hand-off from the cache (`kvarn.attention.handoff`): under packed reads, `KVarNLayer.update` returns the *fresh* K/V
of the current tokens and attaches a `KVarNPast` (views of the stored keys and values, taken before the fresh tokens
were appended) to the returned key tensor. The modeling code passes that tensor untouched to the attention function;
one that lost the past on the way raises (`handoff.take`). A key without a past (empty cache, sliding-window layers,
another cache class) is the wrapped implementation's own attention over `key`/`value`.

For one layer, queries q [B, Hq, L, D] and KV heads Hkv (GQA groups g = Hq / Hkv): q is regrouped to
[B, Hkv, M = g*L, D], so one pass over a KV head serves all its query heads. Key segments, in position order:

    sink (exact) | packed tiles | tail (exact) | fresh keys (exact)

Logits of every segment are computed exactly, concatenated, masked, soft-capped if asked, and go through ONE
softmax (exact logits concatenated, not an online log-sum-exp: on CPU the full logit row of a decode step is small);
the probabilities are split by the value store's own segment boundaries (values may flush on a sliding window).

Packed tiles of an `AffineQuantizer` (the KVarN family), with W~ the tile in the (possibly) rotated basis:
    keys, rows = channels:   W~[g, d] = (code[d, g] a_d + z_d) t_g
        logit_g = t_g (sum_d (q~_d a_d) code[d, g] + sum_d q~_d z_d)        a, z folded into the query per tile
    keys, rows = tokens:     W~[g, d] = (code[g, d] a_g + z_g) c_d
        logit_g = a_g sum_d (q~_d c_d) code[g, d] + z_g sum_d q~_d c_d
    values, rows = tokens:   o~_d += c_d (sum_g (p_g a_g) code[g, d] + sum_g p_g z_g)   a, z folded into p, c after
    values, rows = channels: o~_d += a_d sum_g (p_g t_g) code[d, g] + z_d sum_g p_g t_g
with q~ = q H on rotated tiles (per-tile flag for rotate="auto", computed once) and the value output rotated back,
o = (sum over rotated tiles of o~) H + (sum over plain tiles of o~). Both products with H are dense matmuls with the
matrix of `ops.hadamard` (only M = groups * L rows each, where one matmul is cheaper than the butterfly's stages).
Codes are unpacked with `kvarn.quant.affine.row_codes` and everything is vectorized over batch, heads and tiles;
tiles are processed in chunks of bounded size (`TILE_CHUNK_ELEMENTS` unpacked codes) so the full-precision K/V of the
whole context is never materialized at once.
Tiles kept exact (non-finite input) have all-zero packed fields, so they contribute exactly 0 above; their logits
are overwritten and their value contributions added from the exact copies.

Queries of more than `FOLD_MAX_ROWS` rows per KV head (prefill chunks; no soft cap) decode the stored layer once and
run fused SDPA over [past | fresh]: folding scales into every query row costs more than decoding the tiles then.
Other quantizers (baselines) and keys stored before RoPE take the decode path: each chunk of tiles is decoded
(`StoredKV.decode_tiles`) and multiplied like an exact segment, inside the same single softmax.

Decode-like steps (few queries) on CPU over KVarN-orientation tiles take the fused C++ kernel instead
(`kvarn.attention.fused`, `kvarn.kernels.cpu`): the same arithmetic from the codes in one online softmax, no unpacked
chunk. KVARN_KERNEL=torch keeps everything on the PyTorch path below (the reference); prefill always uses it.

Compute dtype: float32 (float64 for float64 queries). Dropout is not supported (inference only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvarn.attention import fused
from kvarn.attention.handoff import attach_observer, attach_past, observe, past_of, take  # noqa: F401 (re-exported)
from kvarn.attention.view import KVarNPast, StoredKV
from kvarn.ops.hadamard import hadamard_dense
from kvarn.quant.affine import AffineQuantizer, row_codes
from kvarn.quant.tiles import AffineTiles

TILE_CHUNK_ELEMENTS = 1 << 22  # unpacked codes (or decoded elements) per chunk of tiles
# Folding the scales into the query costs O(M * D) elementwise work per tile and query row; decoding a tile costs
# O(G * D) once. Above a tile's worth of query rows (prefill chunks: M = groups * L), decoding the layer and fused SDPA
# is the cheaper order of the same arithmetic (one 128-token chunk over a 4k past on Qwen2.5-0.5B's layer: 4.6x
# faster, `python -m kvarn.bench.microbench --prefill`; docs/TASKS.md).
FOLD_MAX_ROWS = 128
LOGIT_CHUNK_ELEMENTS = 1 << 24  # logits per chunk of queries (long prefills on a filled cache)


def _hadamard(x: torch.Tensor) -> torch.Tensor:
    """x @ H along the last axis. Here x is a query or an output, M x D with M small: one matmul beats the log2(D)
    butterfly stages on CPU."""
    return x @ hadamard_dense(x.shape[-1], x.dtype, x.device)


# -- masks ----------------------------------------------------------------------------------------------------
def allowed(mask: torch.Tensor | None, b: int, length: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """Boolean [B or 1, 1 or H, L, kv_len] of allowed (query, key) pairs. None means causal, bottom-right aligned:
    query i (at position kv_len - L + i) sees keys 0 .. kv_len - L + i. Float masks are additive (-inf = masked)."""
    if mask is None:
        qi = torch.arange(length, device=device).unsqueeze(1) + (kv_len - length)
        return (torch.arange(kv_len, device=device).unsqueeze(0) <= qi).view(1, 1, length, kv_len)
    if mask.dim() != 4 or mask.shape[-1] != kv_len or mask.shape[-2] != length:
        raise ValueError(f"attention mask of shape {tuple(mask.shape)} does not fit {length} queries over "
                         f"{kv_len} keys")
    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2


def _additive(mask: torch.Tensor | None) -> torch.Tensor | None:
    return mask if mask is not None and mask.dtype != torch.bool else None


def _group_mask(m: torch.Tensor, hkv: int, g: int) -> torch.Tensor:
    """[B, 1 or Hq, L, T] -> [B, 1 or Hkv, g*L, T], the row order of the regrouped queries."""
    b, h, length, t = m.shape
    if h == 1:
        return m.unsqueeze(2).expand(b, 1, g, length, t).reshape(b, 1, g * length, t)
    return m.reshape(b, hkv, g * length, t)


# -- packed tiles -----------------------------------------------------------------------------------------------
def _tile_chunk(view: StoredKV, rows: int) -> int:
    b, h, d = view.shape_bhd
    per_tile = b * h * view.tile * max(d, rows)
    return max(1, TILE_CHUNK_ELEMENTS // per_tile)


def _fields(view: StoredKV, first: int, last: int, cd: torch.dtype):
    """Unpacked codes [B, H, n, R, C] and scales (row a, row z [B, H, n, R], col [B, H, n, C] or None, rotation
    flags [B, H, n] bool or None) of tiles [first, last), in the compute dtype."""
    f: AffineTiles = view.packed
    part = f.select((slice(None), slice(None), slice(first, last)))
    codes, a = row_codes(part, cd)
    z = f.row_zero[:, :, first:last].to(cd)
    col = f.col_scale[:, :, first:last].to(cd) if f.col_scale is not None else None
    flag = f.rotated[:, :, first:last].bool() if f.rotated is not None else None
    return codes, a, z, col, flag


def _rotated_query(qs: torch.Tensor, qh: torch.Tensor | None, rotate: str, flag: torch.Tensor | None) -> torch.Tensor:
    """The query in each tile's basis: [B, H, n or 1, M, D]."""
    if rotate == "none":
        return qs.unsqueeze(2)
    if rotate == "hadamard":
        return qh.unsqueeze(2)
    return torch.where(flag[..., None, None], qh.unsqueeze(2), qs.unsqueeze(2))


def _dequant_matmul(x: torch.Tensor, codes: torch.Tensor, a: torch.Tensor, z: torch.Tensor, col: torch.Tensor | None,
                    rows_contracted: bool) -> torch.Tensor:
    """A tile stored as T[r, c] = col[c] * (a[r] * codes[r, c] + z[r]) (row scale and zero per row r, optional
    column scale per column c), multiplied by x without forming T. x [B, H, n|1, M, K] -> [B, H, n, M, N].

    rows_contracted (codes [.., K, N]):  x @ T   = col * ((x * a) @ codes + x . z)
    otherwise       (codes [.., N, K]):  x @ T^T = a * ((x * col) @ codes^T) + z * sum(x * col)
    """
    if rows_contracted:
        out = (x * a.unsqueeze(3)) @ codes + (x * z.unsqueeze(3)).sum(-1, keepdim=True)
        return out * col.unsqueeze(3) if col is not None else out
    xc = x * col.unsqueeze(3) if col is not None else x
    return (xc @ codes.transpose(-1, -2)) * a.unsqueeze(3) + z.unsqueeze(3) * xc.sum(-1, keepdim=True)


def _affine_key_logits(qs: torch.Tensor, qh: torch.Tensor | None, view: StoredKV, first: int, last: int,
                       cd: torch.dtype) -> torch.Tensor:
    """qs [B, H, M, D] -> logits [B, H, M, (last - first) * G] of packed key tiles."""
    codes, a, z, col, flag = _fields(view, first, last, cd)
    qt = _rotated_query(qs, qh, view.quantizer.config.rotate, flag)  # [B, H, n|1, M, D]
    # keys per channel: codes [B, H, n, D, G], row scales on D (contracted); per token: [B, H, n, G, D]
    s = _dequant_matmul(qt, codes, a, z, col, view.quantizer.config.axis == "channel")
    b, h, n, m, g = s.shape
    return s.permute(0, 1, 3, 2, 4).reshape(b, h, m, n * g)


def _affine_value_out(p: torch.Tensor, view: StoredKV, first: int, last: int, cd: torch.dtype) -> torch.Tensor:
    """p [B, H, M, (last - first) * G] -> output [B, H, M, D] of packed value tiles (rotated back)."""
    codes, a, z, col, flag = _fields(view, first, last, cd)
    b, h, m, _ = p.shape
    n = last - first
    pt = p.reshape(b, h, m, n, view.tile).transpose(2, 3)  # [B, H, n, M, G]
    # values per token: codes [B, H, n, G, D], row scales on G (contracted); per channel: [B, H, n, D, G]
    o = _dequant_matmul(pt, codes, a, z, col, view.quantizer.config.axis == "token")
    rotate = view.quantizer.config.rotate
    if rotate == "none":
        return o.sum(2)
    if rotate == "hadamard":
        return _hadamard(o.sum(2))
    f = flag[..., None, None]
    return _hadamard(torch.where(f, o, 0).sum(2)) + torch.where(f, 0, o).sum(2)


def _packed_fast(view: StoredKV, rows: int) -> bool:
    """Whether the tiles are read by folding scales into the query/probabilities (few query rows), rather than
    decoded and multiplied (many rows, other quantizers, keys stored before RoPE)."""
    return isinstance(view.quantizer, AffineQuantizer) and view.post is None and rows <= FOLD_MAX_ROWS


def _tile_key_logits(qs: torch.Tensor, view: StoredKV, cd: torch.dtype) -> torch.Tensor:
    """Logits [B, H, M, n*G] of every packed key tile, chunk by chunk."""
    fast = _packed_fast(view, qs.shape[2])
    qh = None
    if fast and view.quantizer.config.rotate != "none":
        qh = _hadamard(qs)  # q~ = q H, once
    step = _tile_chunk(view, qs.shape[2])
    parts = []
    for first in range(0, view.n_tiles, step):
        last = min(first + step, view.n_tiles)
        if fast:
            parts.append(_affine_key_logits(qs, qh, view, first, last, cd))
        else:
            parts.append(qs @ view.decode_tiles(first, last, cd, dense=True).transpose(-1, -2))
    s = torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]
    ex = view.exact_in(0, view.n_tiles) if fast else None  # decode_tiles already restored them
    if ex is not None:
        i, v = ex
        b, h, m, _ = s.shape
        s5 = s.view(b, h, m, view.n_tiles, view.tile)
        s5[i[:, 0], i[:, 1], :, i[:, 2]] = qs[i[:, 0], i[:, 1]] @ v.to(cd).transpose(-1, -2)
    return s


def _tile_value_out(p: torch.Tensor, view: StoredKV, cd: torch.dtype) -> torch.Tensor:
    """Output [B, H, M, D] of every packed value tile for probabilities p [B, H, M, n*G]."""
    fast = _packed_fast(view, p.shape[2])
    step = _tile_chunk(view, p.shape[2])
    g = view.tile
    out = None
    for first in range(0, view.n_tiles, step):
        last = min(first + step, view.n_tiles)
        pc = p[..., first * g:last * g]
        o = (_affine_value_out(pc, view, first, last, cd) if fast
             else pc @ view.decode_tiles(first, last, cd, dense=True))
        out = o if out is None else out + o
    ex = view.exact_in(0, view.n_tiles) if fast else None
    if ex is not None:
        i, v = ex
        b, h, m, _ = p.shape
        pe = p.view(b, h, m, view.n_tiles, g)[i[:, 0], i[:, 1], :, i[:, 2]]  # [k, M, G]
        out = out.index_put((i[:, 0], i[:, 1]), pe @ v.to(cd), accumulate=True)
    return out


# -- one softmax over all segments ------------------------------------------------------------------------------
def _key_logits(qs: torch.Tensor, view: StoredKV | None, k_new: torch.Tensor, cd: torch.dtype) -> torch.Tensor:
    parts = []
    if view is not None:
        sink = view.sink_rows(cd)
        if sink is not None:
            parts.append(qs @ sink.transpose(-1, -2))
        if view.n_tiles:
            parts.append(_tile_key_logits(qs, view, cd))
        tail = view.tail_rows(cd)
        if tail is not None:
            parts.append(qs @ tail.transpose(-1, -2))
    parts.append(qs @ k_new.to(cd).transpose(-1, -2))
    return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]


def _value_out(p: torch.Tensor, view: StoredKV | None, v_new: torch.Tensor, cd: torch.dtype) -> torch.Tensor:
    out = p[..., p.shape[-1] - v_new.shape[2]:] @ v_new.to(cd)
    if view is None:
        return out
    at = 0
    sink = view.sink_rows(cd)
    if sink is not None:
        out = out + p[..., :sink.shape[2]] @ sink
        at = sink.shape[2]
    if view.n_tiles:
        n = view.n_tiles * view.tile
        out = out + _tile_value_out(p[..., at:at + n], view, cd)
        at += n
    tail = view.tail_rows(cd)
    if tail is not None:
        out = out + p[..., at:at + tail.shape[2]] @ tail
    return out


def _use_fused(query: torch.Tensor, past: KVarNPast | None, softcap: float | None = None) -> bool:
    """Whether this step takes the fused kernel (kvarn.attention.fused; KVARN_KERNEL=torch never, =cpu always)."""
    return past is not None and fused.take(fused.unsupported(query, past.keys, past.values, softcap), query.device)


def compute_dtype(query_dtype: torch.dtype) -> torch.dtype:
    """The dtype `packed_attention` computes in: float64 for float64 queries, else float32."""
    return torch.float64 if query_dtype == torch.float64 else torch.float32


def decodes_past(rows: int, softcap: float | None) -> bool:
    """Whether the PyTorch path serves `rows` query rows per KV head (query heads per KV head x queries) by decoding
    the stored past densely (`_decoded_sdpa`) rather than folding the tiles into the logits."""
    return softcap is None and rows > FOLD_MAX_ROWS


def _decoded_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, past: KVarNPast | None,
                  ok: torch.Tensor, add: torch.Tensor | None, scale: float, cd: torch.dtype,
                  causal: bool = False) -> torch.Tensor:
    """Many query rows (prefill chunks): the stored layer decoded once (`StoredKV.dequantized(dense=True)`, a
    transient [B, Hkv, T, D] copy of one layer) and fused SDPA over [past | fresh] in cd; [B, L, Hq, D]."""
    k, v = key.to(cd), value.to(cd)
    if past is not None:
        k = torch.cat([past.keys.dequantized(cd, dense=True), k], dim=2)
        v = torch.cat([past.values.dequantized(cd, dense=True), v], dim=2)
    return sdpa_rows(query, k, v, ok, add, scale, cd, causal)


def sdpa_rows(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ok: torch.Tensor, add: torch.Tensor | None,
              scale: float, cd: torch.dtype, causal: bool = False) -> torch.Tensor:
    """Fused SDPA in cd of query [B, Hq, L, D] over exact rows k, v [B, Hkv, T, D] (already in cd), ok as from
    `allowed`, add an additive mask or None -> [B, L, Hq, D] in the query's dtype; fully masked rows give 0.
    causal: ok is `allowed`'s own causal mask (T >= L), where every row sees a key, so that check is skipped."""
    mask = ok if add is None else add.to(cd).masked_fill(~ok, float("-inf"))
    out = F.scaled_dot_product_attention(query.to(cd), k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    if not causal:
        out = torch.where(ok.any(-1, keepdim=True), out, 0)  # fully masked rows give 0
    return out.transpose(1, 2).to(query.dtype).contiguous()


def packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, past: KVarNPast | None,
                     attention_mask: torch.Tensor | None = None, scaling: float | None = None,
                     softcap: float | None = None, kernel: bool = True,
                     sdpa_dtype: torch.dtype | None = None) -> torch.Tensor:
    """softmax(q K^T * scaling [softcapped] + mask) V over [stored past | fresh key/value]; returns [B, L, Hq, D].

    query [B, Hq, L, D]; key, value [B, Hkv, L_new, D] (the fresh rows); attention_mask bool (True = attend) or
    additive float, [B or 1, 1 or Hq, L, T_past + L_new], or None for causal (bottom-right aligned).
    kernel=False: the PyTorch path whatever KVARN_KERNEL says (for callers that already chose, e.g. vLLM's pages).
    sdpa_dtype: the dtype of the SDPA that serves many query rows over the decoded past (`decodes_past`); default
    float32 (float64 for float64 queries), as every other path computes.
    """
    b, hq, length, d = query.shape
    hkv = key.shape[1]
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads")
    g = hq // hkv
    cd = compute_dtype(query.dtype)
    kv_len = key.shape[2] + (past.length if past is not None else 0)
    keys_view = past.keys if past is not None else None
    values_view = past.values if past is not None else None
    scale = d ** -0.5 if scaling is None else scaling
    ok = None
    if kernel and _use_fused(query, past, softcap):
        ok = None if attention_mask is None and length == 1 else allowed(attention_mask, b, length, kv_len,
                                                                          query.device)
        out = fused.fused_attention(query, key, value, past.keys, past.values, ok, attention_mask, scale, softcap)
        if out is not None:  # None: a CUDA step whose mask hides a position (the Triton kernel has no mask)
            return out
    ok = allowed(attention_mask, b, length, kv_len, query.device) if ok is None else ok
    if decodes_past(g * length, softcap):
        return _decoded_sdpa(query, key, value, past, ok, _additive(attention_mask), scale, sdpa_dtype or cd,
                             causal=attention_mask is None and kv_len >= length)
    add = _additive(attention_mask)
    # queries regrouped per KV head: row j*L + l of head kv is query head kv*g + j at position l
    qs = query.to(cd).reshape(b, hkv, g * length, d) * scale
    step = max(1, LOGIT_CHUNK_ELEMENTS // max(1, b * hq * kv_len))
    outs = []
    for l0 in range(0, length, step):
        l1 = min(length, l0 + step)
        qc = qs.view(b, hkv, g, length, d)[:, :, :, l0:l1].reshape(b, hkv, g * (l1 - l0), d)
        s = _key_logits(qc, keys_view, key, cd)  # [B, Hkv, g*Lc, T]
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        if add is not None:
            s = s + _group_mask(add[:, :, l0:l1].to(cd), hkv, g)
        okc = _group_mask(ok[:, :, l0:l1], hkv, g)
        s = s.masked_fill(~okc, float("-inf"))
        p = torch.softmax(s, dim=-1)
        p = torch.where(okc.any(-1, keepdim=True), p, 0)  # fully masked rows give 0, as SDPA does
        outs.append(_value_out(p, values_view, value, cd).view(b, hkv, g, l1 - l0, d))
    out = torch.cat(outs, dim=3) if len(outs) > 1 else outs[0]
    return out.reshape(b, hq, length, d).transpose(1, 2).to(query.dtype).contiguous()


def packed_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, past: KVarNPast | None, dropout: float = 0.0,
                   scaling: float | None = None, softcap: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """An AttentionInterface call answered by `packed_attention` over [past | fresh key/value]: ([B, L, Hq, D], None).
    Refuses what it cannot compute rather than ignore it."""
    if dropout and module.training:
        raise ValueError("kvarn's packed attention is for inference; it does not apply attention dropout")
    for name in ("s_aux", "position_bias"):
        if kwargs.get(name) is not None:
            raise ValueError(f"kvarn's packed attention does not support {name!r}; build the KVarNCache with "
                             "attention='reference' for this model")
    causal = kwargs.get("is_causal")
    if attention_mask is None and not (getattr(module, "is_causal", True) if causal is None else causal):
        kv_len = key.shape[2] + (past.length if past is not None else 0)
        attention_mask = torch.ones(1, 1, query.shape[2], kv_len, dtype=torch.bool, device=query.device)
    return packed_attention(query, key, value, past, attention_mask, scaling, softcap), None


def kvarn_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                            softcap: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """The "kvarn" entry of transformers' AttentionInterface: packed reads of a KVarN past, SDPA otherwise (exact
    path with softcap). Returns ([B, L, Hq, D], None)."""
    past = take(key, module)
    observe(key, query)
    if past is None and softcap is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if dropout and module.training:
            raise ValueError("attn_implementation 'kvarn' is for inference; it does not apply attention dropout")
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=scaling,
                                      **kwargs)
    return packed_forward(module, query, key, value, attention_mask, past, dropout, scaling, softcap, **kwargs)


def reading_packed(attention):
    """A registered attention implementation (sdpa, ...) that reads a KVarN past from the packed cache
    (`packed_forward`) and is `attention` itself for any other key; it also hands the queries to the observer a
    KVarNCache attaches to the key (the key-rotation policy, kvarn.quant.policy)."""
    if getattr(attention, "kvarn_wraps", None) is not None:
        return attention

    def read(module, query, key, value, attention_mask, *args, **kwargs):
        past = take(key, module)
        observe(key, query)
        if past is None:
            return attention(module, query, key, value, attention_mask, *args, **kwargs)
        return packed_forward(module, query, key, value, attention_mask, past, *args, **kwargs)

    read.kvarn_wraps = attention
    return read
