"""The integer codes that op seats and kernels receive instead of names: the rotation mode and the scale dtypes."""

from __future__ import annotations

from enum import IntEnum

import torch


class Rotation(IntEnum):
    """How a tile's basis is chosen: the codes every kernel and saved layout reads (`rotate=` of AffineConfig)."""

    NONE = 0  # plain basis
    HADAMARD = 1  # every tile rotated by H
    AUTO = 2  # per tile, a stored uint8 flag (1 = rotated)

    @classmethod
    def of(cls, name: str) -> Rotation:
        """"none" | "hadamard" | "auto" -> its code."""
        try:
            return cls[name.upper()]
        except KeyError:
            raise ValueError(f"rotate must be one of {[r.name.lower() for r in cls]}, got {name!r}") from None



# scale dtype -> code (kernels/cpu store.cpp, decode.cpp): the dtypes a stored scale may have
DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 3}
CODE_DTYPES: dict[int, torch.dtype] = {v: k for k, v in DTYPE_CODES.items()}
