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

from kvarn.presets.family import widths_preset as library_widths_preset
from kvarn.presets.preset import Preset
from kvarn.quant.affine import QueryAwareQuantizer
from kvarn.quant.tiles import AffineFormat


class MseWidthsQuantizer(QueryAwareQuantizer):
    """Row widths allocated by the keys' own error (every row's weight 1), rounded query-aware as the library's."""

    def _targets(self, b: torch.Tensor, s_col: torch.Tensor | None, s_row: torch.Tensor | None, fmt: AffineFormat,
                 weight: torch.Tensor | None):
        return super()._targets(b, s_col, s_row, fmt, None)


def widths_preset(mean_bits: float, rule: str = "query", name: str | None = None) -> Preset:
    """The library's width preset at a mean key width; rule "mse": allocated by the keys' own error."""
    if rule not in ("mse", "query"):
        raise ValueError(f"rule must be 'mse' or 'query', got {rule!r}")
    p = library_widths_preset(mean=mean_bits, name=name or f"kvarn-w{mean_bits:g}-{rule}-qar")
    if rule == "query":
        return p
    inner = p.key

    def key(d: int) -> MseWidthsQuantizer:
        q = inner(d)
        return MseWidthsQuantizer(q.config, q.policy, q.damp)

    return dataclasses.replace(p, key=key, description=p.description.replace("the running query energy",
                                                                              "the keys' own error"))
