"""Asymmetric round-to-nearest per row (last axis).

    lo = min(row), hi = max(row), delta = max((hi - lo) / (2^b - 1), 1e-10)
    q  = clamp(round((x - lo) / delta), 0, 2^b - 1)      round half to even (torch.round)
    x^ = q * delta + lo

Clipped (clip = c < 1): the range shrinks about its midpoint, lo = m - c (hi - lo) / 2 and hi = m + c (hi - lo) / 2
with m = (lo + hi) / 2, and the values outside it take the end codes (the clamp). Without clipping a 2-bit grid
spends its levels on a row's two extremes: on Gaussian rows of 128 values (what a Hadamard rotation makes of a tile)
the best share at 2 bits, 0.6, halves the squared error of min-max (scripts/clip_share.py gaussian).
"""

from __future__ import annotations

import torch

from kvarn.ops.codes import Rotation
from kvarn.ops.hadamard import hadamard_dense

SUPPORTED_BITS = (1, 2, 3, 4, 8)
RANGE_GUARD = 1e-10


def check_bits(bits: int) -> int:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"unsupported bit width {bits}; supported: {SUPPORTED_BITS}")
    return bits


def check_clip(clip: float) -> float:
    if not 0.0 < clip <= 1.0:
        raise ValueError(f"clip ratio (the share of a row's range kept) must be in (0, 1], got {clip!r}")
    return clip


def row_range(x: torch.Tensor, clip: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) [..., 1] of each row: min and max, shrunk about their midpoint to `clip` of the range."""
    lo = x.amin(dim=-1, keepdim=True)
    hi = x.amax(dim=-1, keepdim=True)
    if check_clip(clip) == 1.0:
        return lo, hi
    mid, half = (lo + hi) * 0.5, (hi - lo) * (0.5 * clip)
    return mid - half, mid + half


def rtn_quantize(x: torch.Tensor, bits: int, clip: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes (uint8, same shape as x), delta [..., 1] and lo [..., 1], all computed in x's dtype."""
    levels = (1 << check_bits(bits)) - 1
    lo, hi = row_range(x, clip)
    # divided by a tensor, not a Python number: PyTorch's CUDA division by a scalar multiplies by its reciprocal (1 ulp
    # off, so the H200 run found 1.5e-4 of codes one step from the store kernel's); the CPU divides either way
    delta = ((hi - lo) / torch.full_like(hi, levels)).clamp_min(RANGE_GUARD)
    q = torch.round((x - lo) / delta).clamp_(0, levels)
    return q.to(torch.uint8), delta, lo


def rtn_dequantize(q: torch.Tensor, delta: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    return q.to(delta.dtype) * delta + lo


def rtn_targets(x: torch.Tensor, bits: int, clip: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The unrounded codes u = (x - lo) / delta, delta [..., 1] and lo [..., 1] of `rtn_quantize`, computed by the
    same operations: clamp(round(u), 0, 2^b - 1) is its codes bit for bit."""
    levels = (1 << check_bits(bits)) - 1
    lo, hi = row_range(x, clip)
    delta = ((hi - lo) / torch.full_like(hi, levels)).clamp_min(RANGE_GUARD)
    return (x - lo) / delta, delta, lo


def query_aware_coefficients(sigma: torch.Tensor, damp: float = 0.01) -> torch.Tensor:
    """The rounding coefficients of `query_aware_round` for second moments Sigma [N, R, R] of the queries (in the
    basis the rows are stored in), float32 [N, R, R]: C_rj = V_rj / V_jj, V upper with V V^T = Sigma',
        Sigma' = Sigma + damp mean(diag Sigma) I        (an all-zero Sigma, no query yet: a multiple of I)
    in float64 (V = J L J, L the lower Cholesky factor of J Sigma' J, J the reversal): one factorisation, no solve.
    Runs of equal matrices (a cache hands one copy per tile of a KV head, tiles of a head next to each other) are
    factorised once. A diagonal Sigma gives the identity: nearest rounding. Where Sigma' is not positive definite in
    floating point, ten times the damping; a Sigma that holds a non-finite value, or is not positive definite even
    then, gives the identity (nearest rounding)."""
    n, r, _ = sigma.shape
    uniq, inverse = torch.unique_consecutive(sigma.reshape(n, -1), dim=0, return_inverse=True)
    h = uniq.view(-1, r, r).double()
    eye = torch.eye(r, dtype=h.dtype, device=h.device)
    usable = torch.isfinite(h).flatten(1).all(1)
    h = torch.where(usable[:, None, None], (h + h.transpose(-1, -2)) * 0.5, eye)
    mean = h.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(1e-30)
    low, info = torch.linalg.cholesky_ex((h + (damp * mean)[:, None, None] * eye).flip(-1, -2))  # of J Sigma' J
    bad = info != 0
    if bool(bad.any()):
        low[bad], info = torch.linalg.cholesky_ex((h[bad] + (10 * damp * mean[bad])[:, None, None] * eye).flip(-1, -2))
        usable[bad.nonzero().squeeze(1)[info != 0]] = False
        low[~usable] = eye
    v = low.flip(-1, -2)  # V
    coef = (v / v.diagonal(dim1=-2, dim2=-1).unsqueeze(-2)).float()
    return coef[inverse]


def query_aware_bases(sigma: torch.Tensor, rotate: int, damp: float = 0.01) -> torch.Tensor:
    """`query_aware_coefficients` of each basis a key tile may be stored in: Sigma [N, D, D] (plain basis) ->
    [N, B, D, D], B = 2 for rotate = AUTO (H Sigma H, then Sigma), else 1 (HADAMARD: H Sigma H; NONE: Sigma;
    q . k = (q H) . (k H), H symmetric). The op seat `kvarn::query_aware_coefficients` (`kvarn.ops.seats`)."""
    n, d, _ = sigma.shape
    bases = []
    if rotate != Rotation.NONE:
        h = hadamard_dense(d, torch.float64, sigma.device)
        bases.append(h @ sigma.double() @ h)
    if rotate != Rotation.HADAMARD:
        bases.append(sigma.double())
    coef = query_aware_coefficients(torch.cat(bases), damp)  # basis-major: a head's tiles stay next to each other
    return coef.view(len(bases), n, d, d).transpose(0, 1).contiguous()


def query_aware_round(u: torch.Tensor, coef: torch.Tensor, step: torch.Tensor, bits: int,
                      row_levels: torch.Tensor | None = None) -> torch.Tensor:
    """Round codes column by column so that the error of each column, in the rows' own units, minimises
    e^T Sigma' e (not sum e^2): Babai's nearest plane over the rows, the greedy choice of GPTQ/OBQ's error feedback.
    u [N, R, C] unrounded codes (rows: the axis the error couples, a key tile's channels; columns: its tokens), coef
    [N, R, R] from `query_aware_coefficients`, step [N, R] > 0 the rows' quantization steps a (row r's error is
    a_r (u_r - q_r); with VarN also a column factor, which does not move the argmin). The code-space Hessian
    diag(a) Sigma' diag(a) is W^T W with W = (diag(a) V)^T lower, so row j's target is u_j plus the errors of the rows
    before it, each times W_jr / W_jj:
        m_rj = C_rj a_r / a_j
        q_r = clamp(round(w_r), 0, 2^b - 1),  w_j += m_rj (u_r - q_r)      for j > r (w = u at first), r = 0..R-1
    product, then sum, in u's dtype. A diagonal Sigma is plain round-to-nearest, bit for bit. row_levels [N, R]: each
    row's largest code instead of 2^b - 1 (rows on finer grids: refined key channels). Returns uint8 codes [N, R, C]."""
    levels = (1 << check_bits(bits)) - 1
    n, r, _ = u.shape
    if row_levels is not None and row_levels.shape != (n, r):
        raise ValueError(f"row_levels must be [N, R] = {(n, r)}, got {tuple(row_levels.shape)}")
    if coef.shape != (n, r, r) or step.shape != (n, r):
        raise ValueError(f"coef must be [N, R, R] = {(n, r, r)} and step [N, R] = {(n, r)}, got "
                         f"{tuple(coef.shape)} and {tuple(step.shape)}")
    a = step.to(u.dtype)
    m = coef.to(u.dtype) * a[:, :, None] / a[:, None, :]
    w = u.clone()
    q = torch.empty_like(w)
    for i in range(r):
        qi = torch.round(w[:, i]).clamp_(0, levels) if row_levels is None else torch.minimum(
            torch.round(w[:, i]).clamp_(min=0), row_levels[:, i:i + 1].to(w.dtype))  # [N, C]
        q[:, i] = qi
        if i + 1 < r:
            err = u[:, i] - qi  # [N, C]: the row's own error, not what earlier rows pushed onto it
            w[:, i + 1:] += m[:, i, i + 1:, None] * err[:, None, :]
    return q.to(torch.uint8)
