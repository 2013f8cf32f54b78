"""The KVarN-family quantizer of one tile, float64, from docs/SPEC.md §3 steps 1-5, using the plain references.

Token-major tile x [G, D]:
    w = x @ H                                  (if rotated; H from `hadamard_reference`)
    keys:   X = w^T [D, G] (rows = channels)   values: X = w [G, D] (rows = tokens)
    B, s_c, s_r = varn_ref(X)                  (if VarN; else B = X, s_c = s_r = 1)
    q, delta, lo = rtn per row of B            (its range clipped to `clip` of the row's about the midpoint)
    a_r = s_r * delta_r, z_r = s_r * lo_r, t_c = s_c
    refined channels (keys, refine = k > 0): the k rows of largest w_r a_r^2 (w the weight, 1 without; ties to the
    lower row) get rtn at bits + 2 instead, a_r = s_r * delta'_r   (kvarn.quant.affine, "Refined channels")
Reconstruction X^[r, c] = (q[r, c] * a_r + z_r) * t_c, i.e.
    keys   K^[d, g] = (q[d, g] a_d + z_d) t_g        values  V^[g, d] = (q[g, d] a'_g + z'_g) c_d
then transposed back to token-major and multiplied by H where rotated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .hadamard import hadamard_reference
from .rtn import rtn_rows
from .varn import varn_ref


@dataclass
class TileRef:
    rows: list[list[float]]  # X [R][C] before VarN
    b: list[list[float]]  # B [R][C] after VarN
    codes: list[list[int]]  # q [R][C]
    positions: list[list[float]]  # (B - lo) / delta [R][C], for tie checks
    a: list[float]  # [R]
    z: list[float]  # [R]
    t: list[float]  # [C] (ones without VarN)
    recon: torch.Tensor  # [G, D] float64 from the unrounded scales
    refined: list[int]  # rows at bits + 2 (ascending; empty without refinement)


def quantize_tile_ref(x: torch.Tensor, bits: int, axis: str, rotate: bool, use_varn: bool,
                      iters: int = 8, refine: int = 0, weight: list[float] | None = None,
                      clip: float = 1.0) -> TileRef:
    w = x.double() @ hadamard_reference(x.shape[1]) if rotate else x.double()
    rows_t = w.T if axis == "channel" else w
    rows = rows_t.tolist()
    if use_varn:
        b, s_c, s_r, _, _ = varn_ref(rows, iters)
    else:
        b, s_c, s_r = rows, [1.0] * len(rows[0]), [1.0] * len(rows)
    codes, delta, lo, positions = rtn_rows(b, bits, clip)
    a = [s_r[r] * delta[r] for r in range(len(rows))]
    w = weight or [1.0] * len(rows)
    score = [w[r] * a[r] ** 2 for r in range(len(rows))]
    refined = sorted(sorted(range(len(rows)), key=lambda r: (-score[r], r))[:refine])
    for r in refined:
        c2, d2, l2, p2 = rtn_rows([b[r]], bits + 2, clip)
        codes[r], delta[r], lo[r], positions[r] = c2[0], d2[0], l2[0], p2[0]
        a[r] = s_r[r] * delta[r]
    z = [s_r[r] * lo[r] for r in range(len(rows))]
    recon = reconstruct_ref(codes, a, z, s_c, axis, rotate)
    return TileRef(rows, b, codes, positions, a, z, list(s_c), recon, refined)


def reconstruct_ref(codes: list[list[int]], a: list[float], z: list[float], t: list[float] | None, axis: str,
                    rotate: bool) -> torch.Tensor:
    """X^[r][c] = (q[r][c] * a_r + z_r) * t_c, back to token-major [G, D], then @ H if rotated."""
    n_rows, n_cols = len(codes), len(codes[0])
    t = t if t is not None else [1.0] * n_cols
    xr = [[(codes[r][c] * a[r] + z[r]) * t[c] for c in range(n_cols)] for r in range(n_rows)]
    out = torch.tensor(xr, dtype=torch.float64)
    out = out.T if axis == "channel" else out
    return out @ hadamard_reference(out.shape[1]) if rotate else out
