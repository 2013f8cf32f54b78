"""The preset registry: names (and aliases) -> factories of `Preset`.

It imports what it registers, downward: the KVarN family (`kvarn.presets.family`) and the baselines' exported specs
(`kvarn.quant.baselines.PRESETS`). Nothing below imports this module; `register_preset` adds a user's own.
"""

from __future__ import annotations

from collections.abc import Callable

from kvarn.presets import family
from kvarn.presets.preset import Preset
from kvarn.quant import baselines
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


for _name, _factory, _aliases in family.PRESETS:
    register_preset(_name, _factory, _aliases)
for _name, _spec, _aliases in baselines.PRESETS:
    register_preset(_name, from_spec(_spec), _aliases)
