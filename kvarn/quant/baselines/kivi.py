"""KIVI (Liu et al., ICML 2024, arXiv 2402.02750): tuning-free asymmetric 2-bit KV cache, as published.

Per layer and KV head (no attention sink: KIVI has none):
    keys     per channel over groups of G consecutive tokens (G = 32 as published; the `-g128` presets use 128):
             a G x D tile is quantized column by column with min/max over its G tokens, fp16 scale and min per
             channel and group. That is `AffineQuantizer(axis="channel", rotate="none", varn=False, tile=G)`.
    values   per token in groups of G consecutive channels (capped at head_dim), fp16 scale and min per group
             (`TokenRTN`, quantizer tile 1: tokens are independent).
    residual R = 128 newest tokens kept in full precision:
             keys wait in the tail until R of them are complete, then are quantized as R/G tiles at once. They
             are never quantized one decode token at a time: per-channel statistics over a single token make
             min = max, so the token would come back exact and the cache would silently stay full precision
             (a known reimplementation bug; tests/quant/test_baselines.py checks it does not happen here).
             Values keep a sliding window of the newest R in full precision; each older token is quantized as
             it leaves the window (KIVI's `value_full_length > residual_length` rule).
RTN (both): delta = (max - min) / (2^b - 1), q = clamp(round((x - min) / delta), 0, 2^b - 1), x^ = q delta + min.
Bits per element of the quantized region, fp16 scale + min: keys b_K + 32/G, values b_V + 32/g (g = min(G, D));
k2v2 G = 32: 3.0; k2v2 G = 128 at D = 128: 2.25 (the "2.3" of the KVarN paper's table).
"""

from __future__ import annotations

import torch

from kvarn.quant.affine import AffineConfig, AffineQuantizer
from kvarn.quant.base import TileQuantizer
from kvarn.quant.baselines.common import TokenRTN
from kvarn.quant.baselines.spec import PresetEntry, PresetSpec
from kvarn.quant.cache_policy import CachePolicy

RESIDUAL = 128


def kivi_key(bits: int, group: int, scale_dtype: torch.dtype = torch.float16) -> TileQuantizer:
    """Keys per channel over G-token tiles (KIVI's key quantizer)."""
    return AffineQuantizer(AffineConfig(bits, axis="channel", rotate="none", varn=False, tile=group,
                                        scale_dtype=scale_dtype))


def kivi_value(bits: int, head_dim: int, group: int, scale_dtype: torch.dtype = torch.float16) -> TokenRTN:
    """Values per token in groups of `group` channels (KIVI's value quantizer)."""
    return TokenRTN(bits, head_dim, group=group, tile=1, scale_dtype=scale_dtype, name=f"kivi-v{bits}")


def kivi_preset(k_bits: int, v_bits: int, group: int = 32, residual: int = RESIDUAL, name: str | None = None,
                sink: int = 0) -> PresetSpec:
    if residual % group:
        raise ValueError(f"residual {residual} must be a multiple of the key group {group}")
    return PresetSpec(
        name=name or f"kivi-k{k_bits}v{v_bits}-g{group}",
        description=f"KIVI: keys per channel (groups of {group} tokens), values per token (groups of {group} "
                    f"channels), fp16 residual of {residual} tokens",
        key=lambda d: kivi_key(k_bits, group),
        value=lambda d: kivi_value(v_bits, d, group),
        policy=CachePolicy(tile=residual, sink=sink, value_window="sliding"), family="kivi", k_bits=k_bits,
        v_bits=v_bits, params={"group": group, "residual": residual}, notes={"paper": "arXiv:2402.02750"},
    )


def _entries() -> tuple[PresetEntry, ...]:
    out = []
    for kb, vb in ((2, 2), (4, 4)):
        for g in (32, 128):
            name = f"kivi-k{kb}v{vb}-g{g}"
            short = "kivi" + ("" if (kb, vb) == (2, 2) else f"-k{kb}v{vb}") + ("" if g == 32 else f"-g{g}")
            out.append((name, lambda kb=kb, vb=vb, g=g: kivi_preset(kb, vb, g), (short,) if short != name else ()))
    return tuple(out)


PRESETS = _entries()
