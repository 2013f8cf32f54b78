"""Lab variants of the key-width presets (issue 20; docs/TASKS.md, "Bits spread over a key tile's channels"): the
library's row widths (`kvarn.ops.widths`, `AffineConfig.widths`, `kvarn.presets.family.widths_preset`) at a mean width
of no budget, and the "mse" rule that spreads the bits by the keys' own error (no query weight), which lost.

The names of the data in docs/tasks: `kvarn-w2-query-qar` (mean 2), `kvarn-w2.34375-query-qar` (= `kvarn-w2.5`,
the same tiles bit for bit), `kvarn-w2-mse-qar`, `kvarn-w2.34375-mse-qar`. The runs of the twenty-ninth session held
these tiles in a 4-bit container read by the 4-bit kernels; the library packs each row at its own width.
"""

from __future__ import annotations

import dataclasses

import torch

from kvarn.ops.widths import CLIPS, width_targets
from kvarn.presets.family import widths_preset as library_widths_preset
from kvarn.presets.preset import Preset
from kvarn.quant.affine import QueryAwareQuantizer
from kvarn.quant.tiles import AffineFormat


class MseWidthsQuantizer(QueryAwareQuantizer):
    """Row widths allocated by the keys' own error (every row's weight 1), rounded query-aware as the library's."""

    def _targets(self, b: torch.Tensor, s_col: torch.Tensor | None, s_row: torch.Tensor | None, fmt: AffineFormat,
                 weight: torch.Tensor | None):
        return super()._targets(b, s_col, s_row, fmt, None)


# The library's clips at every width, and below them for 1-bit rows: most 1-bit rows choose the library's least clip
# (0.40; ~90 % of SmolLM2's and Qwen2.5-Coder's rows), so the search stops short of their best grid (lowclip1).
LOW_CLIPS_1 = tuple(x / 20 for x in range(2, 8)) + CLIPS  # 0.10 .. 1.00 for 1-bit rows
CLIP_SETS = {"lowclip1": (LOW_CLIPS_1, CLIPS, CLIPS, CLIPS)}


class ClipSetQuantizer(QueryAwareQuantizer):
    """The library's row widths with per-width clip sets (`CLIP_SETS`), on the PyTorch path (the kernel's are fixed)."""

    clips: tuple[tuple[float, ...], ...] = CLIP_SETS["lowclip1"]

    def _targets(self, b, s_col, s_row, fmt, weight):
        if not fmt.widths:
            return super()._targets(b, s_col, s_row, fmt, weight)
        u, delta, lo, levels, widths = width_targets(b, s_col, s_row, None if weight is None else weight.float(),
                                                     fmt.widths, self.clips)
        return u, delta, lo, levels[..., None], widths

    def _kernel(self, x: torch.Tensor) -> bool:
        return False


def widths_preset(mean_bits: float, rule: str = "query", name: str | None = None) -> Preset:
    """The library's width preset at a mean key width; rule "mse": allocated by the keys' own error; a rule
    "query-NAME" with NAME in CLIP_SETS: the query rule with those clip sets."""
    if rule not in ("mse", "query") and rule.removeprefix("query-") not in CLIP_SETS:
        raise ValueError(f"rule must be 'mse', 'query' or 'query-' + one of {sorted(CLIP_SETS)}, got {rule!r}")
    p = library_widths_preset(mean=mean_bits, name=name or f"kvarn-w{mean_bits:g}-{rule}-qar")
    if rule == "query":
        return p
    inner = p.key
    if rule != "mse":
        sets = CLIP_SETS[rule.removeprefix("query-")]

        def clipped(d: int) -> ClipSetQuantizer:
            q = inner(d)
            out = ClipSetQuantizer(q.config, q.policy, q.damp)
            out.clips = sets
            return out

        return dataclasses.replace(p, key=clipped, description=p.description + f" ({rule.removeprefix('query-')})")

    def key(d: int) -> MseWidthsQuantizer:
        q = inner(d)
        return MseWidthsQuantizer(q.config, q.policy, q.damp)

    return dataclasses.replace(p, key=key, description=p.description.replace("the running query energy",
                                                                              "the keys' own error"))
