"""kvarn: calibration-free 2/4-bit KV-cache quantization with real packed storage."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# the kernels register behind the op seats whichever floor a user enters through (nothing is built on import)
import kvarn.kernels  # noqa: F401

if TYPE_CHECKING:
    from kvarn.presets import DEFAULT_PRESET, Preset, get_preset, preset_names, register_preset

__all__ = ["DEFAULT_PRESET", "Preset", "get_preset", "preset_names", "register_preset"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # the preset registry loads on first use: importing a low floor (kvarn.quant, kvarn.cache) must not load it
    if name in __all__:
        return getattr(importlib.import_module("kvarn.presets"), name)
    raise AttributeError(f"module 'kvarn' has no attribute {name!r}")
