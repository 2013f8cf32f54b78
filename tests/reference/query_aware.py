"""Query-aware rounding (the lab variant `kvarn.quant.affine.QueryAwareQuantizer`), the OBQ form in float64: round
the rows of one column in order and, after each, move the rows not yet rounded to the minimiser of r^T H r given
the rounded ones, through the inverse of H restricted to the rows still free (not the Cholesky factor the library
uses: the same update, computed another way).

    H' = diag(a) (Sigma + damp mean(diag Sigma) I) diag(a)     (a: the rows' quantization steps)
    for i = 0 .. R-1:   F = [i, R),  P = (H'_FF)^-1
                        q_i = clamp(round(u_i), 0, 2^b - 1),   e = u_i - q_i
                        u_j -= e P[j, i] / P[i, i]   for j in F, j > i
"""

from __future__ import annotations

import torch


def hessian(sigma: torch.Tensor, step: torch.Tensor, damp: float = 0.01) -> torch.Tensor:
    """The code-space Hessian H' [R, R] of Sigma [R, R] and the steps a [R], float64."""
    s = sigma.double()
    s = (s + s.T) / 2
    s = s + damp * max(float(s.diagonal().mean()), 1e-30) * torch.eye(len(s), dtype=torch.float64)
    a = step.double()
    return a[:, None] * s * a[None, :]


def query_aware_column(u: list[float], h: torch.Tensor, bits: int | list[int]) -> list[int]:
    """Codes of one column u [R] (a list of floats) under H' [R, R] (`hessian`); bits: the width of every row, or
    each row's largest code (rows on grids of two widths: refined key channels)."""
    r = len(u)
    top = [2**bits - 1] * r if isinstance(bits, int) else list(bits)
    w = [float(x) for x in u]
    out = []
    for i in range(r):
        q = min(max(round(w[i]), 0), top[i])  # Python rounds half to even, like torch.round
        out.append(q)
        e = w[i] - q
        if i + 1 < r:
            p = torch.linalg.inv(h[i:, i:])
            for j in range(i + 1, r):
                w[j] -= e * float(p[j - i, 0]) / float(p[0, 0])
    return out


def query_aware_tile(u: torch.Tensor, sigma: torch.Tensor, step: torch.Tensor, bits: int,
                     damp: float = 0.01) -> torch.Tensor:
    """u [R, C], Sigma [R, R], steps a [R] -> codes [R, C] (long), column by column."""
    h = hessian(sigma, step, damp)
    cols = [query_aware_column(u[:, c].tolist(), h, bits) for c in range(u.shape[1])]
    return torch.tensor(cols, dtype=torch.long).T
