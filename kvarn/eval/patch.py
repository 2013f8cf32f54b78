"""Eval-only mechanism: keep a chosen part of each tile exact (the outlier-replacement experiment).

`PatchedQuantizer` wraps any `TileQuantizer`. At encode time it quantizes the tile x [N, G, D] with the
wrapped quantizer, reconstructs it (x^), ranks the errors inside each tile and stores, besides the
wrapped fields, a mask of the entries to keep exact and their exact values:

    granularity "token":    e[n, g]    = ||x[n, g] - x^[n, g]||^2   (a whole token vector of one KV head)
    granularity "element":  e[n, g, d] = (x[n, g, d] - x^[n, g, d])^2
    worst = the round(fraction * count) largest e of the tile (count = G tokens or G*D elements)
    which "worst": exact on worst;  which "rest": exact everywhere else (the complement)

Decoding returns x^ with the masked entries replaced by x, bit for bit. Ranking is per quantizer tile
(one KV head, G tokens) because the cache quantizes a tile once, when it completes, in cumulative mode the
errors of later tiles do not exist yet. `patched_preset` derives a preset whose key and value quantizers
are wrapped, so the unchanged cache (`KVarNCache`) runs it; only eval uses it, and its byte counts
include the patch (they are not a method's storage).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Literal

import torch

from kvarn.presets import Preset
from kvarn.quant.base import TileQuantizer, check_tiles
from kvarn.quant.tiles import Tiles

Granularity = Literal["token", "element"]
Which = Literal["worst", "rest"]


@dataclasses.dataclass(frozen=True)
class PatchedTiles(Tiles):
    """The wrapped quantizer's tiles (`inner`, fields named "inner.<name>") and the patch: patch_mask [N, G, D] bool,
    patch_values [N, G, D] (x where masked, else 0)."""

    inner: Tiles
    patch_mask: torch.Tensor | None
    patch_values: torch.Tensor | None


class PatchedQuantizer(TileQuantizer):
    """`inner` with the worst (or all but the worst) `fraction` of each tile's errors kept exact."""

    def __init__(self, inner: TileQuantizer, fraction: float, granularity: Granularity = "token",
                 which: Which = "worst") -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction must be in [0, 1], got {fraction}")
        if granularity not in ("token", "element"):
            raise ValueError(f"granularity must be 'token' or 'element', got {granularity!r}")
        if which not in ("worst", "rest"):
            raise ValueError(f"which must be 'worst' or 'rest', got {which!r}")
        self.inner, self.fraction, self.granularity, self.which = inner, fraction, granularity, which
        self.tile = inner.tile
        self.name = f"{inner.name}+exact-{which}-{fraction:g}-{granularity}"

    def selected(self, x: torch.Tensor, xh: torch.Tensor) -> torch.Tensor:
        """bool [N, G, D]: the entries kept exact (x, xh [N, G, D])."""
        err = (x.double() - xh.double()).pow(2)
        if self.granularity == "token":
            err = err.sum(-1)  # [N, G]
        flat = err.flatten(1)  # [N, G] or [N, G*D]
        k = round(self.fraction * flat.shape[1])
        mask = torch.zeros_like(flat, dtype=torch.bool)
        if k:
            mask.scatter_(1, flat.topk(k, dim=1).indices, True)
        if self.which == "rest":
            mask = ~mask
        mask = mask.view(err.shape)
        return (mask.unsqueeze(-1) if self.granularity == "token" else mask).expand_as(x)

    def encode(self, x: torch.Tensor) -> PatchedTiles:
        check_tiles(x, self.tile)
        packed = self.inner.encode(x)
        mask = self.selected(x, self.inner.decode(packed, x.dtype))
        return PatchedTiles(packed, mask.contiguous(), torch.where(mask, x, torch.zeros_like(x)))

    def template(self, head_dim: int) -> PatchedTiles:
        return PatchedTiles(self.inner.template(head_dim), None, None)

    def decode(self, packed: PatchedTiles, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        xh = self.inner.decode(packed.inner, dtype)
        return torch.where(packed.patch_mask, packed.patch_values.to(dtype), xh)

    def describe(self) -> Mapping[str, object]:
        return {**self.inner.describe(), "patch": {"fraction": self.fraction, "granularity": self.granularity,
                                                   "which": self.which}}


def patched_preset(preset: Preset, fraction: float, granularity: Granularity = "token",
                   which: Which = "worst") -> Preset:
    """`preset` with both quantizers wrapped in `PatchedQuantizer` (same tiles, sink and cache policy)."""
    if not preset.quantized:
        raise ValueError(f"preset {preset.name!r} does not quantize; nothing to patch")
    key, value = preset.key, preset.value

    def wrap(factory):
        return lambda d: PatchedQuantizer(factory(d), fraction, granularity, which)

    return dataclasses.replace(preset, name=f"{preset.name}+exact-{which}-{fraction:g}-{granularity}",
                               key=wrap(key), value=wrap(value))
