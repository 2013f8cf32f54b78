"""PolarQuant (Wu et al., NeurIPS 2025, arXiv 2502.00527): keys as (radius, angle) per RoPE pair.

RoPE rotates channel d together with channel d + D/2 (the transformers `rotate_half` pairing), so each key
(after RoPE) is D/2 two-dimensional sub-vectors (x_d, x_{d+D/2}), d < D/2, written in polar form:

    rho = sqrt(x_d^2 + x_{d+D/2}^2),  phi = atan2(x_{d+D/2}, x_d) mapped to [0, 2 pi)

Per pair and per tile of G = 128 tokens (PolarQuant's group size), rho and phi are quantized asymmetrically by
binning, as in the published code (`quantize_and_pack_nbit`): for v in (rho, phi) with b_v bits,

    s = max((max(v) - min(v)) / 2^b_v, 1e-10),  q = clamp(floor((v - min(v)) / s), 0, 2^b_v - 1)
    v^ = (q + 1/2) s + min(v)                    (the centre of the bin)

and the key comes back as x^_d = rho^ cos(phi^), x^_{d+D/2} = rho^ sin(phi^).

Bit split: a b-bit key spends 2b bits per pair, split evenly, radius b bits and angle b bits ("PolarQuant 44"
for 4-bit keys, "33" for 3-bit, as in the paper's tables). Stored per tile (scales fp16):
    radius_codes [N, D/2, G*b_r/8], angle_codes [N, D/2, G*b_t/8],
    radius_scale, radius_min, angle_scale, angle_min [N, D/2]
Bits per element: (b_r + b_t)/2 + 4*16 / (2 G) = 4.25 for r4/t4 at G = 128 (the paper's "4.25").
Values: per-token asymmetric RTN over head_dim (`TokenRTN`), 2 bits (the KVarN paper's 4/2 row; PolarQuant's
own experiments keep values in fp16). Keys wait for a complete tile of G tokens (PolarQuant's residual of 128);
values use the same block flush; no sink.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvarn.ops.packing import pack_codes, unpack_codes
from kvarn.ops.rtn import RANGE_GUARD, check_bits
from kvarn.quant.base import TileQuantizer, check_tiles
from kvarn.quant.baselines.common import TokenRTN, decode_dtype, dtype_name, work
from kvarn.quant.baselines.spec import PresetEntry, PresetSpec
from kvarn.quant.cache_policy import CachePolicy
from kvarn.quant.tiles import Tiles


def bin_quantize(v: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Binning along the last axis: (codes uint8, scale [..., 1], min [..., 1]); decode at bin centres."""
    lo = v.amin(dim=-1, keepdim=True)
    scale = ((v.amax(dim=-1, keepdim=True) - lo) / (1 << bits)).clamp_min(RANGE_GUARD)
    q = torch.floor((v - lo) / scale).clamp_(0, (1 << bits) - 1)
    return q.to(torch.uint8), scale, lo


def bin_dequantize(q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    return (q.to(scale.dtype) + 0.5) * scale + lo


@dataclass(frozen=True)
class PolarTiles(Tiles):
    """Polar key tiles (`PolarKeyQuantizer`): radius and angle codes [N, D/2, G*b/8] uint8, their scale and min
    [N, D/2]."""

    radius_codes: torch.Tensor | None
    angle_codes: torch.Tensor | None
    radius_scale: torch.Tensor | None
    radius_min: torch.Tensor | None
    angle_scale: torch.Tensor | None
    angle_min: torch.Tensor | None


class PolarKeyQuantizer(TileQuantizer):
    """Keys in polar form per RoPE pair (d, d + D/2): radius and angle binned per pair over a G-token tile."""

    tiles_type = PolarTiles

    def __init__(self, head_dim: int, radius_bits: int = 4, angle_bits: int = 4, tile: int = 128,
                 scale_dtype: torch.dtype = torch.float16) -> None:
        if head_dim % 2:
            raise ValueError(f"PolarQuant pairs channels (d, d + D/2); head_dim must be even, got {head_dim}")
        self.radius_bits, self.angle_bits = check_bits(radius_bits), check_bits(angle_bits)
        for b in (radius_bits, angle_bits):
            if tile * b % 8:
                raise ValueError(f"tiles of {tile} tokens of {b}-bit codes do not fill whole bytes")
        self.head_dim, self.tile, self.scale_dtype = head_dim, tile, scale_dtype
        self.name = f"polar-r{radius_bits}t{angle_bits}"

    def encode(self, x: torch.Tensor) -> PolarTiles:
        check_tiles(x, self.tile, self.head_dim)
        w = work(x)
        a, b = w.chunk(2, dim=-1)  # [N, G, D/2] each: the rotate_half pairs
        rho = torch.hypot(a, b).transpose(-1, -2)  # [N, D/2, G]
        phi = torch.atan2(b, a)
        phi = torch.where(phi < 0, phi + 2 * math.pi, phi).transpose(-1, -2)
        sd = self.scale_dtype
        qr, sr, lr = bin_quantize(rho, self.radius_bits)
        qt, st, lt = bin_quantize(phi, self.angle_bits)
        return PolarTiles(pack_codes(qr, self.radius_bits), pack_codes(qt, self.angle_bits), sr.squeeze(-1).to(sd),
                          lr.squeeze(-1).to(sd), st.squeeze(-1).to(sd), lt.squeeze(-1).to(sd))

    def decode(self, packed: PolarTiles, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        p = packed
        ft = decode_dtype(p.radius_scale)

        def field(t: torch.Tensor) -> torch.Tensor:
            return t.to(ft).unsqueeze(-1)

        rho = bin_dequantize(unpack_codes(p.radius_codes, self.radius_bits), field(p.radius_scale),
                             field(p.radius_min))  # [N, D/2, G]
        phi = bin_dequantize(unpack_codes(p.angle_codes, self.angle_bits), field(p.angle_scale),
                             field(p.angle_min))
        return torch.cat([rho * phi.cos(), rho * phi.sin()], dim=-2).transpose(-1, -2).to(dtype)

    def describe(self) -> Mapping[str, object]:
        return {"name": self.name, "tile": self.tile, "radius_bits": self.radius_bits, "angle_bits": self.angle_bits,
                "key_bits": (self.radius_bits + self.angle_bits) / 2, "pairing": "rotate_half (d, d + D/2)",
                "scale_dtype": dtype_name(self.scale_dtype)}


def polarquant_preset(k_bits: int = 4, v_bits: int = 2, tile: int = 128, name: str | None = None) -> PresetSpec:
    return PresetSpec(
        name=name or f"polarquant-k{k_bits}v{v_bits}",
        description=f"PolarQuant: keys as radius ({k_bits} bits) and angle ({k_bits} bits) per RoPE pair, "
                    f"per-token {v_bits}-bit values",
        key=lambda d: PolarKeyQuantizer(d, k_bits, k_bits, tile),
        value=lambda d: TokenRTN(v_bits, d, tile=1, name=f"rtn-v{v_bits}"),
        policy=CachePolicy(tile=tile, sink=0, value_window="block"), family="polarquant", k_bits=k_bits,
        v_bits=v_bits, params={"radius_bits": k_bits, "angle_bits": k_bits}, notes={"paper": "arXiv:2502.00527"},
    )


PRESETS: tuple[PresetEntry, ...] = (("polarquant-k4v2", polarquant_preset, ("polarquant",)),)
