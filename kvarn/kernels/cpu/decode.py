"""The C++ decode kernel (decode.cpp) behind the packed-decode op seat for CPU tensors (`kvarn.kernels.cpu.register`).
Its typed launch wrapper, shared by every caller and device, is `kvarn.attention.launch`."""

from __future__ import annotations

from kvarn.kernels.cpu.build import load


def available() -> bool:
    """Whether the extension is built and loaded (builds it on first call; warns once when it cannot)."""
    return load() is not None
