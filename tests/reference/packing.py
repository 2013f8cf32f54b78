"""Bit packing written one code and one bit at a time (the oracle of kvarn.ops.packing).

b in {1, 2, 4, 8}: a row of n codes takes m = n*b/8 bytes; code i lies in byte i mod m, at bits
[(i div m) * b, (i div m + 1) * b) (plane i div m, low bits first).
b = 3: a little-endian bit stream in groups of 8 codes: code i occupies stream bits [3i, 3i+3), stream bit j is
bit (j mod 8) of byte j div 8.
"""

from __future__ import annotations


def _place(i: int, k: int, n: int, bits: int) -> tuple[int, int]:
    """(byte, bit) where bit k of code i of a row of n codes is stored."""
    if bits == 3:
        j = i * bits + k
        return j // 8, j % 8
    m = n * bits // 8
    return i % m, (i // m) * bits + k


def pack_row(codes: list[int], bits: int) -> list[int]:
    n = len(codes)
    out = [0] * (n * bits // 8)
    for i, c in enumerate(codes):
        for k in range(bits):
            byte, bit = _place(i, k, n, bits)
            out[byte] |= ((c >> k) & 1) << bit
    return out


def unpack_row(data: list[int], bits: int) -> list[int]:
    n = len(data) * 8 // bits
    codes = []
    for i in range(n):
        c = 0
        for k in range(bits):
            byte, bit = _place(i, k, n, bits)
            c |= ((data[byte] >> bit) & 1) << k
        codes.append(c)
    return codes


def unpack_tensor(data, bits: int):
    """`unpack_row` over the last axis of a uint8 tensor [..., m] -> int64 [..., 8m/b], one bit at a time (gathered
    through the same `_place` map)."""
    import torch

    m = data.shape[-1]
    n = m * 8 // bits
    place = torch.tensor([[_place(i, k, n, bits) for k in range(bits)] for i in range(n)])  # [n, b, 2]
    byte, bit = place[..., 0], place[..., 1]
    bits_of = (data.long()[..., byte] >> bit) & 1  # [..., n, b]
    return (bits_of << torch.arange(bits)).sum(-1)
