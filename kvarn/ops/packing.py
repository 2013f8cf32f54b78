"""Bit packing of integer codes along the last axis, 8/b codes per byte, low bits first, in planes.

For b in {1, 2, 4, 8}, a row of n codes takes m = n*b/8 bytes and per = 8/b codes per byte; byte j holds the codes
j, j + m, j + 2m, ..., j + (per-1)m (plane k = codes [k*m, (k+1)*m)), code j + k*m at bits [k*b, (k+1)*b). So plane
k of a whole row is (bytes >> k*b) & (2^b - 1): one shift and one mask per plane, with no interleaving, which is what
lets a kernel unpack a row with plain vector shifts (hqq packs its rows the same way).
For b = 3: groups of 8 consecutive codes are packed into 3 bytes (24 bits, code j at bits [3j, 3j+3)); the fused
kernels unpack such a tile to one code a byte first.
The last axis must be a multiple of the codes per byte (per group of 8 for b = 3).
"""

from __future__ import annotations

import sys

import torch

BITS = (1, 2, 3, 4, 8)


def group_codes(bits: int) -> int:
    """Codes that fill whole bytes: 8/b for the plane layouts, 8 (in 3 bytes) for b = 3."""
    return 8 if bits == 3 else 8 // bits


def _check(codes_last: int, bits: int) -> int:
    if bits not in BITS:
        raise ValueError(f"unsupported bit width {bits} for packing; supported: 1, 2, 3, 4, 8")
    per = group_codes(bits)
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
    planes = codes.reshape(*lead, per, n // per)  # plane k = codes [k*m, (k+1)*m)
    out = planes[..., 0, :].clone()
    for k in range(1, per):
        out |= planes[..., k, :] << (k * bits)
    return out


def _words_ok(packed: torch.Tensor, bits: int) -> bool:
    """Whether `packed` can be read as little-endian int32 words (4 bytes at once) for 1/2/4-bit codes."""
    return (bits in (1, 2, 4) and sys.byteorder == "little" and packed.dim() > 0 and packed.shape[-1] % 4 == 0
            and packed.stride(-1) == 1 and packed.storage_offset() % 4 == 0
            and all(st % 4 == 0 for st in packed.stride()[:-1]))


def unpack_codes(packed: torch.Tensor, bits: int, n: int | None = None,
                 dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """Inverse of `pack_codes`: packed uint8 [..., m] -> codes [..., m * 8 / bits] in `dtype` (uint8 by default;
    a float dtype feeds a matmul directly). Where the bytes can be read 4 at a time as little-endian int32 words,
    plane k of 4 bytes is (word >> k*b) & (mask repeated in each byte): the same planes, fewer and wider ops."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed codes must be uint8, got {packed.dtype}")
    m = packed.shape[-1]
    total = m * 8 // bits
    if n is not None and n != total:
        raise ValueError(f"{m} bytes of {bits}-bit codes hold {total} codes, not {n}")
    per = _check(total, bits)
    if bits == 8:
        return packed.to(dtype)
    lead = packed.shape[:-1]
    mask = (1 << bits) - 1
    if bits == 3:
        b = packed.reshape(*lead, m // 3, 3).to(torch.int32)
        word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
        out = torch.stack([(word >> (3 * j)) & mask for j in range(8)], dim=-1)
        return out.to(dtype).reshape(*lead, total)
    if _words_ok(packed, bits):
        words = packed.view(torch.int32).unsqueeze(-2)  # [..., 1, m/4]
        shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=packed.device).view(per, 1)
        planes = (words >> shifts) & (mask * 0x01010101)  # [..., per, m/4], each byte one code of its plane
        return planes.view(torch.uint8).reshape(*lead, total).to(dtype)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device).view(per, 1)
    out = (packed.unsqueeze(-2) >> shifts) & mask  # [..., per, m]
    return out.reshape(*lead, total).to(dtype)
