"""kvarn: calibration-free 2/4-bit KV-cache quantization with real packed storage."""

from kvarn.presets import DEFAULT_PRESET, Preset, get_preset, preset_names, register_preset

__all__ = ["DEFAULT_PRESET", "Preset", "get_preset", "preset_names", "register_preset"]
__version__ = "0.1.0"
