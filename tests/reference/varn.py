"""VarN on one tile, a plain loop in float64 written from docs/SPEC.md §3 step 3 (not from kvarn.ops.varn).

    sigma_col(Y): sample std (divide by N - 1) of each column over the rows; sigma_row(Y): of each row
    Imb(Y) = max(sigma_col) / max(min(sigma_col), 1e-8) + max(sigma_row) / max(min(sigma_row), 1e-8)
    l_c = 0 (length C), l_r = 0 (length R); Y = X / exp(l_c)[cols] / exp(l_r)[rows]
    best scales = 1, I_best = Imb(X)
    repeat L times:
        l_c <- clamp(l_c + ln(clamp(sigma_col(Y), 1e-3, 1e3)), -0.3, 10); recompute Y
        l_r <- clamp(l_r + ln(clamp(sigma_row(Y), 1e-3, 1e3)), -0.3, 10); recompute Y
        if Imb(Y) <= I_best: best <- (exp(l_c), exp(l_r)), I_best <- Imb(Y)
    B = X / s_c* / s_r*
"""

from __future__ import annotations

import math
from typing import NamedTuple


def clamp(v: float, lo: float, hi: float) -> float:
    return min(max(v, lo), hi)


def sample_std(values: list[float]) -> float:
    n = len(values)
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


def col_stds(y: list[list[float]]) -> list[float]:
    return [sample_std([row[c] for row in y]) for c in range(len(y[0]))]


def row_stds(y: list[list[float]]) -> list[float]:
    return [sample_std(row) for row in y]


def imbalance_ref(y: list[list[float]]) -> float:
    sc, sr = col_stds(y), row_stds(y)
    return max(sc) / max(min(sc), 1e-8) + max(sr) / max(min(sr), 1e-8)


def normalize(x: list[list[float]], lc: list[float], lr: list[float]) -> list[list[float]]:
    return [[x[r][c] / math.exp(lc[c]) / math.exp(lr[r]) for c in range(len(lc))] for r in range(len(lr))]


class VarnRef(NamedTuple):
    b: list[list[float]]  # B [R][C] with the best scales
    s_col: list[float]  # [C]
    s_row: list[float]  # [R]
    imb: float  # I_best
    history: list[tuple[float, list[float], list[float]]]  # (Imb, s_col, s_row) of the start and each iteration


def varn_ref(x: list[list[float]], iters: int = 8) -> VarnRef:
    """One tile x [R][C] -> B, the best scales, I_best and every candidate on the way."""
    rows, cols = len(x), len(x[0])
    lc, lr = [0.0] * cols, [0.0] * rows
    best_c, best_r = [1.0] * cols, [1.0] * rows
    best_imb = imbalance_ref(x)
    history = [(best_imb, best_c, best_r)]
    for _ in range(iters):
        y = normalize(x, lc, lr)
        sc = col_stds(y)
        lc = [clamp(lc[c] + math.log(clamp(sc[c], 1e-3, 1e3)), -0.3, 10.0) for c in range(cols)]
        y = normalize(x, lc, lr)
        sr = row_stds(y)
        lr = [clamp(lr[r] + math.log(clamp(sr[r], 1e-3, 1e3)), -0.3, 10.0) for r in range(rows)]
        y = normalize(x, lc, lr)
        imb = imbalance_ref(y)
        history.append((imb, [math.exp(v) for v in lc], [math.exp(v) for v in lr]))
        if imb <= best_imb:  # ties take the newer scales
            best_imb, best_c, best_r = history[-1]
    b = [[x[r][c] / best_c[c] / best_r[r] for c in range(cols)] for r in range(rows)]
    return VarnRef(b, best_c, best_r, best_imb, history)


def _close(got: list[float], want: list[float], rtol: float) -> bool:
    return all(abs(g - w) <= rtol * abs(w) for g, w in zip(got, want))


def matching_candidate(ref: VarnRef, s_col: list[float], s_row: list[float], rtol: float,
                       tie_rtol: float) -> tuple[float, list[float], list[float]] | None:
    """The candidate whose scales equal (s_col, s_row) to `rtol`, provided its imbalance ties I_best
    within `tie_rtol`. At a fixed point several iterations have the same B and the same Imb up to
    rounding, with scales that differ by a gauge factor (s_c k, s_r / k); which of them wins the
    `Imb <= I_best` comparison is decided by the last bits, so any of those tied candidates is correct."""
    for cand in [(ref.imb, ref.s_col, ref.s_row), *ref.history[::-1]]:
        imb, c, r = cand
        if abs(imb - ref.imb) <= tie_rtol * abs(ref.imb) and _close(s_col, c, rtol) and _close(s_row, r, rtol):
            return cand
    return None
