"""The KVarN family and its ablations as named presets: `{family}-k{b_K}v{b_V}-g{G}`; a bare family name means
k2v2, G = 128.

Families: `kvarn` (Hadamard + VarN), `kvarn-auto` (rotation chosen per tile), `rtn` (plain RTN, KIVI
orientation, same tiles), `hadamard` (rotation only), `varn` (normalization only), and `fp16`. The budget family
`kvarn-b{bits}` (issue 20) is kvarn-auto k2v2 whose keys go to 4 or 3 bits in the layers an online score picks
(`kvarn.cache.allocation`, rule "output", pick "best": version 3; docs/TASKS.md measures it beside rule "logit"
and pick "rank"), within an average of `bits` per element at head_dim 128. A `-qar` suffix (kvarn-auto and the
budget family) rounds every key tile query-aware (`kvarn.quant.affine.QueryAwareQuantizer`: codes that minimise the
logit error e^T Sigma e under the running E[q q^T] of the tile's KV head; same tiles, same bytes).
The width family `kvarn-w{bits}` (issue 20) is `kvarn-auto-k2v2-g128-qar-clip` whose key tiles spread their
code bits over the channels, 0-4 bits each, by the running query energy (`AffineConfig.widths`, `kvarn.ops.widths`),
the most bits with an average of `bits` per element at head_dim 128.
`PRESETS` lists them as (name, factory, aliases); the registry (`kvarn.presets.registry`) registers them beside the
baselines' (`kvarn.quant.baselines`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from kvarn.presets.preset import Preset
from kvarn.quant.affine import AffineConfig, AffineQuantizer, QueryAwareQuantizer, Rotate
from kvarn.quant.base import TileQuantizer
from kvarn.quant.cache_policy import CachePolicy
from kvarn.quant.tiles import REFINE_BITS

Entry = tuple[str, Callable[[], Preset], tuple[str, ...]]  # (name, factory, aliases)

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


ROUNDING_SUFFIX = {"nearest": "", "query-aware": "-qar"}  # key rounding -> the preset name's suffix


def affine_preset(family: str, k_bits: int, v_bits: int, tile: int, name: str | None = None,
                  scale_dtype: torch.dtype = torch.float16, rounding: str = "nearest", refine: float = 0.0,
                  clip: tuple[float, float] = (1.0, 1.0)) -> Preset:
    """`{family}-k{k_bits}v{v_bits}-g{tile}`; rounding "query-aware": keys by `QueryAwareQuantizer` (name + "-qar");
    refine: the share of each key tile's channels at k_bits + 2 (`AffineConfig.refine`); clip: the share of each
    row's range the key and the value grids span (`AffineConfig.clip`)."""
    if rounding not in ROUNDING_SUFFIX:
        raise ValueError(f"rounding must be one of {tuple(ROUNDING_SUFFIX)}, got {rounding!r}")
    rk, rv, use_varn, desc = FAMILIES[family]
    col = COL_SCALE_DTYPE.get(family)
    key_cls = QueryAwareQuantizer if rounding == "query-aware" else AffineQuantizer

    def key(_: int) -> TileQuantizer:
        return key_cls(AffineConfig(k_bits, "channel", rk, use_varn, tile=tile, scale_dtype=scale_dtype,
                                    col_scale_dtype=col, refine=refine, clip=clip[0]))

    def value(_: int) -> TileQuantizer:
        return AffineQuantizer(AffineConfig(v_bits, "token", rv, use_varn, tile=tile, scale_dtype=scale_dtype,
                                            col_scale_dtype=col, clip=clip[1]))

    params = {"tile": tile, "scale_dtype": str(scale_dtype).removeprefix("torch.")}
    if scale_dtype != torch.float16:
        desc += f" ({params['scale_dtype']} scales" + (", fp16 zero points)" if scale_dtype.itemsize == 1 else ")")
    if rounding != "nearest":
        params["rounding"] = rounding
        desc += "; keys rounded query-aware (e^T Sigma_q e with the running E[q q^T])"
    if clip != (1.0, 1.0):
        params["clip"] = list(clip)
        desc += f"; rows' grids span {clip[0]:g} (keys) / {clip[1]:g} (values) of their range"
    if refine:
        params["refine"] = refine
        desc += (f"; {refine:.1%} of each key tile's channels at {k_bits + REFINE_BITS} bits (those the queries weigh "
                 "most)")
    name = name or f"{family}-k{k_bits}v{v_bits}-g{tile}{ROUNDING_SUFFIX[rounding]}"
    return Preset(name=name, description=desc, key=key, value=value,
                  policy=CachePolicy(tile=tile), family=family, k_bits=k_bits, v_bits=v_bits, params=params)


# The share of each row's range a clipped 2-bit grid spans (`AffineConfig.clip`): fixed before any task run, from the
# attention-output error of one prompt's keys and values (scripts/key_output_error.py: 0.8 best of 1.0-0.6 for
# query-aware keys and for values; the MSE-best share of Gaussian rows, 0.6, clips the tails these rows have).
CLIP_2BIT = 0.8
BUDGETS = (2.5, 3.0)
BUDGET_HEAD_DIM = 128  # budgets are named at head_dim 128; smaller heads pay more for their scales


def budget_preset(bits: float, tile: int = 128, rule: str = "output", name: str | None = None,
                  high: int = 4, mid: int | None = 3, pick: str = "rank",
                  scale_dtype: torch.dtype = torch.float16, rounding: str = "nearest",
                  clip: tuple[float, float] = (1.0, 1.0)) -> Preset:
    """`kvarn-b{bits}`: kvarn-auto k2v2 with the keys of a share of the layers at `high` (3 or 4) bits, the share the
    largest that keeps (k_low + share (k_high - k_low) + v) / 2 <= bits at head_dim 128 (stored bytes, scales
    included); what rounding that share down to whole layers leaves buys layers at `mid` bits (None: unspent).
    pick "best": the same key bits split between `high` and `mid` layers per request by the layers' gains at both
    widths (`kvarn.cache.allocation.best_split`) instead of `high` first. scale_dtype: the row scales' dtype
    (float8_e4m3fn: the bits the scales save buy more promoted layers). rounding "query-aware": every key width
    rounds query-aware (name + "-qar"; the layers' trial encodes that score the promotion round to nearest). clip: the
    2-bit key and value grids' share of each row's range (`AffineConfig.clip`; promoted keys keep the full range)."""
    if high not in (3, 4) or (mid is not None and not 2 < mid < high):
        raise ValueError(f"budget presets promote keys to 3 or 4 bits, spending the rest on fewer bits; got high "
                         f"{high}, mid {mid}")
    if pick not in ("rank", "best") or (pick == "best" and mid is None):
        raise ValueError(f"pick must be 'rank' or 'best' (which needs a mid width), got {pick!r} with mid {mid}")
    low, top = (affine_preset("kvarn-auto", kb, 2, tile, scale_dtype=scale_dtype, rounding=rounding,
                              clip=clip if kb == 2 else (1.0, 1.0)) for kb in (2, high))
    d = BUDGET_HEAD_DIM
    k_lo, v = (q.bits_per_element(d) for q in low.quantizers(d))
    k_hi = top.quantizers(d)[0].bits_per_element(d)
    share = min(max((2 * bits - k_lo - v) / (k_hi - k_lo), 0.0), 1.0)
    rest = "" if mid is None else f", the key bits left by whole layers on {mid}-bit keys in the next layers"
    desc = (f"kvarn-auto k2v2 with {high}-bit keys in the layers that lose most at 2 bits{rest}, chosen online per "
            f"request from each layer's first tile (rule {rule!r}, kvarn.cache.allocation): <= {bits} bits/element "
            f"at head_dim {d}")
    params = {**low.params, "budget": bits, "budget_head_dim": d, "rule": rule}
    if high != 4:
        params["high_bits"] = high
    if mid is not None:
        params["mid_bits"] = mid
    if pick != "rank":
        params["pick"] = pick
        desc += f", the split between {high}- and {mid}-bit layers chosen per request by their gains at both"
    if rounding != "nearest":
        desc += "; keys rounded query-aware"
    name = name or f"kvarn-b{bits}{ROUNDING_SUFFIX[rounding]}"
    return dataclasses.replace(low, name=name, description=desc, family="kvarn-budget",
                               key_high=top.key, promote=share, k_bits=round(2 + (high - 2) * share, 4),
                               key_mid=None if mid is None else affine_preset(
                                   "kvarn-auto", mid, 2, tile, scale_dtype=scale_dtype, rounding=rounding).key,
                               params=params, version=3 if pick == "best" else 2 if mid is not None else 1)


def channel_budget_preset(bits: float, tile: int = 128, rounding: str = "nearest", name: str | None = None) -> Preset:
    """`kvarn-c{bits}`: kvarn-auto k2v2 whose key tiles each store the share of channels that `bits` pays for at 4
    bits (refined channels, `kvarn.quant.affine`: per tile the channels with the largest query-weighted error, from
    the running query energy; calibration-free), the most channels with (k + v) / 2 <= bits at head_dim 128, stored
    bytes counted (2 bits per token and an index byte per refined channel)."""
    d = BUDGET_HEAD_DIM

    def build(rows: int) -> Preset:
        return affine_preset("kvarn-auto", 2, 2, tile, rounding=rounding, refine=rows / d,
                             name=name or f"kvarn-c{bits}{ROUNDING_SUFFIX[rounding]}")

    def average(p: Preset) -> float:
        return sum(q.bits_per_element(d) for q in p.quantizers(d)) / 2

    rows = max((r for r in range(d) if average(build(r)) <= bits), default=0)
    p = build(rows)
    return dataclasses.replace(
        p, description=p.description + f": <= {bits} bits/element at head_dim {d}", k_bits=round(2 + 2 * rows / d, 4),
        params={**p.params, "budget": bits, "budget_head_dim": d})


def widths_preset(bits: float | None = None, tile: int = 128, name: str | None = None,
                  mean: float | None = None) -> Preset:
    """`kvarn-w{bits}`: `kvarn-auto-k2v2-g{tile}-qar-clip` with each key tile's channels at 0-4 bits (`AffineConfig.
    widths`), the mean width the largest multiple of 1 / 128 with (k + v) / 2 <= bits at head_dim 128, stored bytes
    counted (the widths 3 bits a channel); or the mean width itself (`mean`, a lab variant of no budget)."""
    base = affine_preset("kvarn-auto", 2, 2, tile, f"kvarn-auto-k2v2-g{tile}-qar-clip", rounding="query-aware",
                         clip=(CLIP_2BIT, CLIP_2BIT))
    col, d = base.key(0).config.col_scale_dtype, BUDGET_HEAD_DIM

    def build(m: float) -> Preset:
        def key(_: int) -> TileQuantizer:
            return QueryAwareQuantizer(AffineConfig(4, "channel", "auto", True, tile=tile, col_scale_dtype=col,
                                                    widths=m))

        return dataclasses.replace(base, key=key, k_bits=m)

    def average(p: Preset) -> float:
        return sum(q.bits_per_element(d) for q in p.quantizers(d)) / 2

    if (bits is None) == (mean is None):
        raise ValueError("give a budget (bits) or a mean key width (mean), not both")
    if mean is None:
        mean = max((t / d for t in range(1, 4 * d + 1) if average(build(t / d)) <= bits), default=None)
        if mean is None:
            raise ValueError(f"no key widths fit {bits} bits/element at head_dim {d}")
    p = build(mean)
    params = {**base.params, "key_widths": mean, **({"budget": bits, "budget_head_dim": d} if bits else {})}
    desc = (f"key channels at 0-4 bits each, {mean:g} on average a tile, spread by the running query energy"
            + (f" (<= {bits} bits/element at head_dim {d})" if bits else "") + f"; otherwise {base.name}: "
            + base.description)
    return dataclasses.replace(p, name=name or (f"kvarn-w{bits}" if bits else f"kvarn-w{mean:g}-qar"),
                               description=desc, family="kvarn-widths", params=params)


def _entries() -> tuple[Entry, ...]:
    out: list[Entry] = []
    for fam in FAMILIES:
        for kb, vb in BIT_PAIRS:
            for g in TILES:
                name = f"{fam}-k{kb}v{vb}-g{g}"
                # a bare family name means k2v2 at G = 128
                aliases = (fam,) if (kb, vb, g) == (2, 2, 128) else ()
                out.append((name, lambda f=fam, kb=kb, vb=vb, g=g: affine_preset(f, kb, vb, g), aliases))
    # the paper's accounting (2.25 bits for k2v2 at D = G = 128): e4m3 scales, fp16 zero points.
    # e4m3 tops out at 448: a tile whose scales exceed it is kept exact by the cache (and counted).
    for kb, vb in BIT_PAIRS:
        name = f"kvarn-k{kb}v{vb}-g128-fp8"
        out.append((name, lambda kb=kb, vb=vb, n=name: affine_preset("kvarn", kb, vb, 128, n, torch.float8_e4m3fn),
                    ()))
    for kb, vb in BIT_PAIRS:  # kvarn-auto with query-aware keys (issue 20)
        for g in TILES:
            out.append((f"kvarn-auto-k{kb}v{vb}-g{g}-qar",
                        lambda kb=kb, vb=vb, g=g: affine_preset("kvarn-auto", kb, vb, g, rounding="query-aware"), ()))
    for g in TILES:  # ... and 2-bit grids over CLIP_2BIT of each row's range (docs/TASKS.md, "Clipped 2-bit grids")
        name = f"kvarn-auto-k2v2-g{g}-qar-clip"
        out.append((name, lambda g=g, n=name: affine_preset("kvarn-auto", 2, 2, g, n, rounding="query-aware",
                                                          clip=(CLIP_2BIT, CLIP_2BIT)), ()))
    for b in BUDGETS:
        out.append((f"kvarn-b{b}", lambda b=b: budget_preset(b, pick="best"), ()))
        out.append((f"kvarn-b{b}-qar", lambda b=b: budget_preset(b, pick="best", rounding="query-aware"), ()))
    for b in BUDGETS:
        out.append((f"kvarn-w{b}", lambda b=b: widths_preset(b), ()))
    out.append(("fp16", lambda: Preset("fp16", "no quantization (the reference)", None, None, family="fp16"), ()))
    return tuple(out)


PRESETS = _entries()
# The default must never be worse than plain RTN on any model family measured (issue 9): the paper's
# kvarn-k2v2-g128 rotates every key tile, which breaks 2-bit keys on models without QK-norm (Qwen2.5) and on
# Gemma 3; kvarn-auto chooses the rotation per tile and beat RTN on all three families (README, Presets).
DEFAULT_PRESET = "kvarn-auto-k2v2-g128"
