"""Pieces shared by the baselines: per-token grouped RTN, clipped ranges, working dtypes, index dtypes.

`TokenRTN` quantizes every token of a tile x [N, G, D] on its own (KIVI values, QuaRot keys and values,
PolarQuant values). Arithmetic in float32 (float64 inputs stay float64):

    w = x @ H                                   if rotate (orthonormal Hadamard along D, `ops.hadamard`)
    each token's D channels are cut into D/g groups of g consecutive channels; per group:
        [lo, hi] = [min, max]                                   clip=None (KIVI)
        [lo, hi] = [r * min(min, 0), r * max(max, 0)]           clip=r in (0, 1] (QuaRot's range; values
                                                                outside are clamped to it)
        delta = max((hi - lo) / (2^b - 1), 1e-10)
        q = clamp(round((w - lo) / delta), 0, 2^b - 1)          round half to even (`ops.rtn`)
Stored (scales in `scale_dtype`, fp16 by default):
    codes [N, G, D*b/8] uint8   q packed along the channels (`ops.packing`, low bits first)
    scale [N, G, D/g]           delta
    zero  [N, G, D/g]           lo
Reconstruction: w^ = q * scale + zero, then @ H if rotated (H is its own inverse).
Bits per element: b + 2 * 16 / g.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvarn.ops.hadamard import hadamard_transform
from kvarn.ops.packing import pack_codes, unpack_codes
from kvarn.ops.rtn import check_bits, rtn_quantize
from kvarn.ops.rtn import check_clip as check_clip_share
from kvarn.quant.base import TileQuantizer, check_tiles
from kvarn.quant.tiles import Tiles


@dataclass(frozen=True)
class GroupTiles(Tiles):
    """Per-token RTN in groups (`TokenRTN`): codes [N, G, D*b/8] uint8, scale, zero [N, G, D/group]."""

    codes: torch.Tensor | None
    scale: torch.Tensor | None
    zero: torch.Tensor | None


def work(x: torch.Tensor) -> torch.Tensor:
    """Working precision of the baselines: float32, except float64 stays float64 (for the exact references)."""
    return x if x.dtype == torch.float64 else x.float()


def decode_dtype(t: torch.Tensor) -> torch.dtype:
    """Arithmetic dtype for decoding from a stored field: at least float32 (float64 scales stay float64)."""
    return torch.promote_types(t.dtype, torch.float32)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def index_dtype(n: int) -> torch.dtype:
    """Smallest integer dtype that stores positions 0..n-1 (indices are stored, so they are counted)."""
    if n <= 256:
        return torch.uint8
    return torch.int16 if n <= 32768 else torch.int32


def resolve_group(head_dim: int, group: int | None) -> int:
    """Channels per group: `group` capped at head_dim; when it does not divide head_dim, gcd(head_dim, group)
    (e.g. 16 for D = 80 and g = 32), so every group has the same size."""
    if group is None:
        return head_dim
    if group < 1:
        raise ValueError(f"group must be positive, got {group}")
    g = min(group, head_dim)
    return g if head_dim % g == 0 else math.gcd(head_dim, g)


def check_clip(clip: float | None) -> float | None:
    """None (no clipping) or `ops.rtn.check_clip`'s share."""
    return None if clip is None else check_clip_share(clip)


def clipped_rtn(x: torch.Tensor, bits: int, clip: float | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`ops.rtn.rtn_quantize` per row (last axis); with `clip` = r the range is QuaRot's
    [r * min(min, 0), r * max(max, 0)] and values outside it are clamped. Returns (codes, delta, lo)."""
    if clip is None:
        return rtn_quantize(x, bits)
    lo = x.amin(dim=-1, keepdim=True).clamp_max(0) * clip
    hi = x.amax(dim=-1, keepdim=True).clamp_min(0) * clip
    clamped = torch.minimum(torch.maximum(x, lo), hi)
    # ops.rtn takes its range from the row; appending both ends makes that range exactly [lo, hi]
    q, delta, low = rtn_quantize(torch.cat([clamped, lo, hi], dim=-1), bits)
    return q[..., :-2], delta, low


class TokenRTN(TileQuantizer):
    """Per-token asymmetric RTN in groups of channels, optionally rotated (Hadamard) and clipped (QuaRot)."""

    tiles_type = GroupTiles

    def __init__(self, bits: int, head_dim: int, group: int | None = None, tile: int = 1, rotate: bool = False,
                 clip: float | None = None, scale_dtype: torch.dtype = torch.float16, name: str = "token-rtn") -> None:
        self.bits = check_bits(bits)
        if head_dim < 1 or tile < 1:
            raise ValueError(f"head_dim and tile must be positive, got {head_dim} and {tile}")
        if head_dim * bits % 8:
            raise ValueError(f"{bits}-bit codes of head_dim {head_dim} do not fill whole bytes")
        self.head_dim, self.tile, self.rotate = head_dim, tile, rotate
        self.group = resolve_group(head_dim, group)
        self.clip = check_clip(clip)
        self.scale_dtype, self.name = scale_dtype, name

    def encode(self, x: torch.Tensor) -> GroupTiles:
        check_tiles(x, self.tile, self.head_dim)
        w = work(x)
        if self.rotate:
            w = hadamard_transform(w)
        n, g, d = w.shape
        q, delta, lo = clipped_rtn(w.reshape(n, g, d // self.group, self.group), self.bits, self.clip)
        return GroupTiles(pack_codes(q.reshape(n, g, d), self.bits), delta.squeeze(-1).to(self.scale_dtype),
                          lo.squeeze(-1).to(self.scale_dtype))

    def decode(self, packed: GroupTiles, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        scale, zero = packed.scale, packed.zero
        ft = decode_dtype(scale)
        q = unpack_codes(packed.codes, self.bits)  # [N, G, D]
        n, g, d = q.shape
        x = q.to(ft).reshape(n, g, d // self.group, self.group) * scale.to(ft).unsqueeze(-1) + zero.to(ft).unsqueeze(-1)
        x = x.reshape(n, g, d)
        if self.rotate:
            x = hadamard_transform(x)
        return x.to(dtype)

    def describe(self) -> Mapping[str, object]:
        return {"name": self.name, "tile": self.tile, "bits": self.bits, "axis": "token", "group": self.group,
                "rotate": "hadamard" if self.rotate else "none", "clip": self.clip,
                "scale_dtype": dtype_name(self.scale_dtype)}
