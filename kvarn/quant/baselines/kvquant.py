"""KVQuant-1% (Hooper et al., NeurIPS 2024, arXiv 2401.18079), calibration-free variant: dense-and-sparse RTN.

Kept from KVQuant: keys quantized per channel *before* RoPE (`CachePolicy.key_pre_rope`: the cache undoes RoPE before
storing keys and redoes it after dequantizing), values per token, about 1% of the values of every vector kept
as sparse fp16 outliers with their positions (dense-and-sparse), the first token (attention sink) in fp16.

Per quantization row ("vector") of a tile — keys: one channel over the G = 128 tokens of the tile (rows of the
D x G layout); values: one token over its D channels:
    k = ceil(fraction * row length)          outliers per row (fixed, so the stored arrays keep a tile axis;
                                             fraction 0.01 -> 2 of 128 tokens, 1 of 64 channels)
    z = |x - mean(row)| / std(row)           normalized magnitude; the k largest are the outliers (the row's std
                                             is a common factor, so it ranks like |x - mean(row)|)
    dense row: the outliers replaced by the inliers' minimum, then asymmetric RTN (`ops.rtn`), so the range
               [lo, hi] is that of the inliers only
Stored per tile (scales fp16):
    codes [N, R, C*b/8], scale [N, R], zero [N, R]   the dense part (outlier positions hold code 0, counted)
    outliers [N, R, k] fp16, outlier_index [N, R, k] uint8 (int16 for rows longer than 256)
Reconstruction: x^ = q * scale + zero, then the outliers written back at their positions.
Bits per element: b + 32/C + k * (16 + 8) / C  (C = row length), e.g. k2v2 at D = 128, G = 128: 2.625.

Left out (they need calibration data): KVQuant's learned non-uniform codebook (nuqX, sensitivity-weighted
k-means over calibration activations — here codes are uniform integers), its offline per-channel key scales and
outlier thresholds (here both come from the tile itself: per-channel min/max over the G tokens and a fixed
count of outliers per row instead of a calibrated threshold), Q-Norm, and the CSR/CSC sparse layout (here a
fixed k per row with 1-byte positions, which is what the byte count reports).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from kvarn.ops.packing import pack_codes, unpack_codes
from kvarn.ops.rtn import check_bits, rtn_quantize
from kvarn.quant.base import TileQuantizer, check_tiles
from kvarn.quant.baselines.common import decode_dtype, dtype_name, index_dtype, work
from kvarn.quant.baselines.spec import PresetEntry, PresetSpec
from kvarn.quant.cache_policy import CachePolicy
from kvarn.quant.tiles import Tiles


def outlier_count(fraction: float, n: int) -> int:
    """Outliers per row of n values: ceil(fraction * n), at least one value left dense."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"outlier fraction must be in (0, 1), got {fraction}")
    k = math.ceil(fraction * n - 1e-9)
    if k >= n:
        raise ValueError(f"outlier fraction {fraction} leaves no dense values in rows of {n}")
    return k


@dataclass(frozen=True)
class DenseSparseTiles(Tiles):
    """Dense-and-sparse rows (`DenseSparseRTN`): codes [N, R, C*b/8] uint8, scale, zero [N, R], outliers [N, R, k],
    outlier_index [N, R, k] (their columns, ascending)."""

    codes: torch.Tensor | None
    scale: torch.Tensor | None
    zero: torch.Tensor | None
    outliers: torch.Tensor | None
    outlier_index: torch.Tensor | None


class DenseSparseRTN(TileQuantizer):
    """RTN per row with k sparse fp16 outliers per row; `axis` picks the rows (keys: channel, values: token)."""

    tiles_type = DenseSparseTiles

    def __init__(self, bits: int, head_dim: int, axis: Literal["channel", "token"], tile: int,
                 fraction: float = 0.01, scale_dtype: torch.dtype = torch.float16,
                 outlier_dtype: torch.dtype = torch.float16) -> None:
        self.bits = check_bits(bits)
        if axis not in ("channel", "token"):
            raise ValueError(f"axis must be 'channel' or 'token', got {axis!r}")
        self.axis, self.head_dim, self.tile, self.fraction = axis, head_dim, tile, fraction
        self.row_len = tile if axis == "channel" else head_dim
        if self.row_len * bits % 8:
            raise ValueError(f"rows of {self.row_len} {bits}-bit codes do not fill whole bytes")
        self.k = outlier_count(fraction, self.row_len)
        self.scale_dtype, self.outlier_dtype = scale_dtype, outlier_dtype
        self.name = f"dense-sparse-rtn{bits}-{axis}"

    def _rows(self, w: torch.Tensor) -> torch.Tensor:
        return w.transpose(-1, -2) if self.axis == "channel" else w

    def encode(self, x: torch.Tensor) -> DenseSparseTiles:
        check_tiles(x, self.tile, self.head_dim)
        rows = self._rows(work(x))  # [N, R, C]
        dev = (rows - rows.mean(dim=-1, keepdim=True)).abs()
        idx = dev.topk(self.k, dim=-1).indices.sort(dim=-1).values  # [N, R, k], positions ascending
        outlier = torch.zeros_like(rows, dtype=torch.bool).scatter_(-1, idx, True)
        inlier_min = rows.masked_fill(outlier, float("inf")).amin(dim=-1, keepdim=True)
        q, delta, lo = rtn_quantize(torch.where(outlier, inlier_min, rows), self.bits)
        return DenseSparseTiles(pack_codes(q, self.bits), delta.squeeze(-1).to(self.scale_dtype),
                                lo.squeeze(-1).to(self.scale_dtype), rows.gather(-1, idx).to(self.outlier_dtype),
                                idx.to(index_dtype(self.row_len)))

    def decode(self, packed: DenseSparseTiles, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        scale = packed.scale
        ft = decode_dtype(scale)
        q = unpack_codes(packed.codes, self.bits).to(ft)  # [N, R, C]
        rows = q * scale.to(ft).unsqueeze(-1) + packed.zero.to(ft).unsqueeze(-1)
        rows.scatter_(-1, packed.outlier_index.long(), packed.outliers.to(ft))
        return self._rows(rows).to(dtype)

    def describe(self) -> Mapping[str, object]:
        return {"name": self.name, "tile": self.tile, "bits": self.bits, "axis": self.axis,
                "outlier_fraction": self.fraction, "outliers_per_row": self.k,
                "effective_outlier_fraction": self.k / self.row_len, "scale_dtype": dtype_name(self.scale_dtype),
                "outlier_dtype": dtype_name(self.outlier_dtype)}


def kvquant_preset(k_bits: int, v_bits: int, fraction: float = 0.01, tile: int = 128, sink: int = 1,
                   name: str | None = None) -> PresetSpec:
    pct = f"{fraction * 100:g}pct"
    return PresetSpec(
        name=name or f"kvquant-k{k_bits}v{v_bits}-{pct}",
        description=f"KVQuant-{fraction * 100:g}% (calibration-free): pre-RoPE per-channel keys, per-token values, "
                    f"dense-and-sparse fp16 outliers",
        key=lambda d: DenseSparseRTN(k_bits, d, "channel", tile, fraction),
        value=lambda d: DenseSparseRTN(v_bits, d, "token", 1, fraction),
        policy=CachePolicy(tile=tile, sink=sink, value_window="block", key_pre_rope=True), family="kvquant",
        k_bits=k_bits, v_bits=v_bits, params={"outlier_fraction": fraction},
        notes={"paper": "arXiv:2401.18079",
               "left_out": "learned non-uniform codebook, calibrated scales/thresholds, Q-Norm"},
    )


PRESETS: tuple[PresetEntry, ...] = (
    ("kvquant-k2v2-1pct", lambda: kvquant_preset(2, 2), ("kvquant-1pct", "kvquant")),
)
