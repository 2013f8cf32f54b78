"""Fused kernels over the packed cache. `decode_attention` is the CPU decode attention (kvarn.kernels.cpu.decode)."""

from __future__ import annotations

from kvarn.kernels.cpu.decode import PackedTiles, available, decode_attention, decode_partial

__all__ = ["PackedTiles", "available", "decode_attention", "decode_partial"]
