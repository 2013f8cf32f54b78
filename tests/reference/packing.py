"""Bit packing as a little-endian bit stream, one bit at a time.

Code i of a row of b-bit codes occupies stream bits [i*b, (i+1)*b); stream bit j is bit (j mod 8) of
byte j // 8. For b in {1, 2, 4, 8} this puts code j of a byte at bits [j*b, (j+1)*b) ("low bits first");
for b = 3 it puts 8 codes in 3 bytes, code j at bits [3j, 3j+3) of the little-endian 24-bit word.
"""

from __future__ import annotations


def pack_row(codes: list[int], bits: int) -> list[int]:
    n_bytes = len(codes) * bits // 8
    out = [0] * n_bytes
    for i, c in enumerate(codes):
        for k in range(bits):
            j = i * bits + k
            bit = (c >> k) & 1
            out[j // 8] |= bit << (j % 8)
    return out


def unpack_row(data: list[int], bits: int) -> list[int]:
    n = len(data) * 8 // bits
    codes = []
    for i in range(n):
        c = 0
        for k in range(bits):
            j = i * bits + k
            c |= ((data[j // 8] >> (j % 8)) & 1) << k
        codes.append(c)
    return codes
