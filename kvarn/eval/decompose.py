"""`kvarn eval decompose`: how much of the largest quantization errors is magnitude error (docs/SPEC.md §6).

For a token's vector x (one key or value of one KV head in one layer) and its reconstruction x^:

    E_T = ||x - x^||^2 = E_M + E_D     exactly, with
    E_M = (||x|| - ||x^||)^2                        magnitude error
    E_D = 2 ||x|| ||x^|| (1 - cos θ) = 2 (||x|| ||x^|| - x·x^)   direction error

(expand ||x - x^||^2 = ||x||^2 + ||x^||^2 - 2 x·x^). Computed in float64; the second form of E_D is used,
so a zero vector needs no special case.

The K/V are the model's own, captured with a DynamicCache over the first `--max-len` tokens of the text
(post-RoPE; keys of `key_pre_rope` presets are taken back before RoPE, which changes no error since RoPE
rotates k and k^ alike). Each layer's K/V go through a `LayerStore` of the preset, exactly as the cache
stores them, and only tokens of the quantized tiles are counted (sink and tail are exact; layers a preset
keeps in full precision are skipped). Tokens of all layers and heads are pooled and ranked by E_T; for
the top 0.1%, 1%, 5% (and all) tokens, magnitude share = sum E_M / sum E_T over those tokens.

Also reported: the share of those top tokens whose norm is extreme for its layer and head (below its 5th
or above its 95th percentile; 10% by chance), and the mean ||x^|| / ||x|| over them (> 1: too long).
Plots (one layer, `--plot-layer`, all heads and tokens): per-token norm error vs norm (paper Fig. 1b)
and the joint scatter of E_M vs E_D.
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

import torch

from kvarn.cache.store import LayerStore
from kvarn.eval.forward import capture_kv, head_dim
from kvarn.eval.options import add_common_arguments, parse_methods, positive_int, result_header, setup
from kvarn.eval.progress import progress
from kvarn.eval.results import markdown_table, publish
from kvarn.eval.text import load_tokens, text_name
from kvarn.presets import Preset

COMMAND = "decompose"
HELP = "magnitude vs direction share of the largest per-token K/V errors (docs/SPEC.md §6)"
DEFAULT_METHODS = "rtn,hadamard,varn,kvarn-k2v2-g128"
FRACTIONS = (0.001, 0.01, 0.05, 1.0)
KINDS = ("keys", "values")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, methods=DEFAULT_METHODS, command=COMMAND)
    parser.add_argument("--max-len", type=positive_int, default=2048, help="tokens of the text (default: 2048)")
    parser.add_argument("--plot-layer", type=int, default=None, help="layer of the scatter plots (default: middle)")


def decompose_errors(x: torch.Tensor, xh: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-vector errors along the last axis, float64: e_t, e_m, e_d, norm ||x||, norm_hat ||x^||."""
    if x.shape != xh.shape:
        raise ValueError(f"shapes differ: {tuple(x.shape)} vs {tuple(xh.shape)}")
    x, xh = x.double(), xh.double()
    n, nh = x.norm(dim=-1), xh.norm(dim=-1)
    return {"e_t": (x - xh).pow(2).sum(-1), "e_m": (n - nh).pow(2), "e_d": 2 * (n * nh - (x * xh).sum(-1)),
            "norm": n, "norm_hat": nh}


def norm_rank(norm: torch.Tensor) -> torch.Tensor:
    """Percentile rank in [0, 1] of each token's norm within its row (layer, head): norm [..., T]."""
    t = norm.shape[-1]
    return norm.argsort(-1).argsort(-1).double() / max(t - 1, 1)


def layer_errors(preset: Preset, k: torch.Tensor, v: torch.Tensor, sink: int | None) -> dict[str, dict]:
    """Errors of the quantized tiles of one layer, per kind: tensors [B*H, n] (keys and values)."""
    store = LayerStore.from_preset(preset, k.shape[-1], sink=sink)
    store.append(k, v)
    out = {}
    for kind, x, ts in (("keys", k, store.keys), ("values", v, store.values)):
        xh = ts.dequantized_tiles()  # [B, H, n, D]
        if xh is None:
            continue
        s = ts.tiles_start
        x_q = x[:, :, s:s + xh.shape[2]]
        e = decompose_errors(x_q, xh)
        # ranks of the norm among all tokens of this layer and head (the sink and tail included)
        rank = norm_rank(x.double().norm(dim=-1))[:, :, s:s + xh.shape[2]]
        out[kind] = {name: t.flatten(0, 1) for name, t in {**e, "rank": rank}.items()}
    return out


def shares(e: dict[str, torch.Tensor], fractions: tuple[float, ...] = FRACTIONS) -> dict[str, list[float]]:
    """Statistics of the top fraction of tokens ranked by E_T (e: tensors of any equal shape, flattened)."""
    e = {name: t.flatten() for name, t in e.items()}
    n = e["e_t"].numel()
    order = e["e_t"].argsort(descending=True)
    out: dict[str, list[float]] = {"top_tokens": [], "magnitude_share": [], "extreme_norm_share": [],
                                   "norm_ratio": [], "mean_error": []}
    for f in fractions:
        top = order[: max(1, math.ceil(f * n))]
        e_t, e_m = e["e_t"][top], e["e_m"][top]
        rank = e["rank"][top]
        ratio = e["norm_hat"][top] / e["norm"][top].clamp_min(1e-30)
        out["top_tokens"].append(int(top.numel()))
        out["magnitude_share"].append(float(e_m.sum() / e_t.sum()) if e_t.sum() > 0 else float("nan"))
        out["extreme_norm_share"].append(float(((rank < 0.05) | (rank > 0.95)).double().mean()))
        out["norm_ratio"].append(float(ratio.mean()))
        out["mean_error"].append(float(e_t.mean()))
    return out


def run_decomposition(kv: list[tuple[torch.Tensor, torch.Tensor]], presets: list[Preset], sink: int | None,
                      plot_layer: int, positions_rope=None) -> tuple[list[dict], dict]:
    """Records per (method, kind) and scatter samples of `plot_layer`; kv: per layer (k, v) [B, H, T, D]."""
    records, samples = [], {kind: {} for kind in KINDS}
    n_layers = len(kv)
    for p in progress(presets, desc=COMMAND, unit="method"):
        first, last = p.fp_layers
        layers = [i for i in range(n_layers) if first <= i < n_layers - last]
        pooled = {kind: [] for kind in KINDS}
        per_layer = {kind: {} for kind in KINDS}
        for i in layers:
            k, v = kv[i]
            if p.key_pre_rope and positions_rope is not None:
                k = positions_rope(k)
            errs = layer_errors(p, k, v, sink)
            for kind, e in errs.items():
                pooled[kind].append(e)
                per_layer[kind][i] = shares(e)["magnitude_share"]
                if i == plot_layer:
                    samples[kind][p.name] = _samples(e)
        for kind in KINDS:
            if not pooled[kind]:
                continue
            e = {name: torch.cat([d[name] for d in pooled[kind]], dim=-1).flatten() for name in pooled[kind][0]}
            scale = (e["norm"].pow(2) + e["norm_hat"].pow(2)).clamp_min(1e-300)
            identity = ((e["e_m"] + e["e_d"] - e["e_t"]).abs() / scale).max()
            records.append({"method": p.name, "kind": kind, "tokens": int(e["e_t"].numel()),
                            "fractions": list(FRACTIONS), **shares(e),
                            "identity_max_rel_error": float(identity),
                            "per_layer_magnitude_share": {str(i): s for i, s in per_layer[kind].items()}})
    return records, samples


def _samples(e: dict[str, torch.Tensor]) -> dict[str, list]:
    """Scatter data of one layer (all heads and tokens): norm, signed norm error, E_M, E_D, top-1% flag."""
    e_t = e["e_t"].flatten()
    top = torch.zeros_like(e_t, dtype=torch.bool)
    top[e_t.argsort(descending=True)[: max(1, math.ceil(0.01 * e_t.numel()))]] = True
    return {"norm": e["norm"].flatten().tolist(), "norm_error": (e["norm_hat"] - e["norm"]).flatten().tolist(),
            "e_m": e["e_m"].flatten().tolist(), "e_d": e["e_d"].flatten().tolist(), "top1pct": top.tolist()}


def summary_markdown(result: dict) -> str:
    pct = [f"top {100 * f:g}%" if f < 1 else "all" for f in FRACTIONS]
    rows = [[r["method"], r["kind"], r["tokens"], *[f"{100 * s:.1f}%" for s in r["magnitude_share"]],
             f"{100 * statistics.median(v[1] for v in r['per_layer_magnitude_share'].values()):.1f}%",
             *[f"{100 * s:.0f}%" for s in r["extreme_norm_share"][:3]], f"{r['norm_ratio'][1]:.3f}"]
            for r in result["results"]]
    head = ["method", "kind", "tokens", *[f"E_M/E_T {p}" for p in pct], "top 1% per layer (median)",
            *[f"extreme-norm {p}" for p in pct[:3]], "‖x^‖/‖x‖ top 1%"]
    return (f"## Error decomposition ({result['tokens']} tokens, {result['model']})\n\n"
            "E_M/E_T: magnitude share of the squared error over the tokens with the largest E_T (all layers and "
            "heads pooled; quantized tiles only); per layer: the same share with tokens ranked within each layer, "
            "median over layers. Paper (KIVI, Qwen3-4B keys): >80% for the top 0.1%, >60% for "
            "the top 1%. extreme-norm: share of those tokens whose norm is below the 5th or above the 95th "
            "percentile of their layer and head (10% by chance).\n\n" + markdown_table(head, rows))


def run(args: argparse.Namespace) -> int:
    setup(args)
    presets = [p for p in parse_methods(args.methods) if p.quantized]
    if not presets:
        raise ValueError("decompose needs at least one quantizing method (fp16 has no error)")
    from kvarn.models import load_model

    model, tok = load_model(args.model)
    ids = load_tokens(tok, args.text, args.max_len)
    kv = capture_kv(model, ids)
    n_layers = len(kv)
    plot_layer = n_layers // 2 if args.plot_layer is None else args.plot_layer
    if not 0 <= plot_layer < n_layers:
        raise ValueError(f"--plot-layer must be in [0, {n_layers}), got {plot_layer}")
    unrope = None
    if any(p.key_pre_rope for p in presets):
        from kvarn.cache.rope import Rope

        rope, pos = Rope(model.config), torch.arange(ids.shape[1]).unsqueeze(0)

        def unrope(k: torch.Tensor) -> torch.Tensor:
            return rope.invert(k, pos.expand(k.shape[0], -1).to(k.device))

    with torch.inference_mode():
        records, samples = run_decomposition(kv, presets, args.sink, plot_layer, unrope)
    result = {**result_header(args, COMMAND), "text": text_name(args.text), "tokens": int(ids.shape[1]),
              "head_dim": head_dim(model), "num_layers": n_layers, "plot_layer": plot_layer, "results": records}
    out = Path(args.out)
    from kvarn.eval import plots

    for kind in KINDS:
        if samples[kind]:
            plots.norm_error_vs_norm(samples[kind], out / f"norm_error_{kind}.png", kind, plot_layer)
            plots.joint_error(samples[kind], out / f"joint_{kind}.png", kind, plot_layer)
    publish(result, out / "decompose.json", out, summary_markdown(result))
    return 0
