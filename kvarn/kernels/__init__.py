"""Fused kernels over the packed cache, registered behind the op seats (`kvarn.ops.seats`) on import.
`decode_attention` is the packed-decode seat's typed wrapper (kvarn.attention.launch)."""

from __future__ import annotations

from kvarn.attention.launch import PackedTiles, decode_attention, decode_partial
from kvarn.kernels.cpu import register as _cpu  # noqa: F401 (registers the C++ kernels for CPU)
from kvarn.kernels.cpu.decode import available
from kvarn.kernels.triton import register as _cuda  # noqa: F401 (registers the Triton decode for CUDA; lazy import)

__all__ = ["PackedTiles", "available", "decode_attention", "decode_partial"]
