"""Asymmetric round-to-nearest per row (last axis).

    lo = min(row), hi = max(row), delta = max((hi - lo) / (2^b - 1), 1e-10)
    q  = clamp(round((x - lo) / delta), 0, 2^b - 1)      round half to even (torch.round)
    x^ = q * delta + lo
"""

from __future__ import annotations

import torch

SUPPORTED_BITS = (1, 2, 3, 4, 8)
RANGE_GUARD = 1e-10


def check_bits(bits: int) -> int:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"unsupported bit width {bits}; supported: {SUPPORTED_BITS}")
    return bits


def rtn_quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes (uint8, same shape as x), delta [..., 1] and lo [..., 1], all computed in x's dtype."""
    levels = (1 << check_bits(bits)) - 1
    lo = x.amin(dim=-1, keepdim=True)
    hi = x.amax(dim=-1, keepdim=True)
    # divided by a tensor, not a Python number: PyTorch's CUDA division by a scalar multiplies by its reciprocal (1 ulp
    # off, so the H200 run found 1.5e-4 of codes one step from the store kernel's); the CPU divides either way
    delta = ((hi - lo) / torch.full_like(hi, levels)).clamp_min(RANGE_GUARD)
    q = torch.round((x - lo) / delta).clamp_(0, levels)
    return q.to(torch.uint8), delta, lo


def rtn_dequantize(q: torch.Tensor, delta: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    return q.to(delta.dtype) * delta + lo
