"""Named methods: frozen presets that build the key and value quantizers and carry the cache policy.

    preset     `Preset` (the method's builders + `CachePolicy` + its record, `to_dict`)
    family     the KVarN family and its ablations, `affine_preset`, `DEFAULT_PRESET`
    registry   names -> presets: the family's and the baselines' (`kvarn.quant.baselines`), imported downward

`CachePolicy` lives in `kvarn.quant.cache_policy` (the baselines state theirs with it); it is re-exported here.
"""

from kvarn.presets.family import BIT_PAIRS, COL_SCALE_DTYPE, DEFAULT_PRESET, FAMILIES, TILES, affine_preset
from kvarn.presets.preset import Preset, QuantizerFactory
from kvarn.presets.registry import get_preset, preset_names, register_preset
from kvarn.quant.cache_policy import CachePolicy

__all__ = [
    "BIT_PAIRS",
    "COL_SCALE_DTYPE",
    "DEFAULT_PRESET",
    "FAMILIES",
    "TILES",
    "CachePolicy",
    "Preset",
    "QuantizerFactory",
    "affine_preset",
    "get_preset",
    "preset_names",
    "register_preset",
]
