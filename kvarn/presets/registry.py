"""The preset registry: names (and aliases) -> factories of `Preset`.

It imports what it registers, downward: the KVarN family (`kvarn.presets.family`) and the baselines' exported specs
(`kvarn.quant.baselines.PRESETS`). Nothing below imports this module; `register_preset` adds a user's own.
"""

from __future__ import annotations

from collections.abc import Callable

from kvarn.presets.family import PRESETS as FAMILY_PRESETS
from kvarn.presets.preset import Preset
from kvarn.quant.baselines import PRESETS as BASELINE_PRESETS
from kvarn.quant.baselines.spec import PresetSpec

_REGISTRY: dict[str, Callable[[], Preset]] = {}
_ALIASES: dict[str, str] = {}


def register_preset(name: str, factory: Callable[[], Preset], aliases: tuple[str, ...] = ()) -> None:
    _REGISTRY[name] = factory
    for a in aliases:
        _ALIASES[a] = name


def preset_names(include_aliases: bool = False) -> list[str]:
    return sorted(_REGISTRY) + (sorted(_ALIASES) if include_aliases else [])


def get_preset(name: str | Preset) -> Preset:
    if isinstance(name, Preset):
        return name
    key = _ALIASES.get(name, name)
    if key not in _REGISTRY:
        raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(preset_names(True))}")
    return _REGISTRY[key]()


def from_spec(spec: Callable[[], PresetSpec]) -> Callable[[], Preset]:
    """A preset factory from a baseline's spec factory (`kvarn.quant.baselines.spec`)."""
    return lambda: Preset(**spec())


def _register_built_in() -> None:
    for name, factory, aliases in FAMILY_PRESETS:
        register_preset(name, factory, aliases)
    for name, spec, aliases in BASELINE_PRESETS:
        register_preset(name, from_spec(spec), aliases)


_register_built_in()
