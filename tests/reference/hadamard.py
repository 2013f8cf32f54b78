"""Dense Hadamard matrices built independently of kvarn.ops.hadamard.

Sylvester: H_1 = [1], H_2n = [[H_n, H_n], [H_n, -H_n]] = [[1, 1], [1, -1]] (x) H_n (Kronecker product),
normalized by 1/sqrt(n). For D that is not a power of two the documented fallback is block-diagonal:
D is written as a sum of distinct powers of two, largest first (96 = 64 + 32), one Sylvester block each.
"""

from __future__ import annotations

import math

import torch


def sylvester(n: int) -> torch.Tensor:
    """Orthonormal Sylvester Hadamard matrix of size n = 2^k, float64, by repeated Kronecker products."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Sylvester matrices exist for powers of two, not {n}")
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.kron(h2, h)
    return h / math.sqrt(n)


def power_of_two_parts(d: int) -> list[int]:
    """d as a sum of distinct powers of two, largest first: take the largest power <= what is left."""
    parts = []
    left = d
    while left > 0:
        p = 1
        while p * 2 <= left:
            p *= 2
        parts.append(p)
        left -= p
    return parts


def hadamard_reference(d: int) -> torch.Tensor:
    """The [d, d] matrix H such that the transform is x @ H (block-diagonal for non-powers of two)."""
    return torch.block_diag(*[sylvester(p) for p in power_of_two_parts(d)])
