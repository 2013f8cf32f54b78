"""Dual-axis variance normalization (VarN), Sinkhorn–Knopp style, on a batch of tiles X [..., R, C].

    sigma_col(Y): unbiased std of each column over the R rows; sigma_row(Y): of each row over the C columns
    Imb(Y) = max(sigma_col) / max(min(sigma_col), 1e-8) + max(sigma_row) / max(min(sigma_row), 1e-8)
    l_c = 0 [C], l_r = 0 [R], Y = X / exp(l_c)[cols] / exp(l_r)[rows]; best = (1, 1), I_best = Imb(X)
    repeat L times (no early stop):
        l_c <- clamp(l_c + ln(clamp(sigma_col(Y), 1e-3, 1e3)), -0.3, 10); recompute Y
        l_r <- clamp(l_r + ln(clamp(sigma_row(Y), 1e-3, 1e3)), -0.3, 10); recompute Y
        if Imb(Y) <= I_best: best <- (exp(l_c), exp(l_r)), I_best <- Imb(Y)      (ties take the newer)
    return B = X / s_c* / s_r*, s_c* [..., C], s_r* [..., R]

Statistics run in float32 (float64 stays float64). Everything is vectorized over the leading axes;
the only Python loop is over the L iterations.
"""

from __future__ import annotations

import torch

STD_CLAMP = (1e-3, 1e3)
LOG_SCALE_CLAMP = (-0.3, 10.0)
IMB_FLOOR = 1e-8
DEFAULT_ITERS = 8


def imbalance(y: torch.Tensor) -> torch.Tensor:
    """Imb(Y) per tile, [...]."""
    sc = y.std(dim=-2)
    sr = y.std(dim=-1)
    return sc.amax(-1) / sc.amin(-1).clamp_min(IMB_FLOOR) + sr.amax(-1) / sr.amin(-1).clamp_min(IMB_FLOOR)


def varn(x: torch.Tensor, iters: int = DEFAULT_ITERS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (B, s_col [..., C], s_row [..., R]) with X = B * s_col[cols] * s_row[rows]."""
    if x.dim() < 2 or x.shape[-1] < 2 or x.shape[-2] < 2:
        raise ValueError(f"varn needs tiles [..., R, C] with R, C >= 2, got shape {tuple(x.shape)}")
    if iters < 0:
        raise ValueError(f"iters must be >= 0, got {iters}")
    x = x if x.dtype == torch.float64 else x.float()
    lc = x.new_zeros(x.shape[:-2] + x.shape[-1:])
    lr = x.new_zeros(x.shape[:-1])
    best_c, best_r = torch.ones_like(lc), torch.ones_like(lr)
    best_imb = imbalance(x)
    lo, hi = LOG_SCALE_CLAMP
    for _ in range(iters):
        y = x / lc.exp().unsqueeze(-2) / lr.exp().unsqueeze(-1)
        lc = (lc + y.std(dim=-2).clamp(*STD_CLAMP).log()).clamp(lo, hi)
        y = x / lc.exp().unsqueeze(-2) / lr.exp().unsqueeze(-1)
        lr = (lr + y.std(dim=-1).clamp(*STD_CLAMP).log()).clamp(lo, hi)
        y = x / lc.exp().unsqueeze(-2) / lr.exp().unsqueeze(-1)
        imb = imbalance(y)
        better = imb <= best_imb
        best_imb = torch.where(better, imb, best_imb)
        best_c = torch.where(better.unsqueeze(-1), lc.exp(), best_c)
        best_r = torch.where(better.unsqueeze(-1), lr.exp(), best_r)
    return x / best_c.unsqueeze(-2) / best_r.unsqueeze(-1), best_c, best_r
