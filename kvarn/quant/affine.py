"""The KVarN family: optional Hadamard rotation, optional VarN, asymmetric RTN per row, folded scales.

Per tile x [G, D] (token-major), in float32:
    w = x @ H                      if the tile is rotated (H orthonormal, `ops.hadamard`)
    X = w^T  [D, G] for keys (rows = channels)  |  X = w [G, D] for values (rows = tokens)
    B, s_c, s_r = varn(X)          if VarN, else B = X, s_c = s_r = 1
    q, delta, lo = rtn(B) per row
Stored (scales in `scale_dtype`, fp16 by default):
    codes     [R, C*b/8] uint8   q packed along the columns
    row_scale [R]  a = s_r * delta
    row_zero  [R]  z = s_r * lo
    col_scale [C]  t = s_c          (only with VarN)
    rotated   []   uint8 flag       (only when the rotation is chosen per tile, rotate="auto")
Reconstruction: X^[r, c] = (q[r, c] * a_r + z_r) * t_c, transposed back, then @ H where rotated.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from kvarn.ops.hadamard import hadamard_transform
from kvarn.ops.packing import pack_codes, unpack_codes
from kvarn.ops.rtn import check_bits, rtn_quantize
from kvarn.ops.varn import DEFAULT_ITERS, varn
from kvarn.quant.base import Packed, TileQuantizer, check_tiles

Axis = Literal["channel", "token"]
Rotate = Literal["none", "hadamard", "auto"]

# Chooses, per tile, whether the rotated encoding is kept: (x [N,G,D], rotated x^, plain x^) -> bool [N].
RotationPolicy = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def channel_normalized_error(x: torch.Tensor, x_rot: torch.Tensor, x_plain: torch.Tensor) -> torch.Tensor:
    """Default auto policy: keep the rotation where it gives the lower squared error with each channel
    normalized by its std over the tile. Channels of low variance carry as much logit information as
    the few high-variance ones, which is what a rotation destroys on Qwen2-like keys."""
    w = x.float().var(dim=-2, keepdim=True).clamp_min(1e-12).reciprocal()
    e_rot = ((x_rot.float() - x.float()) ** 2 * w).sum(dim=(-1, -2))
    e_plain = ((x_plain.float() - x.float()) ** 2 * w).sum(dim=(-1, -2))
    return e_rot < e_plain


@dataclass(frozen=True)
class AffineConfig:
    bits: int = 2
    axis: Axis = "channel"
    rotate: Rotate = "hadamard"
    varn: bool = True
    varn_iters: int = DEFAULT_ITERS
    tile: int = 128
    scale_dtype: torch.dtype = torch.float16


class AffineQuantizer(TileQuantizer):
    """RTN per row with optional rotation and VarN; `axis` picks the rows (keys: channel, values: token)."""

    def __init__(self, config: AffineConfig, policy: RotationPolicy = channel_normalized_error) -> None:
        check_bits(config.bits)
        if config.axis not in ("channel", "token"):
            raise ValueError(f"axis must be 'channel' or 'token', got {config.axis!r}")
        if config.rotate not in ("none", "hadamard", "auto"):
            raise ValueError(f"rotate must be 'none', 'hadamard' or 'auto', got {config.rotate!r}")
        self.config = config
        self.tile = config.tile
        self.policy = policy
        parts = ["rot" if config.rotate == "hadamard" else config.rotate if config.rotate == "auto" else "",
                 "varn" if config.varn else "", f"rtn{config.bits}", config.axis]
        self.name = "-".join(p for p in parts if p)

    # layout helpers: token-major [N, G, D] <-> rows x cols
    def _to_rows(self, w: torch.Tensor) -> torch.Tensor:
        return w.transpose(-1, -2) if self.config.axis == "channel" else w

    def _from_rows(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(-1, -2) if self.config.axis == "channel" else x

    def _encode_rows(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        c = self.config
        if c.varn:
            b, s_col, s_row = varn(x, c.varn_iters)
        else:
            b, s_col, s_row = x, None, None
        q, delta, lo = rtn_quantize(b, c.bits)
        delta, lo = delta.squeeze(-1), lo.squeeze(-1)
        if s_row is not None:
            delta, lo = delta * s_row, lo * s_row
        out = {"codes": pack_codes(q, c.bits), "row_scale": delta.to(c.scale_dtype),
               "row_zero": lo.to(c.scale_dtype)}
        if s_col is not None:
            out["col_scale"] = s_col.to(c.scale_dtype)
        return out

    def _decode_rows(self, p: Packed) -> torch.Tensor:
        q = unpack_codes(p["codes"], self.config.bits).float()
        x = q * p["row_scale"].float().unsqueeze(-1) + p["row_zero"].float().unsqueeze(-1)
        col = p.get("col_scale")
        return x * col.float().unsqueeze(-2) if col is not None else x

    def encode(self, x: torch.Tensor) -> Packed:
        check_tiles(x, self.tile)
        w = x.float()
        if self.config.rotate == "none":
            return Packed(self._encode_rows(self._to_rows(w)))
        rot = self._encode_rows(self._to_rows(hadamard_transform(w)))
        if self.config.rotate == "hadamard":
            return Packed(rot)
        plain = self._encode_rows(self._to_rows(w))
        x_rot = hadamard_transform(self._from_rows(self._decode_rows(Packed(rot))))
        x_plain = self._from_rows(self._decode_rows(Packed(plain)))
        keep = self.policy(w, x_rot, x_plain)
        fields = {k: torch.where(keep.view(-1, *[1] * (v.dim() - 1)), v, plain[k]) for k, v in rot.items()}
        fields["rotated"] = keep.to(torch.uint8)
        return Packed(fields)

    def rotated_mask(self, packed: Packed) -> torch.Tensor | None:
        """[N] bool of rotated tiles, or None when all tiles share the configured rotation."""
        flag = packed.get("rotated")
        return flag.bool() if flag is not None else None

    def decode(self, packed: Packed, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        x = self._from_rows(self._decode_rows(packed))
        if self.config.rotate == "hadamard":
            x = hadamard_transform(x)
        elif self.config.rotate == "auto":
            rot = packed["rotated"].bool()
            if rot.any():
                x = torch.where(rot.view(-1, 1, 1), hadamard_transform(x), x)
        return x.to(dtype)

    def describe(self) -> Mapping[str, object]:
        c = self.config
        return {"name": self.name, "tile": c.tile, "bits": c.bits, "axis": c.axis, "rotate": c.rotate,
                "varn": c.varn, "varn_iters": c.varn_iters, "scale_dtype": str(c.scale_dtype).removeprefix("torch.")}
