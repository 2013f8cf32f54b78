"""Kitty (Xia et al., 2025, arXiv 2511.18643): KIVI layout with a per-tile channel-wise precision boost on keys.

Keys, per tile of G tokens (rows = channels, as KIVI): the k = floor(ratio * D) channels with the largest
mean |K| over the tile's tokens (Kitty's magnitude-based selection, `int(D * ratio)`; ratio 0.1 -> 6 of 64,
12 of 128) are quantized with b_hi = 4 bits, the others with b = 2 bits; both per channel, asymmetric RTN
(`ops.rtn`) with fp16 scale and min per channel. Values: KIVI's per-token RTN in groups of G channels.

Stored per key tile, channels split into the low group (ascending channel order) and the promoted group
(ascending):
    low_codes [N, D-k, G*b/8], low_scale, low_zero [N, D-k]
    high_codes [N, k, G*b_hi/8], high_scale, high_zero [N, k]
    channels [N, k] uint8   which channels were promoted (counted)
Bits per key element: b + k (b_hi - b) / D + 32/G + 8k/(D G)  (k2 at D = G = 128: 2.4434).

Cache policy of the released Kitty system: pages of G = 128 tokens (keys flushed per page), the first 32
tokens kept in full precision, values in a sliding window of 128 full-precision tokens (`kitty`).
`kitty-g32` is the same with KIVI's G = 32 and no sink.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvarn.ops.packing import pack_codes, unpack_codes
from kvarn.ops.rtn import check_bits, rtn_quantize
from kvarn.quant.base import TileQuantizer, check_tiles
from kvarn.quant.baselines.common import decode_dtype, dtype_name, index_dtype, work
from kvarn.quant.baselines.kivi import RESIDUAL, kivi_value
from kvarn.quant.baselines.spec import PresetEntry, PresetSpec
from kvarn.quant.cache_policy import CachePolicy
from kvarn.quant.tiles import Tiles


def promoted_count(head_dim: int, ratio: float) -> int:
    """Kitty's count of promoted channels: int(D * ratio + 1e-6)."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"promote ratio must be in [0, 1], got {ratio}")
    return int(head_dim * ratio + 1e-6)


@dataclass(frozen=True)
class KittyTiles(Tiles):
    """Kitty key tiles (`KittyKeyQuantizer`): promoted channels [N, k]; per part (low: D - k channels at `bits`, high:
    k channels at `high_bits`) codes [N, rows, G*b/8] uint8, scale, zero [N, rows]."""

    channels: torch.Tensor | None
    low_codes: torch.Tensor | None
    low_scale: torch.Tensor | None
    low_zero: torch.Tensor | None
    high_codes: torch.Tensor | None
    high_scale: torch.Tensor | None
    high_zero: torch.Tensor | None


class KittyKeyQuantizer(TileQuantizer):
    """Per-channel key RTN over G-token tiles; the top-k channels by mean |K| of each tile get `high_bits`."""

    tiles_type = KittyTiles

    def __init__(self, head_dim: int, bits: int = 2, high_bits: int = 4, ratio: float = 0.1, tile: int = 128,
                 scale_dtype: torch.dtype = torch.float16) -> None:
        self.bits, self.high_bits = check_bits(bits), check_bits(high_bits)
        for b in (bits, high_bits):
            if tile * b % 8:
                raise ValueError(f"tiles of {tile} tokens of {b}-bit codes do not fill whole bytes")
        self.k = promoted_count(head_dim, ratio)
        self.head_dim, self.ratio, self.tile, self.scale_dtype = head_dim, ratio, tile, scale_dtype
        self.name = f"kitty-k{bits}+{high_bits}"

    def _order(self, promoted: torch.Tensor) -> torch.Tensor:
        """[N, D] channel order: low channels ascending, then promoted ones ascending (`promoted`: [N, k])."""
        n = promoted.shape[0]
        mask = torch.zeros(n, self.head_dim, dtype=torch.uint8, device=promoted.device)
        mask.scatter_(1, promoted.long(), 1)
        return torch.sort(mask, dim=1, stable=True).indices

    def encode(self, x: torch.Tensor) -> KittyTiles:
        check_tiles(x, self.tile, self.head_dim)
        rows = work(x).transpose(-1, -2)  # [N, D, G]
        promoted = rows.abs().mean(dim=-1).topk(self.k, dim=-1).indices.sort(dim=-1).values  # [N, k]
        order = self._order(promoted)
        rows = rows.gather(1, order.unsqueeze(-1).expand_as(rows))
        low, high = rows[:, : self.head_dim - self.k], rows[:, self.head_dim - self.k:]
        out = [promoted.to(index_dtype(self.head_dim))]
        for part, bits in ((low, self.bits), (high, self.high_bits)):
            q, delta, lo = rtn_quantize(part, bits)
            out += [pack_codes(q, bits), delta.squeeze(-1).to(self.scale_dtype), lo.squeeze(-1).to(self.scale_dtype)]
        return KittyTiles(*out)

    def decode(self, packed: KittyTiles, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        p = packed
        ft = decode_dtype(p.low_scale)
        parts = []
        for bits, codes, scale, zero in ((self.bits, p.low_codes, p.low_scale, p.low_zero),
                                         (self.high_bits, p.high_codes, p.high_scale, p.high_zero)):
            q = unpack_codes(codes, bits).to(ft)
            parts.append(q * scale.to(ft).unsqueeze(-1) + zero.to(ft).unsqueeze(-1))
        ordered = torch.cat(parts, dim=1)  # [N, D, G] in the stored channel order
        order = self._order(p.channels)
        rows = torch.empty_like(ordered).scatter_(1, order.unsqueeze(-1).expand_as(ordered), ordered)
        return rows.transpose(-1, -2).to(dtype)

    def describe(self) -> Mapping[str, object]:
        return {"name": self.name, "tile": self.tile, "bits": self.bits, "high_bits": self.high_bits,
                "promote_ratio": self.ratio, "promoted_channels": self.k, "selection": "top mean |K| per tile",
                "axis": "channel", "scale_dtype": dtype_name(self.scale_dtype)}


def kitty_preset(group: int = 128, sink: int = 32, ratio: float = 0.1, k_bits: int = 2, v_bits: int = 2,
                 high_bits: int = 4, residual: int = RESIDUAL, name: str | None = None) -> PresetSpec:
    return PresetSpec(
        name=name or f"kitty-k{k_bits}v{v_bits}-g{group}",
        description=f"Kitty: KIVI layout, top {ratio:.0%} key channels per tile at {high_bits} bits, sink {sink}",
        key=lambda d: KittyKeyQuantizer(d, k_bits, high_bits, ratio, group),
        value=lambda d: kivi_value(v_bits, d, group),
        policy=CachePolicy(tile=residual, sink=sink, value_window="sliding"), family="kitty", k_bits=k_bits,
        v_bits=v_bits, params={"group": group, "residual": residual, "promote_ratio": ratio, "high_bits": high_bits},
        notes={"paper": "arXiv:2511.18643"},
    )


PRESETS: tuple[PresetEntry, ...] = (
    ("kitty-k2v2-g128", kitty_preset, ("kitty",)),
    ("kitty-k2v2-g32", lambda: kitty_preset(group=32, sink=0), ("kitty-g32",)),
)
