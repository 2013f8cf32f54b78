"""Key channels at their own widths (kvarn.ops.widths), a scalar loop in float64.

For balanced rows b [R][C], column scales s_c [C], row scales s_r [R] and row weights g [R]:
    e_r(0) = s_r^2 g_r sum_c s_c^2 (mean(b_r) - b_rc)^2
    e_r(w) = min over clips of s_r^2 g_r sum_c s_c^2 (q delta + lo - b_rc)^2   (rtn_row at w bits; first clip on ties)
    widths = argmin sum_r e_r(w_r) with sum_r w_r = total   (dynamic programming over the rows, written anew)
Stored, each row part as `pack_row` lays it out at its bits, in row order within each part: the 4-bit rows; the low 2
bits of the 3-bit rows, then the 2-bit rows; the high bit of the 3-bit rows, then the 1-bit rows (width 0: no bytes).
"""

from __future__ import annotations

from .packing import unpack_row
from .rtn import rtn_row


def width_table(b: list[list[float]], s_c: list[float], s_r: list[float], g: list[float], clips: tuple[float, ...],
                max_width: int) -> list[list[tuple[float, float | None]]]:
    """[R][W] of (e_r(w), the clip chosen; None for width 0)."""
    out = []
    for r, row in enumerate(b):
        k = s_r[r] ** 2 * g[r]
        mean = sum(row) / len(row)
        cells = [(k * sum(s ** 2 * (mean - x) ** 2 for s, x in zip(s_c, row)), None)]
        for w in range(1, max_width + 1):
            best = None
            for clip in clips:
                codes, delta, lo, _ = rtn_row(row, w, clip)
                e = k * sum(s ** 2 * (q * delta + lo - x) ** 2 for s, q, x in zip(s_c, codes, row))
                if best is None or e < best[0]:
                    best = (e, clip)
            cells.append(best)
        out.append(cells)
    return out


def allocate(table: list[list[float]], total: int) -> tuple[list[int], float]:
    """Widths minimising sum_r table[r][w_r] with sum_r w_r = total, and that least error."""
    inf = float("inf")
    best = {0: (0.0, [])}  # bits so far -> (error, widths)
    for row in table:
        nxt: dict[int, tuple[float, list[int]]] = {}
        for t, (e, ws) in best.items():
            for w, ew in enumerate(row):
                if t + w <= total and e + ew < nxt.get(t + w, (inf,))[0]:
                    nxt[t + w] = (e + ew, [*ws, w])
        best = nxt
    e, ws = best[total]
    return ws, e


def unpack_rows(data: list[int], widths: list[int], cols: int) -> list[list[int]]:
    """Codes [R][C] of one tile's packed rows."""
    out, at = [[0] * cols for _ in widths], 0
    for bits, width, shift in ((4, 4, 0), (2, 3, 0), (2, 2, 0), (1, 3, 2), (1, 1, 0)):
        for r, w in enumerate(widths):
            if w == width:
                size = cols * bits // 8
                out[r] = [a + (b << shift) for a, b in zip(out[r], unpack_row(data[at:at + size], bits))]
                at += size
    return out
