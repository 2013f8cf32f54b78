"""kvarn: calibration-free 2/4-bit KV-cache quantization with real packed storage."""

import kvarn.kernels  # noqa: F401 (registers the kernels behind the op seats; nothing is built on import)
from kvarn.presets import DEFAULT_PRESET, Preset, get_preset, preset_names, register_preset

__all__ = ["DEFAULT_PRESET", "Preset", "get_preset", "preset_names", "register_preset"]
__version__ = "0.1.0"
