"""Key channels at 0..4 bits each within a tile's fixed total (issue 20; docs/TASKS.md, "Bits spread over a key
tile's channels"): reverse water-filling over the rows of a key tile.

Per tile, the VarN-balanced rows b [R, C] (X = b s_col s_row) and row weights g_r (the queries' energy E[q_r^2] in the
plain basis; 1 in the rotated one or without queries):

    width w in 1..4: the uniform grid (`rtn_targets`) of the clip c in CLIPS whose nearest rounding errs least,
        e_r(w) = s_row_r^2 g_r sum_c s_col_c^2 (clamp(round(u), 0, 2^w - 1) delta + lo - b_rc)^2   (first c on ties)
    width 0: the row's mean: lo = mean, delta = the row's range, largest code 0
    widths: argmin sum_r e_r(w_r) subject to sum_r w_r = total   (`allocate_widths`: exact dynamic programming)

Stored (`pack_rows`), total * C / 8 bytes a tile whatever the widths, in three blocks of the plane layout
(`pack_codes`), rows in order within each part:
    4-bit block: the 4-bit rows
    2-bit block: the low 2 bits of the 3-bit rows, then the 2-bit rows
    1-bit block: the high bit of the 3-bit rows, then the 1-bit rows
(width 0 takes no bytes), and the widths themselves 3 bits a row. So a kernel multiplies a tile as three tiles of one
width each (a 3-bit row's high bit weighs 4), with no 3-bit unpacking.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvarn.ops.packing import pack_codes, unpack_codes
from kvarn.ops.rtn import RANGE_GUARD, rtn_targets

MAX_WIDTH = 4
WIDTH_BITS = 3  # a row's width, stored
CLIPS = tuple(x / 20 for x in range(8, 21))  # 0.40 .. 1.00: the grids each width chooses from


def allocate_widths(err: torch.Tensor, total: int) -> torch.Tensor:
    """Integer widths [N, R] in 0..W-1 minimising sum_r err[n, r, w_r] subject to sum_r w_r = total in each tile,
    err [N, R, W] (width w's error): exact, by dynamic programming over the rows (R steps over the running bit
    total). Ties go to the first width that reaches the least error (`min`)."""
    n, r, nw = err.shape
    if not 0 <= total <= r * (nw - 1):
        raise ValueError(f"{total} bits cannot be spread over {r} rows of 0..{nw - 1} bits")
    inf = torch.tensor(float("inf"), dtype=err.dtype, device=err.device)
    cost = torch.full((n, total + 1), float("inf"), dtype=err.dtype, device=err.device)
    cost[:, 0] = 0
    choice = []
    for i in range(r):  # cost[t]: the least error of rows < i holding t bits
        cand = torch.stack([torch.cat([inf.expand(n, w), cost[:, :total + 1 - w]], 1) + err[:, i, w, None]
                            for w in range(nw)], -1)  # [N, T + 1, W]
        cost, arg = cand.min(-1)
        choice.append(arg)
    w = torch.empty(n, r, dtype=torch.long, device=err.device)
    t = torch.full((n,), total, dtype=torch.long, device=err.device)
    for i in reversed(range(r)):
        w[:, i] = choice[i].gather(1, t[:, None])[:, 0]
        t -= w[:, i]
    return w


def row_weights(s_col: torch.Tensor, s_row: torch.Tensor, gain: torch.Tensor | None) -> torch.Tensor:
    """The weight of each element's squared error [N, R, C]: s_row_r^2 s_col_c^2 (g_r)."""
    wt = s_row[..., None].square() * s_col[..., None, :].square()
    return wt if gain is None else wt * gain[..., None]


def grid_error(b: torch.Tensor, wt: torch.Tensor, t: tuple[torch.Tensor, ...], bits: int) -> torch.Tensor:
    """e_r [N, R]: the weighted squared error of rows b on the grid t = `rtn_targets(b, bits, clip)` (nearest
    rounding)."""
    return ((torch.round(t[0]).clamp_(0, (1 << bits) - 1) * t[1] + t[2] - b).square() * wt).sum(-1)


def width_targets(b: torch.Tensor, s_col: torch.Tensor, s_row: torch.Tensor, gain: torch.Tensor | None,
                  total: int, clips: Sequence[Sequence[float]] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Balanced rows b [N, R, C] (X = b s_col s_row), row weights gain [N, R] (None: 1) -> (unrounded codes u
    [N, R, C], step delta and zero lo [N, R, 1] of the balanced rows, each row's largest code [N, R], widths [N, R])
    at the widths `allocate_widths` gives (module docstring); u - q is a width-0 row's error in steps. clips[w - 1]:
    the clips width w chooses from (None: CLIPS at every width; other sets are the lab's, no kernel reads them)."""
    wt = row_weights(s_col, s_row, gain)
    mean = b.mean(-1, keepdim=True)
    err = [((mean - b).square() * wt).sum(-1)]
    delta = (b.amax(-1, keepdim=True) - b.amin(-1, keepdim=True)).clamp_min(RANGE_GUARD)
    targets = [((b - mean) / delta, delta, mean)]  # width 0
    for bits in range(1, MAX_WIDTH + 1):  # each row's best clip at this width (ties: the first clip)
        best = None
        for c in (CLIPS if clips is None else clips[bits - 1]):
            t = rtn_targets(b, bits, c)
            e = grid_error(b, wt, t, bits)
            if best is None:
                best, chosen = e, t
            else:
                better = e < best
                best = torch.where(better, e, best)
                chosen = tuple(torch.where(better[..., None], x, y) for x, y in zip(t, chosen))
        err.append(best)
        targets.append(chosen)
    w = allocate_widths(torch.stack(err, -1), total)
    u, delta, lo = targets[0]
    for bits in range(1, MAX_WIDTH + 1):
        pick = (w == bits)[..., None]
        u, delta, lo = (torch.where(pick, x, y) for x, y in zip(targets[bits], (u, delta, lo)))
    return u, delta, lo, ((1 << w) - 1).masked_fill(w == 0, 0).to(b.dtype), w


# The blocks of a tile's codes, in order (module docstring): (bits packed, the width of the rows they hold, shift of the
# code bits they hold). A 3-bit row's code c = l + 4 h is split: its low bits l lead the 2-bit block, its high bit h
# the 1-bit block.
BLOCKS = ((4, 4, 0), (2, 3, 0), (2, 2, 0), (1, 3, 2), (1, 1, 0))


def _starts(widths: torch.Tensor, cols: int, size: int) -> list[tuple[int, int, int, torch.Tensor, torch.Tensor]]:
    """Per block: (bits, width, shift, rows [N, R] bool, flat byte offset [N, R] of each of those rows' codes in a
    [N, size] buffer)."""
    w = widths.long()
    base = torch.arange(w.shape[0], device=w.device)[:, None] * size
    out = []
    for bits, width, shift in BLOCKS:
        rows = w == width
        out.append((bits, width, shift, rows, base + (rows.long().cumsum(-1) - 1) * (cols * bits // 8)))
        base = base + rows.long().sum(-1, keepdim=True) * (cols * bits // 8)
    return out


def pack_rows(codes: torch.Tensor, widths: torch.Tensor, total: int) -> torch.Tensor:
    """uint8 codes [N, R, C] (row r's below 2^w_r), widths [N, R] summing to at most total -> [N, total C / 8] uint8:
    the blocks of the module docstring, each `pack_codes` at its bits; bytes past the rows' are zero."""
    n, _, c = codes.shape
    size = total * c // 8
    out = torch.zeros(n * size, dtype=torch.uint8, device=codes.device)
    if widths.long().sum(-1).gt(total).any():
        raise ValueError(f"row widths sum past the tile's {total} bits")
    for bits, _, shift, rows, start in _starts(widths, c, size):
        if rows.any():
            idx = start[rows][:, None] + torch.arange(c * bits // 8, device=codes.device)
            out[idx] = pack_codes((codes[rows] >> shift) & ((1 << bits) - 1), bits)
    return out.view(n, size)


def unpack_rows(packed: torch.Tensor, widths: torch.Tensor, cols: int, dtype: torch.dtype = torch.uint8
                ) -> torch.Tensor:
    """Inverse of `pack_rows`: packed [..., total C / 8], widths [..., R] -> codes [..., R, C] in `dtype` (width-0
    rows: 0)."""
    lead, r = widths.shape[:-1], widths.shape[-1]
    flat, wf = packed.reshape(-1, packed.shape[-1]), widths.reshape(-1, r)
    out = torch.zeros(wf.shape[0], r, cols, dtype=dtype, device=packed.device)
    src = flat.reshape(-1)
    for bits, _, shift, rows, start in _starts(wf, cols, flat.shape[1]):
        if rows.any():
            idx = start[rows][:, None] + torch.arange(cols * bits // 8, device=packed.device)
            out[rows] += unpack_codes(src[idx], bits, dtype=dtype) * (1 << shift)
    return out.view(*lead, r, cols)


def pack_widths(widths: torch.Tensor) -> torch.Tensor:
    """Widths [..., R] in 0..4 -> [..., 3 R / 8] uint8 (`pack_codes` at WIDTH_BITS)."""
    return pack_codes(widths.to(torch.uint8), WIDTH_BITS)


def unpack_widths(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_widths`: [..., 3 R / 8] uint8 -> widths [..., R] int64."""
    return unpack_codes(packed, WIDTH_BITS).long()
