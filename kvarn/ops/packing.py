"""Bit packing of integer codes along the last axis, low bits first.

For b in {1, 2, 4, 8}: 8/b codes per byte, code j of a byte occupies bits [j*b, (j+1)*b).
For b = 3: groups of 8 codes are packed into 3 bytes (24 bits, code j at bits [3j, 3j+3)).
The last axis must be a multiple of the codes per byte (per group of 8 for b = 3).
"""

from __future__ import annotations

import torch


def _check(codes_last: int, bits: int) -> int:
    if bits not in (1, 2, 3, 4, 8):
        raise ValueError(f"unsupported bit width {bits} for packing; supported: 1, 2, 3, 4, 8")
    per = 8 if bits == 3 else 8 // bits
    if codes_last % per:
        raise ValueError(f"last axis ({codes_last}) must be a multiple of {per} to pack {bits}-bit codes")
    return per


def packed_size(n: int, bits: int) -> int:
    """Bytes that n codes of `bits` bits take."""
    _check(n, bits)
    return n * bits // 8


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes in [0, 2^bits) [..., n] -> packed uint8 [..., n * bits / 8]."""
    per = _check(codes.shape[-1], bits)
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8, got {codes.dtype}")
    if bits == 8:
        return codes.contiguous()
    if codes.numel() and int(codes.max()) >> bits:  # a wider code would spill into its neighbour's bits
        raise ValueError(f"codes must be below 2^{bits} = {1 << bits} to pack {bits}-bit, got {int(codes.max())}")
    lead, n = codes.shape[:-1], codes.shape[-1]
    if bits == 3:
        g = codes.reshape(*lead, n // 8, 8).to(torch.int32)
        word = torch.zeros(g.shape[:-1], dtype=torch.int32, device=codes.device)
        for j in range(8):
            word |= g[..., j] << (3 * j)
        out = torch.stack([(word >> (8 * k)) & 0xFF for k in range(3)], dim=-1)
        return out.to(torch.uint8).reshape(*lead, n * 3 // 8)
    g = codes.reshape(*lead, n // per, per)
    out = g[..., 0].clone()
    for j in range(1, per):
        out |= g[..., j] << (j * bits)
    return out


def unpack_codes(packed: torch.Tensor, bits: int, n: int | None = None) -> torch.Tensor:
    """Inverse of `pack_codes`: packed uint8 [..., m] -> codes uint8 [..., m * 8 / bits]."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed codes must be uint8, got {packed.dtype}")
    m = packed.shape[-1]
    total = m * 8 // bits
    if n is not None and n != total:
        raise ValueError(f"{m} bytes of {bits}-bit codes hold {total} codes, not {n}")
    _check(total, bits)
    if bits == 8:
        return packed
    lead = packed.shape[:-1]
    mask = (1 << bits) - 1
    if bits == 3:
        b = packed.reshape(*lead, m // 3, 3).to(torch.int32)
        word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
        out = torch.stack([(word >> (3 * j)) & mask for j in range(8)], dim=-1)
        return out.to(torch.uint8).reshape(*lead, total)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    out = (packed.unsqueeze(-1) >> shifts) & mask
    return out.reshape(*lead, total)
