"""The paper's baselines behind the same `TileQuantizer` interface; each module exports its presets as plain data.

One module per method, each stating its arithmetic, storage and byte count in its docstring:
    kivi        KIVI: keys per channel (groups of G tokens), values per token, fp16 residual of 128 tokens
    quarot      QuaRot / HK: Hadamard on K and V, per-token RTN, optional clip ratio
    kvquant     KVQuant-1%: pre-RoPE per-channel keys, per-token values, dense-and-sparse fp16 outliers
    polarquant  PolarQuant: keys as radius and angle per RoPE pair, per-token 2-bit values
    turboquant  TurboQuant: random rotation, fp16 norm, Lloyd–Max codebook (optional QJL residual), fp layers
    kitty       Kitty: KIVI layout with the top 10% key channels per tile promoted to 4 bits
`common` holds what they share (per-token grouped RTN, clipped ranges, dtypes); `spec` the shape of an exported
preset. `PRESETS` gathers every module's; the registry (`kvarn.presets`) imports it, never the other way.
"""

from kvarn.quant.baselines import kitty, kivi, kvquant, polarquant, quarot, turboquant
from kvarn.quant.baselines.common import TokenRTN
from kvarn.quant.baselines.kitty import KittyKeyQuantizer
from kvarn.quant.baselines.kvquant import DenseSparseRTN
from kvarn.quant.baselines.polarquant import PolarKeyQuantizer
from kvarn.quant.baselines.spec import PresetEntry, PresetSpec
from kvarn.quant.baselines.turboquant import TurboQuantizer, lloyd_max_codebook

PRESETS: tuple[PresetEntry, ...] = (*kivi.PRESETS, *quarot.PRESETS, *kvquant.PRESETS, *polarquant.PRESETS,
                                    *turboquant.PRESETS, *kitty.PRESETS)

__all__ = [
                                    "PRESETS",
                                    "DenseSparseRTN",
                                    "KittyKeyQuantizer",
                                    "PolarKeyQuantizer",
                                    "PresetEntry",
                                    "PresetSpec",
                                    "TokenRTN",
                                    "TurboQuantizer",
                                    "kitty",
                                    "kivi",
                                    "kvquant",
                                    "lloyd_max_codebook",
                                    "polarquant",
                                    "quarot",
                                    "turboquant",
]
