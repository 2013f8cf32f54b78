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


def rtn_targets(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The unrounded codes u = (x - lo) / delta, delta [..., 1] and lo [..., 1] of `rtn_quantize`, computed by the
    same operations: clamp(round(u), 0, 2^b - 1) is its codes bit for bit."""
    levels = (1 << check_bits(bits)) - 1
    lo = x.amin(dim=-1, keepdim=True)
    hi = x.amax(dim=-1, keepdim=True)
    delta = ((hi - lo) / torch.full_like(hi, levels)).clamp_min(RANGE_GUARD)
    return (x - lo) / delta, delta, lo


def query_aware_round(u: torch.Tensor, hessian: torch.Tensor, bits: int, damp: float = 0.01) -> torch.Tensor:
    """Round codes column by column so that the rounding error r = q - u of each column minimises r^T H r (not
    sum r^2): the GPTQ/OBQ order over the rows. u [N, R, C] unrounded codes (rows: the axis the error couples,
    e.g. a key tile's channels; columns: its tokens), hessian H [N, R, R] symmetric positive semi-definite, shared
    by the columns of a tile. Rows are rounded in order 0..R-1, each to its nearest level in [0, 2^b - 1], and its
    error is pushed onto the rows not yet rounded through the upper Cholesky factor U of (H + damp mean(diag H) I)^-1:
        q_r = clamp(round(u_r)),  u_j -= (u_r - q_r) U_rj / U_rr   for j > r.
    A diagonal H has a diagonal U: plain round-to-nearest, bit for bit. Returns uint8 codes [N, R, C]; the pass
    runs in u's dtype, the factorisation in float64."""
    levels = (1 << check_bits(bits)) - 1
    n, r, _ = u.shape
    if hessian.shape != (n, r, r):
        raise ValueError(f"hessian must be [N, R, R] = {(n, r, r)}, got {tuple(hessian.shape)}")
    h = hessian.double()
    h = (h + h.transpose(-1, -2)) / 2
    diag = h.diagonal(dim1=-2, dim2=-1)
    mean = diag.mean(-1).clamp_min(1e-30)  # [N]; an all-zero H (no query yet) becomes the identity's multiple
    h = h + (damp * mean)[:, None, None] * torch.eye(r, dtype=h.dtype, device=h.device)
    # U upper with U^T U = H^-1: the reversed lower Cholesky of the reversed inverse (torch.linalg.cholesky(upper=True)
    # gives U with U^H U = A, which is that factor); fall back to more damping where H is not positive definite
    hinv = torch.linalg.inv(h)
    up, info = torch.linalg.cholesky_ex(hinv, upper=True)
    bad = info != 0
    if bool(bad.any()):
        hb = h[bad] + (mean[bad] * 0.1)[:, None, None] * torch.eye(r, dtype=h.dtype, device=h.device)
        up[bad] = torch.linalg.cholesky(torch.linalg.inv(hb), upper=True)
    coef = (up / up.diagonal(dim1=-2, dim2=-1).unsqueeze(-1)).to(u.dtype)  # [N, R, R]: U_rj / U_rr
    w = u.clone()
    q = torch.empty_like(w)
    for i in range(r):
        qi = torch.round(w[:, i]).clamp_(0, levels)  # [N, C]
        q[:, i] = qi
        if i + 1 < r:
            err = w[:, i] - qi  # [N, C]
            w[:, i + 1:] -= coef[:, i, i + 1:, None] * err[:, None, :]
    return q.to(torch.uint8)
