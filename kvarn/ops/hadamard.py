"""Orthonormal Walsh–Hadamard transform along the last axis.

For D = 2^k: y = x @ H_D with H_D the Sylvester Hadamard matrix divided by sqrt(D), computed by the fast
butterfly in O(D log D). H_D is symmetric and orthonormal, so it is its own inverse.

Other head sizes (80, 96, 112, 160, 192, ...): D is split into power-of-two blocks by its binary expansion,
largest first (96 = 64 + 32, 80 = 64 + 16, 112 = 64 + 32 + 16), and each block gets its own H. The result
is block-diagonal, hence still symmetric, orthonormal and self-inverse; channels only mix within a block.
"""

from __future__ import annotations

import math

import torch


def hadamard_blocks(d: int) -> list[int]:
    """Power-of-two block sizes (largest first) whose sum is d."""
    if d < 1:
        raise ValueError(f"head_dim must be positive, got {d}")
    return [1 << b for b in range(d.bit_length() - 1, -1, -1) if d >> b & 1]


def _fwht_pow2(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    lead = x.shape[:-1]
    h = 1
    while h < d:
        # [..., d] -> [..., d/(2h), 2, h]: pairs (i, i+h) inside each block of 2h
        y = x.reshape(*lead, d // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(*lead, d)
        h *= 2
    return x / math.sqrt(d)


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """x @ H along the last axis (H orthonormal, symmetric, self-inverse); dtype and device of x kept."""
    if not x.is_floating_point():
        raise ValueError(f"hadamard_transform needs a floating tensor, got {x.dtype}")
    d = x.shape[-1]
    blocks = hadamard_blocks(d)
    work = x if x.dtype in (torch.float32, torch.float64) else x.float()
    if len(blocks) == 1:
        out = _fwht_pow2(work)
    else:
        out = torch.cat([_fwht_pow2(part) for part in work.split(blocks, dim=-1)], dim=-1)
    return out.to(x.dtype)


def hadamard_matrix(d: int, dtype: torch.dtype = torch.float64, device: torch.device | str = "cpu") -> torch.Tensor:
    """The dense matrix H of `hadamard_transform` (x @ H), for references and small D."""
    return hadamard_transform(torch.eye(d, dtype=dtype, device=device))


_DENSE: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def hadamard_dense(d: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """`hadamard_matrix(d, dtype, device)`, contiguous, cached per size, dtype and device (normalized, so "cpu" and
    torch.device("cpu") share an entry). The same values as the float64 matrix cast down: entries are +-1/sqrt(d)."""
    key = (d, dtype, torch.device(device))
    h = _DENSE.get(key)
    if h is None:
        h = _DENSE[key] = hadamard_matrix(d, dtype, device).contiguous()
    return h
