"""`kvarn quantize-demo`: quantize synthetic K/V tiles with each preset and report what is lost.

The tiles come from `kvarn.synthetic` (channel outliers with offsets, heavy tails, a few tokens of very
large or very small norm, an attention-sink-like first token, RoPE on keys; seeded). Every tile is
quantized, the first one included (a cache would keep the sink exact). Per preset and for keys and values:

    bits/element        measured from the stored bytes of a tile (`Preset.bits_per_element`)
    rel. MSE            sum ||x - x^||^2 / sum ||x||^2 over all tokens
    norm error          | ||x^|| - ||x|| | / ||x|| per token: mean and worst

Keys are compared after RoPE; presets that quantize keys before RoPE get pre-RoPE keys and RoPE is
applied to their reconstruction. `fp16` stores the tiles in half precision.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

TOKENS_PER_TILE = 128  # --tiles counts blocks of 128 tokens; presets with 64-token tiles see twice as many


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quantize-demo", help="quantize synthetic K/V tiles with each preset; report the errors",
                       description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--head-dim", type=int, default=128, help="head_dim of the synthetic heads (even; default 128)")
    p.add_argument("--tiles", type=int, default=8, help="128-token blocks per head (default 8)")
    p.add_argument("--heads", type=int, default=2, help="KV heads, each with its own channel structure (default 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic data (default 0)")
    p.add_argument("--presets", default=None, help="comma-separated preset names (default: the KVarN family and fp16)")
    p.add_argument("--all", action="store_true", help="every registered preset, baselines included")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results (with provenance) to FILE")
    p.set_defaults(func=run)


def select_presets(names: str | None, everything: bool) -> list:
    """Presets by name, or every registered one (`everything`), or the affine family presets and fp16."""
    from kvarn.presets import FAMILIES, get_preset, preset_names

    if names is not None:
        chosen = list(dict.fromkeys(n.strip() for n in names.split(",") if n.strip()))
        if not chosen:
            raise ValueError("--presets is empty; give comma-separated names (see `kvarn presets`)")
        return [get_preset(n) for n in chosen]
    presets = [get_preset(n) for n in preset_names()]
    return presets if everything else [p for p in presets if p.family in FAMILIES or p.family == "fp16"]


def error_stats(x: torch.Tensor, x_hat: torch.Tensor) -> dict[str, float]:
    """rel_mse, norm_err_mean, norm_err_max of x^ against x [..., D] (per-token vectors on the last axis)."""
    from kvarn.eval.decompose import decompose_errors

    e = decompose_errors(x, x_hat)
    norm_err = (e["norm_hat"] - e["norm"]).abs() / e["norm"].clamp_min(1e-30)
    return {"rel_mse": (e["e_t"].sum() / e["norm"].pow(2).sum()).item(),
            "norm_err_mean": norm_err.mean().item(), "norm_err_max": norm_err.max().item()}


def roundtrip(quantizer, x: torch.Tensor) -> torch.Tensor:
    """x [H, T, D] -> reconstruction of its complete tiles [H, T', D]."""
    from kvarn.synthetic import as_tiles

    h, d = x.shape[0], x.shape[-1]
    tiles = as_tiles(x, quantizer.tile)
    return quantizer.roundtrip(tiles).reshape(h, -1, d)


def evaluate(preset, kv, head_dim: int) -> dict[str, Any]:
    """One row of the demo for `preset` on the synthetic data `kv`."""
    from kvarn.quant.base import Identity
    from kvarn.synthetic import apply_rope

    row: dict[str, Any] = {"name": preset.name, "family": preset.family, "k_bits": preset.k_bits,
                           "v_bits": preset.v_bits, "tile": preset.tile, "key_pre_rope": preset.key_pre_rope,
                           "fp_layers": list(preset.fp_layers)}  # bits below: the quantized layers only
    if preset.quantized:
        kq, vq = preset.quantizers(head_dim)
    else:  # the reference stores half precision
        kq = vq = Identity(tile=TOKENS_PER_TILE)
    row["bits_per_element"] = preset.bits_per_element(head_dim)
    keys_in = kv.keys_pre_rope if preset.key_pre_rope else kv.keys
    k_hat = roundtrip(kq, keys_in)
    if preset.key_pre_rope:
        k_hat = apply_rope(k_hat, torch.arange(k_hat.shape[1]))
    v_hat = roundtrip(vq, kv.values)
    row["keys"] = error_stats(kv.keys[:, : k_hat.shape[1]], k_hat)
    row["values"] = error_stats(kv.values[:, : v_hat.shape[1]], v_hat)
    return row


def print_table(rows: list[dict[str, Any]], title: str) -> None:
    from rich.table import Table

    from kvarn.console import console

    table = Table(title=title)
    table.add_column("preset")
    for col in ("bits/elem", "K rel MSE", "K norm err mean", "K norm err worst", "V rel MSE", "V norm err mean",
                "V norm err worst"):
        table.add_column(col, justify="right")
    for r in rows:
        if "error" in r:
            table.add_row(r["name"], "n/a", f"[red]{r['error']}[/red]", *[""] * 5)
            continue
        k, v = r["keys"], r["values"]
        stats = [f"{s[m]:.4f}" for s in (k, v) for m in ("rel_mse", "norm_err_mean", "norm_err_max")]
        table.add_row(r["name"], f"{r['bits_per_element']:.4f}", *stats)
    console().print(table)


def run(args: argparse.Namespace) -> int:
    from kvarn.eval.progress import progress
    from kvarn.synthetic import synthetic_kv

    if args.tiles < 1 or args.heads < 1:
        raise ValueError(f"--tiles and --heads must be >= 1, got {args.tiles} and {args.heads}")
    if args.head_dim < 2 or args.head_dim % 2:
        raise ValueError(f"--head-dim must be an even integer >= 2 (keys carry RoPE pairs), got {args.head_dim}")
    presets = select_presets(args.presets, args.all)
    kv = synthetic_kv(args.tiles * TOKENS_PER_TILE, args.head_dim, heads=args.heads, seed=args.seed)
    rows = []
    for preset in progress(presets, desc="quantize-demo", unit="preset"):
        try:
            rows.append(evaluate(preset, kv, args.head_dim))
        except ValueError as e:  # a preset that cannot store this head_dim; the others still run
            rows.append({"name": preset.name, "family": preset.family, "error": str(e)})
    if all("error" in r for r in rows):
        raise ValueError(f"no preset could quantize head_dim {args.head_dim}: {rows[0]['error']}")
    title = (f"quantize-demo: {args.heads} head(s) x {args.tiles * TOKENS_PER_TILE} synthetic tokens, "
             f"head_dim {args.head_dim}, seed {args.seed}")
    print_table(rows, title)
    if args.json:
        from kvarn.eval.provenance import provenance
        from kvarn.eval.results import write_json

        config = {"head_dim": args.head_dim, "tiles": args.tiles, "heads": args.heads, "seed": args.seed,
                  "tokens_per_tile": TOKENS_PER_TILE, "presets": [p.name for p in presets]}
        write_json(args.json, {"provenance": provenance(command="quantize-demo", **config), "results": rows})
    return 0
