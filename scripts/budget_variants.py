"""The kvarn CLI with the budget presets' 3-bit variants registered (docs/TASKS.md, "3-bit keys, the budget's
remainder"): `kvarn-b{2.5,3.0}-k3` buy 3-bit keys in as many layers as the budget pays for, instead of 4-bit keys
in half as many; `kvarn-auto-k3v2-g128` is kvarn-auto with 3-bit keys everywhere (for `kvarn bench`). Not
registered in kvarn itself. `kvarn-b{2.5,3.0}-rank` are version 2 of the registered budget presets (4-bit layers
first, pick "rank"); `kvarn-b{2.5,3.0}-best` are version 3, today's `kvarn-b2.5`/`kvarn-b3.0` (the split between 4-
and 3-bit layers chosen per request, pick "best"), under the names they were measured as;
`kvarn-auto-k2v2-g128-prerope` stores keys before RoPE; `kvarn-b{2.5,3.0}-fp8` are version 3 with e4m3 row scales
(the bits saved buy more promoted layers), `kvarn-b{2.5,3.0}-fp8-qar` the same with query-aware keys;
`kvarn-c{2.5,3.0}` and their `-qar` versions store the share of each key tile's channels that the budget pays for
at 4 bits (refined channels, `channel_budget_preset`; docs/TASKS.md, "Refined key channels");
`kvarn-auto-k2v2-g128[-qar]-kc{K}-vc{V}` clip the key and value grids to K and V of each row's range, and
`kvarn-b{2.5,3.0}-qar-kc{C}-vc{C}` the budget presets' 2-bit grids (`AffineConfig.clip`; docs/TASKS.md, "Clipped
2-bit grids"; `kvarn-auto-k2v2-g128-qar-kc0.8-vc0.8` is the registered `kvarn-auto-k2v2-g128-qar-clip`). (The
query-aware variants `kvarn-auto-k2v2-g128-qar` and `kvarn-b{2.5,3.0}-qar` measured from here are registered presets
now: `kvarn.presets.family`.)

    python scripts/budget_variants.py eval tasks --model qwen2.5-coder-0.5b --tasks niah_multikey_1 --lengths 4096 \
        --samples 10 --threads 1 --methods dynamic,kvarn-auto-k2v2-g128,kvarn-b2.5,kvarn-b2.5-k3 \
        --out out/eval/budget-mk4k
"""

from __future__ import annotations

import sys

import torch
from row_widths import widths_preset

from kvarn.cli import main
from kvarn.presets.family import BUDGETS, affine_preset, budget_preset, channel_budget_preset
from kvarn.presets.registry import register_preset

CLIPS = (1.0, 0.9, 0.8, 0.7, 0.6)
# 1-bit values' grids: the two levels at mid -/+ clip * range / 2; the MSE-best levels of a Gaussian row, +-0.80 sigma,
# sit near 0.3 of a 64-128-value row's range (~ +-2.5 sigma)
CLIPS_1BIT = (1.0, 0.6, 0.5, 0.4, 0.35, 0.3, 0.25, 0.2)


def register_variants() -> None:
    """Register the variants named in the module docstring."""
    for b in BUDGETS:
        name = f"kvarn-b{b}-k3"
        register_preset(name, lambda b=b, name=name: budget_preset(b, high=3, mid=None, name=name))
    for b in BUDGETS:  # version 2 of the registered presets: 4-bit layers first, 3-bit ones with the rest
        name = f"kvarn-b{b}-rank"
        register_preset(name, lambda b=b, name=name: budget_preset(b, pick="rank", name=name))
        name = f"kvarn-b{b}-best"  # the registered preset under the name its measurements ran as (docs/TASKS.md)
        register_preset(name, lambda b=b, name=name: budget_preset(b, pick="best", name=name))
    register_preset("kvarn-auto-k3v2-g128", lambda: affine_preset("kvarn-auto", 3, 2, 128))
    # 4-bit values under 2-bit keys: which side a copying task (lines, niah_multikey_2) loses on
    register_preset("kvarn-auto-k2v4-g128", lambda: affine_preset("kvarn-auto", 2, 4, 128))
    register_preset("kvarn-auto-k2v4-g128-qar", lambda: affine_preset("kvarn-auto", 2, 4, 128, rounding="query-aware"))
    for b in BUDGETS:  # e4m3 row scales (fp16 zero points): the 1/16 bit per element they save buys more layers
        name = f"kvarn-b{b}-fp8"
        register_preset(name, lambda b=b, name=name: budget_preset(b, pick="best", name=name,
                                                                  scale_dtype=torch.float8_e4m3fn))
        name = f"kvarn-b{b}-fp8-qar"  # the same with query-aware keys
        register_preset(name, lambda b=b, name=name: budget_preset(b, pick="best", name=name, rounding="query-aware",
                                                                  scale_dtype=torch.float8_e4m3fn))
    for b in BUDGETS:  # refined key channels within the budget: a share of each key tile's channels at 4 bits
        register_preset(f"kvarn-c{b}", lambda b=b: channel_budget_preset(b))
        register_preset(f"kvarn-c{b}-qar", lambda b=b: channel_budget_preset(b, rounding="query-aware"))
    # clipped ranges (`AffineConfig.clip`): each row's grid spans a share of its range, zero bytes, same fields
    for kc in CLIPS:
        for vc in CLIPS:
            for rounding, suffix in (("nearest", ""), ("query-aware", "-qar")):
                name = f"kvarn-auto-k2v2-g128{suffix}-kc{kc:g}-vc{vc:g}"
                register_preset(name, lambda kc=kc, vc=vc, rounding=rounding, name=name: affine_preset(
                    "kvarn-auto", 2, 2, 128, name=name, rounding=rounding, clip=(kc, vc)))
        for b in BUDGETS:
            name = f"kvarn-b{b}-qar-kc{kc:g}-vc{kc:g}"
            register_preset(name, lambda b=b, kc=kc, name=name: budget_preset(
                b, pick="best", name=name, rounding="query-aware", clip=(kc, kc)))
    # a value bit moved to the keys (issue 20, "keys first"): 3- or 4-bit query-aware keys over 1-bit values, the same
    # bytes as k2v2 (k3v1) or one bit more per key (k4v1)
    for kb in (3, 4):
        for g in (128, 64):
            for vc in CLIPS_1BIT:
                name = f"kvarn-auto-k{kb}v1-g{g}-qar-vc{vc:g}"
                register_preset(name, lambda kb=kb, g=g, vc=vc, name=name: affine_preset(
                    "kvarn-auto", kb, 1, g, name=name, rounding="query-aware", clip=(1.0, vc)))
    # G = 64 clipped grids with promoted key layers, at the fp16-scale budget that 8-bit row scales and zero points
    # would make 2.5 bits (they save 0.25 bits per key and 0.125 per value element at G = 64, head_dim 128): is that
    # combination worth building (issue 20)?
    register_preset("kvarn-b2.69-g64-qar-clip", lambda: budget_preset(
        2.6875, tile=64, pick="best", name="kvarn-b2.69-g64-qar-clip", rounding="query-aware", clip=(0.8, 0.8)))
    # keys stored before RoPE (a lever of issue 20: Qwen2's k_proj bias is a per-channel constant there, which the
    # per-channel zero points absorb; after RoPE it is a per-position sinusoid); reads decode and redo RoPE
    register_preset("kvarn-auto-k2v2-g128-prerope", lambda: affine_preset(
        "kvarn-auto", 2, 2, 128, name="kvarn-auto-k2v2-g128-prerope").replace(key_pre_rope=True))
    # keys at 0-4 bits a channel, 2 bits on average (2.34375: 2.5 in all at head_dim 128): reverse water-filling in a
    # tile (scripts/row_widths.py)
    for rule in ("mse", "query", "query-lowclip1"):
        for mean_bits in (2.0, 2.34375):
            name = f"kvarn-w{mean_bits:g}-{rule}-qar"
            register_preset(name, lambda m=mean_bits, rule=rule, name=name: widths_preset(m, rule, name=name))


if __name__ == "__main__":
    register_variants()
    sys.exit(main(sys.argv[1:]))
