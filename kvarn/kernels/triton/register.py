"""The Triton decode kernel behind the packed decode seat for CUDA tensors (`kvarn.ops.seats`).

`packed_decode` answers the seat's arguments with `ops.decode_attention`: q and q~ scaled (q~ = q H computed here when
the seat passes H, else the seat's qh), the fields addressed by the seat's own strides (`TileFields.strided`), the
dense rows as exact regions of the same softmax; with H the rotated accumulator is turned back here:
(out_plain + out_rot H, []), else (out_plain, out_rot). `unsupported` names what the Triton kernel does not do yet
(masks/bias, soft cap, tiles kept exact, codes other than 2/4 bits, sizes not powers of two >= 16): those calls take
the PyTorch path. Importing this module registers it (triton itself is imported on the first call).
"""

from __future__ import annotations

import torch

from kvarn.ops import seats
from kvarn.ops.decode import indexed_rows


def unsupported(q: torch.Tensor, key_bits: int, value_bits: int, tile: int, bias: torch.Tensor, softcap: float,
                exact_map: torch.Tensor) -> str | None:
    from kvarn.kernels.triton import available

    d = q.shape[-1]
    if not available():
        return "triton is not installed"
    if bias.numel() or softcap:
        return "a mask or a soft cap (the Triton kernel has neither yet)"
    if exact_map.numel():
        return "tiles kept exact"
    if key_bits not in (2, 4) or value_bits not in (2, 4):
        return f"{key_bits}/{value_bits}-bit codes"
    if min(d, tile) < 16 or d & (d - 1) or tile & (tile - 1):
        return f"head_dim {d} or tile {tile} not a power of two >= 16"
    return None


def packed_decode(q, qh, hadamard, scale, key_fields, key_strides, key_bits, key_rotate, value_fields, value_strides,
                  value_bits, value_rotate, block_table, n_blocks, tile, exact_map, exact_k, exact_v, dense_k,
                  dense_v, dense_pos, tiles_pos, bias, length, softcap, splits, paged_rows, paged_index, paged_pos):
    from kvarn.kernels.triton import ops

    if paged_index.numel():  # indexed rows: gathered here into one more dense region
        pk, pv = indexed_rows(paged_rows, paged_index)
        dense_k, dense_v = [*dense_k, pk], [*dense_v, pv]

    keys = ops.TileFields.strided(key_fields, key_strides, key_bits, key_rotate, "channel")
    values = ops.TileFields.strided(value_fields, value_strides, value_bits, value_rotate, "token")
    qs = q.float() * scale
    rotated = key_rotate or value_rotate
    q_rot = None
    if rotated:
        q_rot = (q.float() @ hadamard.float() if hadamard.numel() else qh.float()) * scale
    dense = [(k, v, None) for k, v in zip(dense_k, dense_v)]
    out_rot, out_plain = ops.decode_attention(qs, q_rot, keys, values, block_table.to(torch.int32),
                                              n_blocks.to(torch.int32), dense)
    if hadamard.numel():
        return (out_plain + out_rot @ hadamard.float()).contiguous(), q.new_empty(0, dtype=torch.float32)
    return out_plain.contiguous(), out_rot.contiguous()


_LIB = torch.library.Library("kvarn", "IMPL")
seats.register_kernel(_LIB, "packed_decode", "cuda", packed_decode, unsupported)
