"""Where a 2/4-bit code sits in its packed row, and the tile-wide unpack / pack that follow from it.

A row of C codes is stored in C * BITS / 8 bytes (PER = 8 / BITS codes per byte). Two layouts:
    consecutive (PLANES = False):  byte k holds codes k*PER + j, j = 0..PER-1, code j at bits [j*BITS, (j+1)*BITS)
    planes      (PLANES = True):   byte k holds codes k + j*C/PER (plane j at bits [j*BITS, (j+1)*BITS))
The launch wrappers read which one `kvarn.ops.packing` writes (`ops.code_layout`), so the kernels follow it.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def code_position(c, C: tl.constexpr, BITS: tl.constexpr, PLANES: tl.constexpr):
    """(byte index within the row, bit shift) of code column c."""
    PER: tl.constexpr = 8 // BITS
    if PLANES:
        return c % (C // PER), (c // (C // PER)) * BITS
    return c // PER, (c % PER) * BITS


@triton.jit
def load_codes(ptr, R: tl.constexpr, C: tl.constexpr, BITS: tl.constexpr, PLANES: tl.constexpr):
    """Codes [R, C] as float32 of one packed tile (bytes [R, C*BITS/8], row-major) at ptr."""
    r = tl.arange(0, R)[:, None]
    c = tl.arange(0, C)[None, :]
    byte, shift = code_position(c, C, BITS, PLANES)
    v = tl.load(ptr + r * (C * BITS // 8) + byte).to(tl.int32)
    return ((v >> shift) & ((1 << BITS) - 1)).to(tl.float32)


@triton.jit
def pack_codes(q, R: tl.constexpr, C: tl.constexpr, BITS: tl.constexpr, PLANES: tl.constexpr):
    """int32 codes [R, C] in [0, 2^BITS) -> packed bytes [R, C*BITS/8] (uint8), the inverse of `load_codes`."""
    PER: tl.constexpr = 8 // BITS
    NB: tl.constexpr = C // PER
    if PLANES:
        q3 = tl.reshape(q, (R, PER, NB))
        sh = (tl.arange(0, PER) * BITS)[None, :, None]
        return tl.sum(q3 << sh, axis=1).to(tl.uint8)
    q3 = tl.reshape(q, (R, NB, PER))
    sh = (tl.arange(0, PER) * BITS)[None, None, :]
    return tl.sum(q3 << sh, axis=2).to(tl.uint8)


@triton.jit
def unpack_kernel(src_ptr, dst_ptr, R: tl.constexpr, C: tl.constexpr, BITS: tl.constexpr, PLANES: tl.constexpr):
    """One tile per program: packed [N, R, C*BITS/8] -> float32 codes [N, R, C] (for tests and debugging)."""
    n = tl.program_id(0)
    q = load_codes(src_ptr + n * (R * C * BITS // 8), R, C, BITS, PLANES)
    tl.store(dst_ptr + n * R * C + tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :], q)


@triton.jit
def pack_kernel(src_ptr, dst_ptr, R: tl.constexpr, C: tl.constexpr, BITS: tl.constexpr, PLANES: tl.constexpr):
    """One tile per program: int32 codes [N, R, C] -> packed [N, R, C*BITS/8] (for tests and debugging)."""
    n = tl.program_id(0)
    q = tl.load(src_ptr + n * R * C + tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :])
    NB: tl.constexpr = C * BITS // 8
    tl.store(dst_ptr + n * R * NB + tl.arange(0, R)[:, None] * NB + tl.arange(0, NB)[None, :],
             pack_codes(q, R, C, BITS, PLANES))

