"""Fused kernels over the packed cache, registered behind the op seats (`kvarn.ops.seats`) on import.
`decode_attention` is the CPU decode attention (kvarn.kernels.cpu.decode)."""

from __future__ import annotations

from kvarn.kernels.cpu import register as _cpu  # noqa: F401 (registers the C++ kernels for CPU)
from kvarn.kernels.cpu.decode import PackedTiles, available, decode_attention, decode_partial
from kvarn.kernels.triton import register as _cuda  # noqa: F401 (registers the Triton decode for CUDA; lazy import)

__all__ = ["PackedTiles", "available", "decode_attention", "decode_partial"]
