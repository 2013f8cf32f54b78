"""The reference of the packed decode seat (`kvarn::packed_decode`), in float32, over the kernel's own arguments.

Per batch row b and KV head h, M query rows q (row j*L + l = query head h*groups + j at position l) attend to

    packed tiles j < n_blocks[b] at block block_table[b, j] (positions tiles_pos + j*G ..), dense rows (dense_k[i],
    dense_v[i] [B, H, t, D] at positions dense_pos[i] ..), then, when paged_index is not empty, indexed rows
    (paged_index [B, 2, t] int64 row ids n * R + r of keys (0) and values (1) in paged_rows [N, H, R, D], read as
    paged_rows[n, h, r], at positions paged_pos ..: vLLM's fp slots read in place)

Fields are read through (batch, head, block) element strides: field (b, h, j) starts at b*s_b + h*s_h +
block_table[b, j]*s_n (the tile's own axes contiguous); a sixth key field, row widths, holds key rows at their own
widths (codes [W G / 8] per tile, `kvarn.ops.widths.unpack_rows`). A key tile (codes [D, G], rows = channels) stored as
K~[g, d] = (code[d, g] a_d + z_d) t_g, a value tile (codes [G, D], rows = tokens) as V~[g, d] = (code[g, d] a_g +
z_g) c_d, each in its basis (rotate 0: plain, 1: rotated, 2: the tile's flag). Then, with q~ = qh on rotated key
tiles and q elsewhere, and exact tiles (exact_map[b, h, j] >= 0) read plain from exact_k / exact_v:

    s = scale * q~ . k;  s = softcap * tanh(s / softcap) if softcap > 0;  s += bias (over all positions);
    p = softmax(s) over tiles and dense rows (-inf masked; tiles j >= n_blocks[b] masked; a row with nothing
        allowed gives 0);
    out_plain = sum over plain tiles and dense rows of p v;  out_rot = sum over rotated tiles of p V~
    with `hadamard` H: q~ = q H on rotated tiles (qh unused) and (out_plain + out_rot H, []); else (out_plain,
    out_rot).

One softmax over concatenated logits (not online), every product a float32 matmul: the kernel's arithmetic up to
summation order. `splits` (the kernel's parallel split of the context) does not change the result.
"""

from __future__ import annotations

import torch

from kvarn.ops.packing import packed_size, unpack_codes
from kvarn.ops.widths import WIDTH_BITS, unpack_rows, unpack_widths

_FIELDS = 5  # codes, row_scale, row_zero, col_scale, rotated (kvarn.quant.tiles.AffineTiles order), [row widths]


def _gather(fields: list[torch.Tensor], strides: list[int], table: torch.Tensor, h: int, rows: int, cols: int,
            bits: int):
    """Fields of tiles (b, h, j) -> unpacked codes [B, H, n, R, C], a, z [B, H, n, R], col [B, H, n, C] or None,
    flag [B, H, n] bool or None."""
    b, n = table.shape
    cap = int(table.max()) + 1 if table.numel() else 1
    widths = len(fields) > _FIELDS
    inner = [(fields[0].shape[-1],) if widths else (rows, packed_size(cols, bits)), (rows,), (rows,), (cols,), (),
             (packed_size(rows, WIDTH_BITS),)]
    out = []
    for i in range(len(fields)):
        t = fields[i]
        if not t.numel():
            out.append(None)
            continue
        sb, sh, sn = strides[3 * i:3 * i + 3]
        shape = inner[i]
        tail = (shape[1], 1) if len(shape) == 2 else (1,) if shape else ()
        view = t.as_strided((b, h, cap, *shape), (sb, sh, sn, *tail), t.storage_offset())
        out.append(view[torch.arange(b).view(b, 1, 1), torch.arange(h).view(1, h, 1), table.long().view(b, 1, n)])
    codes = unpack_rows(out[0], unpack_widths(out[5]), cols, torch.float32) if widths else \
        unpack_codes(out[0], bits).float()
    return codes, out[1].float(), out[2].float(), None if out[3] is None else out[3].float(), \
        None if out[4] is None else out[4].bool()


def _flags(rotate: int, flag: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
    if rotate == 2:
        return flag
    return torch.full(shape, rotate == 1, dtype=torch.bool)


def indexed_rows(rows: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The seat's indexed rows gathered: rows [N, H, R, D], index [B, 2, t] row ids n * R + r -> keys, values
    [B, H, t, D] (rows[n, h, r] for the ids of kind 0 and 1)."""
    r = rows.shape[2]
    kv = rows[index // r, :, index % r]  # [B, 2, t, H, D]
    return kv[:, 0].transpose(1, 2), kv[:, 1].transpose(1, 2)


def packed_decode_reference(q, qh, hadamard, scale, key_fields, key_strides, key_bits, key_rotate, value_fields,
                            value_strides, value_bits, value_rotate, block_table, n_blocks, tile, exact_map, exact_k,
                            exact_v, dense_k, dense_v, dense_pos, tiles_pos, bias, length, softcap, splits,
                            paged_rows, paged_index, paged_pos):
    b, h, m, d = q.shape
    if paged_index.numel():  # the indexed rows: one more dense segment
        pk, pv = indexed_rows(paged_rows, paged_index)
        dense_k, dense_v, dense_pos = [*dense_k, pk], [*dense_v, pv], [*dense_pos, paged_pos]
    g, n = tile, block_table.shape[1]
    used = torch.arange(n).view(1, n) < n_blocks.view(b, 1)  # [B, n]
    table = torch.where(used, block_table, 0)
    codes, a, z, col, kflag = _gather(key_fields, key_strides, table, h, d, g, key_bits)
    kt = codes * a.unsqueeze(-1) + z.unsqueeze(-1)  # [B, H, n, D, G]
    kt = (kt * col.unsqueeze(-2) if col is not None else kt).transpose(-1, -2)  # K~ [B, H, n, G, D]
    codes, a, z, col, vflag = _gather(value_fields, value_strides, table, h, g, d, value_bits)
    vt = codes * a.unsqueeze(-1) + z.unsqueeze(-1)  # [B, H, n, G, D]
    vt = vt * col.unsqueeze(-2) if col is not None else vt
    krot = _flags(key_rotate, kflag, (b, h, n))
    vrot = _flags(value_rotate, vflag, (b, h, n))
    if exact_map.numel():
        ex = exact_map[:, :, :n].long()
        hit = ex >= 0
        kt = torch.where(hit[..., None, None], exact_k.float()[ex.clamp_min(0)], kt)
        vt = torch.where(hit[..., None, None], exact_v.float()[ex.clamp_min(0)], vt)
        krot, vrot = krot & ~hit, vrot & ~hit
    qs = q.float()
    qr = qs @ hadamard.float() if hadamard.numel() else qh.float()  # with H the kernel rotates q itself
    s_plain = torch.einsum("bhmd,bhngd->bhmng", qs, kt)
    s_rot = torch.einsum("bhmd,bhngd->bhmng", qr, kt)
    s = torch.where(krot[:, :, None, :, None], s_rot, s_plain)
    parts = [s.reshape(b, h, m, n * g)] + [qs @ k.float().transpose(-1, -2) for k in dense_k]
    pos = [tiles_pos + torch.arange(n * g)] + [p + torch.arange(k.shape[2]) for p, k in zip(dense_pos, dense_k)]
    s = torch.cat(parts, -1) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    off = torch.cat([(~used).repeat_interleave(g, 1), used.new_zeros(b, s.shape[-1] - n * g)], 1)  # [B, T']
    s = s.masked_fill(off[:, None, None, :], float("-inf"))
    if bias.numel():
        groups = m // length
        bb = bias.float()[..., torch.cat(pos)]  # [B or 1, 1 or Hq, L, T]
        if bb.shape[1] != 1:
            bb = bb.reshape(bb.shape[0], h, groups * length, -1)
        else:
            bb = bb.unsqueeze(2).expand(bb.shape[0], 1, groups, length, -1).reshape(bb.shape[0], 1, m, -1)
        s = s + bb
    p = torch.softmax(s, -1)
    p = torch.where(torch.isfinite(s).any(-1, keepdim=True), p, 0)
    pt = p[..., :n * g].reshape(b, h, m, n, g)
    o = torch.einsum("bhmng,bhngd->bhnmd", pt, vt)
    out_r = torch.where(vrot[..., None, None], o, 0).sum(2)
    out_p = torch.where(vrot[..., None, None], 0, o).sum(2)
    at = n * g
    for v in dense_v:
        out_p = out_p + p[..., at:at + v.shape[2]] @ v.float()
        at += v.shape[2]
    if hadamard.numel():
        return (out_p + out_r @ hadamard.float()).contiguous(), q.new_empty(0, dtype=torch.float32)
    return out_p.contiguous(), out_r.contiguous()
