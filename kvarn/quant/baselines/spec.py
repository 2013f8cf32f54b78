"""What a baseline module exports: its presets as plain data, built from quant-floor types only.

Each baseline module has `PRESETS`, a tuple of `(name, spec factory, aliases)`. A spec is the keyword arguments of
`kvarn.presets.Preset`; the registry (`kvarn.presets.registry`) imports the baselines and turns each spec into a
`Preset`, so the dependency points down: the baselines never import the registry.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypedDict

from kvarn.quant.base import TileQuantizer
from kvarn.quant.cache_policy import CachePolicy


class PresetSpec(TypedDict):
    name: str
    description: str
    key: Callable[[int], TileQuantizer]  # head_dim -> quantizer
    value: Callable[[int], TileQuantizer]
    policy: CachePolicy
    family: str
    k_bits: float
    v_bits: float
    params: Mapping[str, object]  # the builder's parameters, JSON-plain (part of the method's record)
    notes: Mapping[str, str]  # provenance (paper, what is left out): documentation, not the method


PresetEntry = tuple[str, Callable[[], PresetSpec], tuple[str, ...]]  # (name, spec factory, aliases)
