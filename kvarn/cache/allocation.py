"""Key bits per layer, chosen online within a budget (the budget presets, issue 20): which layers' keys get the
high quantizer.

Why keys, why per layer: at 2 bits the loss sits in the keys (k4v2 closes the task gap where k2v2 loses answers),
and a store holds one code width (its fields stack across tiles), so a layer is the unit a budget can move.

The rules, calibration-free (nothing but the request's own K and Q). When a layer's first key tile is complete and
its queries have been observed, the layer scores what the high quantizer would remove from that tile:

    "output" (the budget presets' rule, `output_gain`): the attention output's error on the newest 128 queries,
        relative to the outputs' energy,  (|o(K^low) - o(K)|^2 - |o(K^high) - o(K)|^2) / |o(K)|^2,
        o the causal softmax attention over everything the layer holds (exact until then);
    "logit" (`promotion_gain`): the expected squared attention-logit error,
        err_low - err_high,   err = sum_{b,h} sum_g sum_d w_{b,h,d} (x^_{g,d} - x_{g,d})^2,
        with w the running query energy E[q_d^2] of kvarn-auto (`kvarn.quant.policy.QueryEnergy`).

docs/TASKS.md ("Budget presets") measures both: "output" kept the needles at 2.5 bits on held-out samples where
"logit" did not. Tiles wait exact in the tail until every quantized layer has scored (one forward over the prompt,
or the chunk after the sink under chunked prefill); then the `count` layers with the largest gains (ties: the lower
layer) take the high quantizer for good, the next `mid_count` a mid one (3-bit keys: the budget that rounding the
high layers down to whole layers leaves), the rest the low one. Nothing is stored twice: the scores are computed on
trial encodings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvarn.quant.base import TileQuantizer
from kvarn.quant.policy import weighted_error


def _trial(q: TileQuantizer, flat: torch.Tensor, w: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """flat [N, G, D] encoded as the cache would (the weight where the quantizer takes one) and decoded in float32:
    (x^ [N, G, D], input finite [N])."""
    packed, finite, _ = q.encode_tiles(flat, w if getattr(q, "takes_weight", False) else None)
    return q.decode(packed, torch.float32), finite


def promotion_gain(tile: torch.Tensor, weight: torch.Tensor | None, low: TileQuantizer,
                   high: TileQuantizer) -> float:
    """tile [B, H, G, D] keys, weight [B, H, D] query energy or None (= 1): err_low - err_high (module docstring)."""
    b, h, g, d = tile.shape
    flat = tile.reshape(b * h, g, d)
    w = None if weight is None else weight.to(flat.device).reshape(b * h, d)

    def err(q: TileQuantizer) -> float:
        x_hat, finite = _trial(q, flat, w)
        keep = finite & torch.isfinite(flat).flatten(1).all(1)  # non-finite tiles stay exact: they cost nothing
        return float(weighted_error(flat[keep], x_hat[keep], None if w is None else w[keep]).sum())

    return err(low) - err(high)


def output_gain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, weight: torch.Tensor | None,
                low: TileQuantizer, high: TileQuantizer, rows: int = 128) -> float:  # rows: OUTPUT_ROWS
    """The attention-output error the high quantizer removes ("output" rule): q [B, Hq, t, D] the newest queries (the
    last t positions of k), k, v [B, H, L, D] what the layer holds exact (values as stored), the key tile at
    [first, first + G) quantized by each quantizer in turn; over the last `rows` queries,
    (|o(K with the low tile) - o(K)|^2 - |o(K with the high tile) - o(K)|^2) / |o(K)|^2, causal softmax attention
    in float32."""
    b, hq, _, d = q.shape
    h, n, g = k.shape[1], k.shape[2], low.tile
    q = q[:, :, -rows:].float()
    t0 = n - q.shape[2]  # position of the first query kept
    tile = k[:, :, first:first + g].float()
    flat = tile.reshape(b * h, g, d)
    w = None if weight is None else weight.to(flat.device).float().reshape(b * h, d)
    visible = torch.arange(n, device=q.device)[None, :] <= torch.arange(t0, n, device=q.device)[:, None]  # [t, L]
    vv = v.float().repeat_interleave(hq // h, 1)

    def out(kt: torch.Tensor) -> torch.Tensor:
        kk = torch.cat([k[:, :, :first].float(), kt, k[:, :, first + g:].float()], 2).repeat_interleave(hq // h, 1)
        s = (q @ kk.transpose(-1, -2)) / d ** 0.5
        return torch.softmax(s.masked_fill(~visible, float("-inf")), -1) @ vv

    o = out(tile)
    e_low, e_high = ((out(_trial(qz, flat, w)[0].reshape(b, h, g, d)) - o).square().sum() for qz in (low, high))
    # relative to the outputs' energy: value scales grow with depth, and an absolute error would rank by them
    gain = (e_low - e_high) / o.square().sum()
    return float(torch.nan_to_num(gain, nan=0.0, posinf=0.0, neginf=0.0))


RULES = ("logit", "output")
OUTPUT_ROWS = 128  # newest queries the "output" rule scores with


class KeyAllocation:
    """Which of a cache's quantized layers store keys with `high` (shared by the layers of one cache).

    layers     the quantized layers that report (their indices)
    count      how many of them get `high`
    rule       "logit": `promotion_gain` (query-energy-weighted key error); "output": `output_gain` (the attention
               output error on the newest queries; layers whose attention observes no query score by "logit")
    mid        a quantizer between low and high, and mid_count: how many layers get it, the next ones by the same
               ranking (the budget that rounding the `high` layers down leaves; `Preset.mid_layers`)
    """

    def __init__(self, layers: Sequence[int], count: int, low: TileQuantizer, high: TileQuantizer,
                 rule: str = "output", mid: TileQuantizer | None = None, mid_count: int = 0) -> None:
        if rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
        self.rule = rule
        if not 0 <= count <= len(layers) or not 0 <= mid_count <= len(layers) - count:
            raise ValueError(f"cannot promote {count} + {mid_count} of {len(layers)} layers")
        if mid_count and mid is None:
            raise ValueError("mid_count needs the mid quantizer")
        tiles = [q.tile for q in (low, high, mid) if q is not None]
        if len(set(tiles)) > 1:
            raise ValueError(f"the key quantizers (low, high, mid) must share a tile, got {tiles}")
        self.layers, self.count, self.low, self.high = tuple(layers), count, low, high
        self.mid, self.mid_count = mid, mid_count
        self.scores: dict[int, float] = {}
        self.promoted: frozenset[int] | None = None  # None until decided
        self.middle: frozenset[int] = frozenset()  # the layers at `mid`

    @property
    def decided(self) -> bool:
        return self.promoted is not None

    def report(self, layer: int, score: float) -> None:
        """Layer `layer`'s gain (first report counts); decides once every layer has reported."""
        if layer not in self.layers:
            raise ValueError(f"layer {layer} is not one of the allocation's layers {self.layers}")
        self.scores.setdefault(layer, score)
        if self.promoted is None and len(self.scores) == len(self.layers):
            ranked = sorted(self.layers, key=lambda i: (-self.scores[i], i))
            self.middle = frozenset(ranked[self.count:self.count + self.mid_count])
            self.promoted = frozenset(ranked[:self.count])

    def decide(self, promoted: Sequence[int], middle: Sequence[int] = ()) -> None:
        """Set the decision (a loaded cache restores its saved one)."""
        chosen = [*promoted, *middle]
        if (any(i not in self.layers for i in chosen) or len(set(chosen)) != len(chosen)
                or len(promoted) != self.count or len(middle) != self.mid_count):
            raise ValueError(f"an allocation promotes {self.count} + {self.mid_count} distinct layers of "
                             f"{self.layers}, got {sorted(promoted)} + {sorted(middle)}")
        self.middle = frozenset(middle)
        self.promoted = frozenset(promoted)

    def quantizer(self, layer: int) -> TileQuantizer:
        if self.promoted is None:
            raise RuntimeError("the key allocation is not decided yet")
        return self.high if layer in self.promoted else self.mid if layer in self.middle else self.low

    def clear(self) -> None:
        self.scores.clear()
        self.promoted, self.middle = None, frozenset()

    def report_dict(self) -> Mapping[str, Any]:
        """JSON-plain: the layers, counts, the decision (None: pending) and each layer's score."""
        out = {"layers": list(self.layers), "count": self.count,
               "promoted": None if self.promoted is None else sorted(self.promoted),
               "scores": {str(i): s for i, s in sorted(self.scores.items())},
               "low_bits": self.low.describe().get("bits"), "high_bits": self.high.describe().get("bits")}
        if self.mid is not None:  # records of allocations without a mid width stay as they were
            out.update(mid_count=self.mid_count, middle=None if self.promoted is None else sorted(self.middle),
                       mid_bits=self.mid.describe().get("bits"))
        return out
