"""Named methods: frozen configs that build the key and value quantizers and set the cache policy.

Names follow `{family}-k{b_K}v{b_V}-g{G}`; a bare family name means k2v2, G = 128.
Families: `kvarn` (Hadamard + VarN), `kvarn-auto` (rotation chosen per tile), `rtn` (plain RTN, KIVI
orientation, same tiles), `hadamard` (rotation only), `varn` (normalization only), and `fp16`.
Baselines register themselves in `kvarn.quant.baselines`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from kvarn.quant.affine import AffineConfig, AffineQuantizer, Rotate
from kvarn.quant.base import TileQuantizer

QuantizerFactory = Callable[[int], TileQuantizer]  # head_dim -> quantizer


@dataclass(frozen=True)
class Preset:
    """A method and its cache policy.

    tile          tokens the cache hands to the quantizers at once; a multiple of their own tiles
    sink          first tokens kept in full precision for good
    value_window  "block": values wait in the full-precision tail until their block of `tile` completes;
                  "sliding": the newest `tile` values stay in full precision, older ones are quantized
                  (KIVI's residual), one quantizer tile at a time
    fp_layers     (first, last): layers kept entirely in full precision (TurboQuant's setup)
    key_pre_rope  keys are quantized before RoPE (KVQuant); the cache undoes/redoes RoPE around it
    """

    name: str
    description: str
    key: QuantizerFactory | None
    value: QuantizerFactory | None
    tile: int = 128
    sink: int = 128
    value_window: Literal["block", "sliding"] = "block"
    fp_layers: tuple[int, int] = (0, 0)
    key_pre_rope: bool = False
    family: str = "kvarn"
    k_bits: float = 16
    v_bits: float = 16
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def quantized(self) -> bool:
        return self.key is not None

    def quantizers(self, head_dim: int) -> tuple[TileQuantizer, TileQuantizer]:
        if self.key is None or self.value is None:
            raise ValueError(f"preset {self.name!r} does not quantize")
        return self.key(head_dim), self.value(head_dim)

    def bits_per_element(self, head_dim: int, num_layers: int | None = None) -> float:
        """Bits per cached K/V element of the quantized region, measured from stored bytes.

        With `num_layers`, full-precision layers (`fp_layers`) are averaged in at 16 bits.
        """
        if not self.quantized:
            return 16.0
        kq, vq = self.quantizers(head_dim)
        b = (kq.bits_per_element(head_dim) + vq.bits_per_element(head_dim)) / 2
        if num_layers is not None and any(self.fp_layers):
            n_fp = min(num_layers, sum(self.fp_layers))
            b = (b * (num_layers - n_fp) + 16.0 * n_fp) / num_layers
        return b


_REGISTRY: dict[str, Callable[[], Preset]] = {}
_ALIASES: dict[str, str] = {}


def register_preset(name: str, factory: Callable[[], Preset], aliases: tuple[str, ...] = ()) -> None:
    _REGISTRY[name] = factory
    for a in aliases:
        _ALIASES[a] = name


def preset_names(include_aliases: bool = False) -> list[str]:
    _load_baselines()
    return sorted(_REGISTRY) + (sorted(_ALIASES) if include_aliases else [])


def get_preset(name: str | Preset) -> Preset:
    if isinstance(name, Preset):
        return name
    _load_baselines()
    key = _ALIASES.get(name, name)
    if key not in _REGISTRY:
        raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(preset_names(True))}")
    return _REGISTRY[key]()


def _load_baselines() -> None:
    # Baselines register on import; imported lazily so the core never depends on them.
    import kvarn.quant.baselines  # noqa: F401


# --- the KVarN family and its ablations -------------------------------------------------------------

FAMILIES: dict[str, tuple[Rotate, Rotate, bool, str]] = {
    # family: (key rotation, value rotation, VarN, description)
    "kvarn": ("hadamard", "hadamard", True, "KVarN: Hadamard rotation + VarN + RTN (the paper)"),
    "kvarn-auto": ("auto", "auto", True, "KVarN with the rotation of each key and value tile chosen online "
                   "(issue 6, kvarn.quant.policy), 8-bit relative column scales"),
    "rtn": ("none", "none", False, "RTN only, KIVI orientation, per tile (ablation)"),
    "hadamard": ("hadamard", "hadamard", False, "Hadamard only + RTN, QuaRot-like (ablation)"),
    "varn": ("none", "none", True, "VarN only + RTN (ablation)"),
}
# families whose VarN column scales are stored in 8 bits relative to their tile maximum (relative_col_scales):
# kvarn-auto at D = 64 stays under 2.5 bits per element at k2v2 (fp16 everywhere would be 2.56)
COL_SCALE_DTYPE: dict[str, torch.dtype] = {"kvarn-auto": torch.float8_e4m3fn}
BIT_PAIRS = ((2, 2), (4, 2), (4, 4))
TILES = (128, 64)


def affine_preset(family: str, k_bits: int, v_bits: int, tile: int, name: str | None = None,
                  scale_dtype: torch.dtype = torch.float16) -> Preset:
    rk, rv, use_varn, desc = FAMILIES[family]
    col = COL_SCALE_DTYPE.get(family)

    def key(_: int) -> TileQuantizer:
        return AffineQuantizer(AffineConfig(k_bits, "channel", rk, use_varn, tile=tile, scale_dtype=scale_dtype,
                                            col_scale_dtype=col))

    def value(_: int) -> TileQuantizer:
        return AffineQuantizer(AffineConfig(v_bits, "token", rv, use_varn, tile=tile, scale_dtype=scale_dtype,
                                            col_scale_dtype=col))

    extra: dict[str, object] = {}
    if scale_dtype != torch.float16:
        extra["scale_dtype"] = str(scale_dtype).removeprefix("torch.")
        desc += f" ({extra['scale_dtype']} scales" + (", fp16 zero points)" if scale_dtype.itemsize == 1 else ")")
    return Preset(name=name or f"{family}-k{k_bits}v{v_bits}-g{tile}", description=desc, key=key, value=value,
                  tile=tile, family=family, k_bits=k_bits, v_bits=v_bits, extra=extra)


def _register_family_presets() -> None:
    for fam in FAMILIES:
        for kb, vb in BIT_PAIRS:
            for g in TILES:
                name = f"{fam}-k{kb}v{vb}-g{g}"
                register_preset(name, lambda f=fam, kb=kb, vb=vb, g=g: affine_preset(f, kb, vb, g))
        _ALIASES[fam] = f"{fam}-k2v2-g128"
    # the paper's accounting (2.25 bits for k2v2 at D = G = 128): e4m3 scales, fp16 zero points.
    # e4m3 tops out at 448: a tile whose scales exceed it is kept exact by the cache (and counted).
    for kb, vb in BIT_PAIRS:
        name = f"kvarn-k{kb}v{vb}-g128-fp8"
        register_preset(name, lambda kb=kb, vb=vb, n=name: affine_preset("kvarn", kb, vb, 128, n, torch.float8_e4m3fn))
    register_preset("fp16", lambda: Preset("fp16", "no quantization (the reference)", None, None, family="fp16"))


_register_family_presets()
# The default must never be worse than plain RTN on any model family measured (issue 9): the paper's
# kvarn-k2v2-g128 rotates every key tile, which breaks 2-bit keys on models without QK-norm (Qwen2.5) and on
# Gemma 3; kvarn-auto chooses the rotation per tile and beat RTN on all three families (README, Presets).
DEFAULT_PRESET = "kvarn-auto-k2v2-g128"
