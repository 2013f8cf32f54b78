"""Asymmetric round-to-nearest of one row, a scalar loop in float64 (docs/SPEC.md §3 step 4).

    lo = min(row), hi = max(row), delta = max((hi - lo) / (2^b - 1), 1e-10)
    q  = clamp(round((x - lo) / delta), 0, 2^b - 1), round half to even (Python's round)
clipped (clip = c < 1): lo, hi <- m -+ c (hi - lo) / 2 about the midpoint m = (lo + hi) / 2 first
"""

from __future__ import annotations


def rtn_row(row: list[float], bits: int, clip: float = 1.0) -> tuple[list[int], float, float, list[float]]:
    """Returns codes, delta, lo and the unrounded positions (x - lo) / delta (for tie checks)."""
    levels = 2**bits - 1
    lo = min(row)
    hi = max(row)
    if clip != 1.0:
        mid, half = (lo + hi) / 2, (hi - lo) / 2 * clip
        lo, hi = mid - half, mid + half
    delta = max((hi - lo) / levels, 1e-10)
    codes, positions = [], []
    for x in row:
        pos = (x - lo) / delta
        q = round(pos)  # Python rounds half to even, like torch.round
        q = min(max(q, 0), levels)
        codes.append(q)
        positions.append(pos)
    return codes, delta, lo, positions


def rtn_rows(rows: list[list[float]], bits: int, clip: float = 1.0):
    """rtn_row on every row: (codes [R][C], delta [R], lo [R], positions [R][C])."""
    out = [rtn_row(r, bits, clip) for r in rows]
    return [o[0] for o in out], [o[1] for o in out], [o[2] for o in out], [o[3] for o in out]
