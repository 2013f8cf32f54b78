"""`CachePolicy`: how the cache holds K/V around a method's quantizers (which tokens stay exact, when tiles flush).

    tile          tokens the cache hands to the quantizers at once; a multiple of their own tiles
    sink          first tokens kept in full precision for good
    value_window  "block": values wait in the full-precision tail until their block of `tile` completes;
                  "sliding": the newest `tile` values stay in full precision, older ones are quantized
                  (KIVI's residual), one quantizer tile at a time
    fp_layers     (first, last): layers kept entirely in full precision (TurboQuant's setup)
    key_pre_rope  keys are quantized before RoPE (KVQuant); the cache undoes/redoes RoPE around it
    version       the layout of this record (`VERSION`); `from_dict` refuses any other

Where it lives: the quant floor, although it is the cache's policy. Three floors state or read it: the baselines
(quant) export theirs (KIVI's sliding value window, TurboQuant's fp layers, KVQuant's pre-RoPE keys), the preset
registry (presets) pairs it with a method, and the store (cache) follows it. The lowest of them is the only place
all three may import without an upward edge. `kvarn.quant.policy` is another policy: the per-tile rotation choice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

ValueWindow = Literal["block", "sliding"]
VALUE_WINDOWS = ("block", "sliding")
VERSION = 1


def _int(name: str, x: object, low: int) -> None:
    if isinstance(x, bool) or not isinstance(x, int) or x < low:
        raise ValueError(f"CachePolicy.{name} must be an integer >= {low}, got {x!r}")


@dataclass(frozen=True)
class CachePolicy:
    """The cache policy of a preset (module docstring). Frozen; `to_dict`/`from_dict` round-trip it exactly."""

    tile: int = 128
    sink: int = 128
    value_window: ValueWindow = "block"
    fp_layers: tuple[int, int] = (0, 0)
    key_pre_rope: bool = False
    version: int = VERSION

    def __post_init__(self) -> None:
        _int("tile", self.tile, 1)
        _int("sink", self.sink, 0)
        if self.value_window not in VALUE_WINDOWS:
            raise ValueError(f"CachePolicy.value_window must be one of {VALUE_WINDOWS}, got {self.value_window!r}")
        if not isinstance(self.fp_layers, (tuple, list)) or len(self.fp_layers) != 2:
            raise ValueError(f"CachePolicy.fp_layers must be a pair (first, last), got {self.fp_layers!r}")
        for n in self.fp_layers:
            _int("fp_layers", n, 0)
        object.__setattr__(self, "fp_layers", tuple(self.fp_layers))  # JSON lists and tuples compare the same
        if not isinstance(self.key_pre_rope, bool):
            raise ValueError(f"CachePolicy.key_pre_rope must be a bool, got {self.key_pre_rope!r}")
        if self.version != VERSION:
            raise ValueError(f"CachePolicy.version {self.version!r} is not one this kvarn reads (it reads {VERSION})")

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-plain (fp_layers as a list)."""
        return {**dataclasses.asdict(self), "fp_layers": list(self.fp_layers)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CachePolicy:
        """The policy `to_dict` wrote; refuses a missing or unknown field by name (no silent defaults)."""
        if not isinstance(d, Mapping):
            raise ValueError(f"a CachePolicy record must be a mapping, got {type(d).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in d if k not in names]
        if unknown:
            raise ValueError(f"CachePolicy record has unknown field {unknown[0]!r} (fields: {', '.join(names)})")
        missing = [k for k in names if k not in d]
        if missing:
            raise ValueError(f"CachePolicy record is missing field {missing[0]!r} (fields: {', '.join(names)})")
        return cls(**d)
