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

Pick "best" (`budget_preset(..., pick="best")`): each layer scores the mid width too (one trial encode more), and
the same key bits go to the split of high and mid layers with the largest summed gain (`best_split`, exact over the
splits the budget allows), so a request whose loss is spread over many layers buys 3-bit keys in twice as many.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvarn.quant.base import TileQuantizer
from kvarn.quant.policy import weighted_error

if TYPE_CHECKING:  # the store (this floor) must not load the preset registry at run time
    from kvarn.presets import Preset


def _trial(q: TileQuantizer, flat: torch.Tensor, w: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """flat [N, G, D] encoded as the cache would (the weight where the quantizer takes one) and decoded in float32:
    (x^ [N, G, D], input finite [N])."""
    packed, finite, _ = q.encode_tiles(flat, w if getattr(q, "takes_weight", False) else None)
    return q.decode(packed, torch.float32), finite


def promotion_gains(tile: torch.Tensor, weight: torch.Tensor | None, low: TileQuantizer,
                    highs: Sequence[TileQuantizer]) -> tuple[float, ...]:
    """tile [B, H, G, D] keys, weight [B, H, D] query energy or None (= 1): err_low - err_high for each of `highs`
    (module docstring)."""
    b, h, g, d = tile.shape
    flat = tile.reshape(b * h, g, d)
    w = None if weight is None else weight.to(flat.device).reshape(b * h, d)

    def err(q: TileQuantizer) -> float:
        x_hat, finite = _trial(q, flat, w)
        keep = finite & torch.isfinite(flat).flatten(1).all(1)  # non-finite tiles stay exact: they cost nothing
        return float(weighted_error(flat[keep], x_hat[keep], None if w is None else w[keep]).sum())

    e_low = err(low)
    return tuple(e_low - err(q) for q in highs)


def promotion_gain(tile: torch.Tensor, weight: torch.Tensor | None, low: TileQuantizer,
                   high: TileQuantizer) -> float:
    """`promotion_gains` for one high quantizer."""
    return promotion_gains(tile, weight, low, (high,))[0]


def output_gains(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, weight: torch.Tensor | None,
                 low: TileQuantizer, highs: Sequence[TileQuantizer], rows: int = 128) -> tuple[float, ...]:
    """The attention-output error each of `highs` removes ("output" rule): q [B, Hq, t, D] the newest queries (the
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
    energy = o.square().sum()

    def err(qz: TileQuantizer) -> torch.Tensor:
        return (out(_trial(qz, flat, w)[0].reshape(b, h, g, d)) - o).square().sum()

    e_low = err(low)
    # relative to the outputs' energy: value scales grow with depth, and an absolute error would rank by them
    return tuple(float(torch.nan_to_num((e_low - err(qz)) / energy, nan=0.0, posinf=0.0, neginf=0.0))
                 for qz in highs)


def output_gain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, weight: torch.Tensor | None,
                low: TileQuantizer, high: TileQuantizer, rows: int = 128) -> float:  # rows: OUTPUT_ROWS
    """`output_gains` for one high quantizer."""
    return output_gains(q, k, v, first, weight, low, (high,), rows)[0]


RULES = ("logit", "output")
PICKS = ("rank", "best")
OUTPUT_ROWS = 128  # newest queries the "output" rule scores with


class KeyAllocation:
    """Which of a cache's quantized layers store keys with `high` or `mid` (shared by the layers of one cache).

    layers     the quantized layers that report (their indices)
    count      how many of them get `high`
    rule       "logit": `promotion_gain` (query-energy-weighted key error); "output": `output_gain` (the attention
               output error on the newest queries; layers whose attention observes no query score by "logit")
    mid        a quantizer between low and high, and mid_count: how many layers get it, the next ones by the same
               ranking (the budget that rounding the `high` layers down leaves; `Preset.mid_layers`)
    pick       "rank": the `count` largest high gains take `high`, the next `mid_count` take `mid`;
               "best": each layer also scores `mid`, and of the `splits` (h, m) the budget allows (`Preset.key_splits`),
               the layers maximizing the summed gains take h x `high` and m x `mid` (`best_split`): 3-bit keys in
               twice the layers where the loss is spread, 4-bit keys where it is concentrated (`count` and
               `mid_count` are then the splits' largest)
    """

    def __init__(self, layers: Sequence[int], count: int, low: TileQuantizer, high: TileQuantizer,
                 rule: str = "output", mid: TileQuantizer | None = None, mid_count: int = 0, pick: str = "rank",
                 splits: Sequence[tuple[int, int]] = ()) -> None:
        if rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
        if pick not in PICKS:
            raise ValueError(f"pick must be one of {PICKS}, got {pick!r}")
        self.rule, self.pick = rule, pick
        if pick == "best":
            if not splits or any(h < 0 or m < 0 or h + m > len(layers) for h, m in splits):
                raise ValueError(f"pick 'best' needs splits (high, mid) of {len(layers)} layers, got {splits}")
            if mid is None and any(m for _, m in splits):
                raise ValueError("splits with mid layers need the mid quantizer")
            count, mid_count = max(h for h, _ in splits), max(m for _, m in splits)  # the most of each width
        elif not 0 <= count <= len(layers) or not 0 <= mid_count <= len(layers) - count:
            raise ValueError(f"cannot promote {count} + {mid_count} of {len(layers)} layers")
        if mid_count and mid is None:
            raise ValueError("mid_count needs the mid quantizer")
        tiles = [q.tile for q in (low, high, mid) if q is not None]
        if len(set(tiles)) > 1:
            raise ValueError(f"the key quantizers (low, high, mid) must share a tile, got {tiles}")
        self.layers, self.count, self.low, self.high = tuple(layers), count, low, high
        self.mid, self.mid_count = mid, mid_count
        self.splits = frozenset(splits) if pick == "best" else frozenset({(count, mid_count)})
        self.scores: dict[int, float] = {}
        self.mid_scores: dict[int, float] = {}  # pick "best": each layer's gain at `mid`
        self.promoted: frozenset[int] | None = None  # None until decided
        self.middle: frozenset[int] = frozenset()  # the layers at `mid`

    @property
    def decided(self) -> bool:
        return self.promoted is not None

    @property
    def scores_mid(self) -> bool:
        """Whether layers report a gain at `mid` too (pick "best")."""
        return self.pick == "best" and self.mid is not None

    def report(self, layer: int, score: float, mid_score: float | None = None) -> None:
        """Layer `layer`'s gain at `high` (and at `mid` under pick "best"; first report counts); decides once every
        layer has reported."""
        if layer not in self.layers:
            raise ValueError(f"layer {layer} is not one of the allocation's layers {self.layers}")
        if self.scores_mid and mid_score is None and layer not in self.scores:
            raise ValueError(f"pick 'best': layer {layer} must report its gain at the mid width too")
        self.scores.setdefault(layer, score)
        if self.scores_mid:
            self.mid_scores.setdefault(layer, float(mid_score))
        if self.promoted is None and len(self.scores) == len(self.layers):
            if self.pick == "best":
                high, mid = best_split(self.layers, self.scores, self.mid_scores, self.splits)
                self.middle, self.promoted = frozenset(mid), frozenset(high)
                return
            ranked = sorted(self.layers, key=lambda i: (-self.scores[i], i))
            self.middle = frozenset(ranked[self.count:self.count + self.mid_count])
            self.promoted = frozenset(ranked[:self.count])

    def decide(self, promoted: Sequence[int], middle: Sequence[int] = ()) -> None:
        """Set the decision (a loaded cache restores its saved one)."""
        chosen = [*promoted, *middle]
        if (any(i not in self.layers for i in chosen) or len(set(chosen)) != len(chosen)
                or (len(promoted), len(middle)) not in self.splits):
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
        self.mid_scores.clear()
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
        if self.pick == "best":
            out.update(pick="best", splits=sorted(map(list, self.splits)),
                       mid_scores={str(i): s for i, s in sorted(self.mid_scores.items())})
        return out


def best_split(layers: Sequence[int], high: Mapping[int, float], mid: Mapping[int, float],
               splits: Iterable[tuple[int, int]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The layers at `high` and at `mid` that maximize the summed gains over the allowed (h, m) splits: a dynamic
    program over the layers in order, state (h, m) -> best total (ties keep the first found: lower layers at the
    lower width). Exact; at most len(layers) x (H + 1) x (M + 1) states."""
    allowed = set(splits)
    h_max, m_max = max(h for h, _ in allowed), max(m for _, m in allowed)
    table: dict[tuple[int, int], tuple[float, tuple[int, ...], tuple[int, ...]]] = {(0, 0): (0.0, (), ())}
    for i in layers:
        nxt = dict(table)  # layer i at the low width; a tie keeps the lower layers already chosen
        for (h, m), (t, hs, ms) in table.items():
            options = []
            if h < h_max:
                options.append(((h + 1, m), (t + high[i], (*hs, i), ms)))
            if m < m_max:
                options.append(((h, m + 1), (t + mid.get(i, 0.0), hs, (*ms, i))))
            for key, val in options:
                if key not in nxt or val[0] > nxt[key][0]:
                    nxt[key] = val
        table = nxt
    best = max((v for k, v in table.items() if k in allowed), key=lambda v: v[0])
    return best[1], best[2]


def preset_allocation(preset: Preset, layers: Sequence[int], head_dim: int,
                      splits: Sequence[tuple[int, int]] | None = None) -> KeyAllocation:
    """A budget preset's `KeyAllocation` over its quantized `layers` at `head_dim`. `splits`: the (high, mid) splits
    the caller's storage can hold (vLLM's page classes: `kvarn.integrations.vllm.budget`); None: every one the budget
    allows (`Preset.key_splits` under pick "best", else its one split)."""
    n = len(layers)
    low, high = preset.quantizers(head_dim)[0], preset.key_high(head_dim)
    mid = None if preset.key_mid is None else preset.key_mid(head_dim)
    rule = str(preset.params.get("rule", "output"))
    if preset.picks_best:
        return KeyAllocation(layers, 0, low, high, rule, mid, 0, "best",
                             preset.key_splits(n, head_dim) if splits is None else splits)
    if splits is None:
        splits = [(preset.promoted_layers(n), preset.mid_layers(n, head_dim))]
    h, m = splits[0] if splits else (0, 0)
    return KeyAllocation(layers, h, low, high, rule, mid, m)
