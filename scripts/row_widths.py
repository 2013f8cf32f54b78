"""Keys whose channels get 0-4 bits each, the same 2 bits a row on average (a lab variant of issue 20; docs/TASKS.md,
"Bits spread over a key tile's channels"): transform coding's reverse water-filling within a key tile, in the basis
kvarn-auto chooses (plain or Hadamard), after VarN.

Per tile and basis, VarN's balanced rows b (channels) with X = b s_col s_row; row r at width w in 1..4 is the uniform
grid of the clip (of `CLIPS`) that errs least, at width 0 the row's mean. The error a width leaves on row r,

    e_r(w) = s_row_r^2 g_r sum_c s_col_c^2 (b^_rc(w) - b_rc)^2        g_r: the queries' energy E[q_r^2] ("query";
                                                                      1 in the rotated basis) or 1 ("mse")

is summed into the tile's total, which the widths minimise subject to sum_r w_r = mean_bits R (`allocate_widths`,
exact). Query-aware rounding (`-qar`) rounds every row on its own grid in the same error feedback.

Stored here in a 4-bit container: codes of width w use 0..2^w - 1 with the row's own step, so the fused 4-bit kernels
and the vLLM plugin read the tiles as they are. A packed store would hold sum_r w_r G bits of codes a tile (the
2-bit tile's bytes at mean_bits 2) plus 3 bits a row for the widths: `packed_bits_per_element`. This container is for
measuring accuracy only; its bytes are not the preset's.
"""

from __future__ import annotations

import torch

from kvarn.ops.rtn import RANGE_GUARD, query_aware_round, rtn_targets
from kvarn.presets.family import CLIP_2BIT, affine_preset
from kvarn.presets.preset import Preset
from kvarn.quant.affine import AffineConfig, QueryAwareQuantizer
from kvarn.quant.tiles import AffineFormat, AffineTiles

WIDTHS = 5  # 0..4 bits a row
CLIPS = tuple(x / 20 for x in range(8, 21))  # 0.40 .. 1.00
WIDTH_BITS = 3  # a row's width, stored


def allocate_widths(err: torch.Tensor, mean_bits: float) -> torch.Tensor:
    """Integer widths [N, R] in 0..W-1 minimising sum_r err[n, r, w_r] subject to sum_r w_r = round(mean_bits R) in
    each tile, err [N, R, W] (width w's error): exact, by dynamic programming over the rows (R steps over the
    running bit total)."""
    n, r, nw = err.shape
    budget = round(mean_bits * r)
    inf = torch.tensor(float("inf"), dtype=err.dtype)
    cost = torch.full((n, budget + 1), float("inf"), dtype=err.dtype)
    cost[:, 0] = 0
    choice = []
    for i in range(r):  # cost[t]: the least error of rows < i holding t bits
        cand = torch.stack([torch.cat([inf.expand(n, w), cost[:, :budget + 1 - w]], 1) + err[:, i, w, None]
                            for w in range(nw)], -1)  # [N, T + 1, W]
        cost, arg = cand.min(-1)
        choice.append(arg)
    w = torch.empty(n, r, dtype=torch.long)
    t = torch.full((n,), budget, dtype=torch.long)
    for i in reversed(range(r)):
        w[:, i] = choice[i].gather(1, t[:, None])[:, 0]
        t -= w[:, i]
    return w


def width_targets(b: torch.Tensor, s_col: torch.Tensor, s_row: torch.Tensor, gain: torch.Tensor | None,
                  mean_bits: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Balanced rows b [N, R, C] (X = b s_col s_row) -> (unrounded codes u [N, R, C], step delta and zero lo [N, R, 1]
    of the balanced rows, each row's largest code [N, R]) at the widths `allocate_widths` gives (module docstring).
    A width-0 row keeps its mean: lo = mean, delta its range, largest code 0 (so u - q is its error in steps)."""
    wt = s_row[..., None].square() * s_col[..., None, :].square()  # [N, R, C]
    wt = wt if gain is None else wt * gain[..., None]
    mean = b.mean(-1, keepdim=True)
    err = [((mean - b).square() * wt).sum(-1)]
    delta = (b.amax(-1, keepdim=True) - b.amin(-1, keepdim=True)).clamp_min(RANGE_GUARD)
    targets = [((b - mean) / delta, delta, mean)]  # width 0
    for bits in range(1, WIDTHS):  # each row's best clip at this width (ties: the first clip)
        best = None
        for c in CLIPS:
            t = rtn_targets(b, bits, c)
            e = ((torch.round(t[0]).clamp_(0, (1 << bits) - 1) * t[1] + t[2] - b).square() * wt).sum(-1)
            if best is None:
                best, chosen = e, t
            else:
                better = e < best
                best = torch.where(better, e, best)
                chosen = tuple(torch.where(better[..., None], x, y) for x, y in zip(t, chosen))
        err.append(best)
        targets.append(chosen)
    w = allocate_widths(torch.stack(err, -1), mean_bits)
    u, delta, lo = targets[0]
    for bits in range(1, WIDTHS):
        pick = (w == bits)[..., None]
        u, delta, lo = (torch.where(pick, x, y) for x, y in zip(targets[bits], (u, delta, lo)))
    return u, delta, lo, ((1 << w) - 1).masked_fill(w == 0, 0).to(b.dtype)


class RowWidthsQuantizer(QueryAwareQuantizer):
    """Keys at 0-4 bits a channel, `mean_bits` on average a tile (module docstring), in a 4-bit container, rounded
    query-aware with the running E[q q^T] (as `QueryAwareQuantizer`). PyTorch only (no store kernel knows the
    widths)."""

    def __init__(self, config: AffineConfig, mean_bits: float, rule: str) -> None:
        if config.bits != WIDTHS - 1 or config.axis != "channel":
            raise ValueError("row widths are stored in a 4-bit key container (bits=4, axis 'channel')")
        if rule not in ("mse", "query"):
            raise ValueError(f"rule must be 'mse' or 'query', got {rule!r}")
        super().__init__(config)
        self.mean_bits, self.rule = mean_bits, rule
        self.name += f"-w{mean_bits:g}-{rule}"

    def packed_bits_per_element(self, head_dim: int) -> float:
        """What a packed store would hold: the 2-bit format's bytes with mean_bits of codes, plus the widths."""
        f = self.format(head_dim)
        two = AffineFormat(2, f.axis, f.rotate, f.tile, head_dim, f.scale_dtype, f.zero_dtype, f.col_dtype)
        codes = (self.mean_bits - 2) * f.tile * head_dim / 8
        return (two.nbytes + codes + WIDTH_BITS * head_dim / 8) * 8 / (f.tile * head_dim)

    def _kernel(self, x: torch.Tensor) -> bool:
        return False

    def _gain(self, weight: torch.Tensor | None) -> torch.Tensor | None:
        return weight.float() if self.rule == "query" and weight is not None else None

    def _encode_rows(self, x: torch.Tensor, fmt: AffineFormat, weight: torch.Tensor | None = None) -> AffineTiles:
        b, s_col, s_row = self._normalized(x)
        u, delta, lo, levels = width_targets(b, s_col, s_row, self._gain(weight), self.mean_bits)
        q = torch.minimum(torch.round(u).clamp_(min=0), levels[..., None]).to(torch.uint8)
        return self._tiles(q, *self._row_steps(delta, lo, s_row), s_col, fmt)

    def _encode_rows_qa(self, x: torch.Tensor, fmt: AffineFormat, coef: torch.Tensor,
                        weight: torch.Tensor | None = None) -> AffineTiles:
        b, s_col, s_row = self._normalized(x)
        u, delta, lo, levels = width_targets(b, s_col, s_row, self._gain(weight), self.mean_bits)
        delta, lo = self._row_steps(delta, lo, s_row)
        return self._tiles(query_aware_round(u, coef, delta, WIDTHS - 1, levels), delta, lo, s_col, fmt)


def widths_preset(mean_bits: float, rule: str = "mse", name: str | None = None) -> Preset:
    """`kvarn-auto-k2v2-g128-qar-clip` with keys at 0-4 bits a channel, mean_bits on average (module docstring)."""
    base = affine_preset("kvarn-auto", 2, 2, 128, rounding="query-aware", clip=(CLIP_2BIT, CLIP_2BIT))
    col = base.key(0).config.col_scale_dtype

    def key(_: int) -> RowWidthsQuantizer:
        return RowWidthsQuantizer(AffineConfig(WIDTHS - 1, "channel", "auto", True, tile=128, col_scale_dtype=col),
                                  mean_bits, rule)

    name = name or f"kvarn-w{mean_bits:g}-{rule}-qar"
    return base.replace(name=name, key=key, description=base.description + f"; keys at 0-4 bits a channel, "
                        f"{mean_bits:g} on average ({rule} widths), in a 4-bit container (lab)")
