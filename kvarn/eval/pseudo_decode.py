"""`kvarn eval pseudo-decode`: error growth with context length, static vs cumulative (docs/SPEC.md §6).

The first `--max-len` tokens of the text are fed in blocks of `--block` tokens (engine.run_blocks): the
reference on a DynamicCache, each method on its own KVarNCache in static and/or cumulative mode. Per
method, mode and block it reports the attention-output MAE of every layer and its mean over layers,
the mean next-token KL against the reference and the top-1 agreement. Summaries average over quarters
of the blocks (Q1..Q4 of the context), and growth = MAE(cumulative) / MAE(static) per quarter.

Outputs in --out: pseudo_decode.json (kvarn/eval/schemas/pseudo_decode.schema.json), summary.md and plots:
error_vs_length.png, static_vs_cumulative.png, mae_per_layer.png, kivi_gap.png (when a KIVI-like
method and a k2v2 KVarN are both run).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from kvarn.eval.engine import MODES, RunSpec, Trace, run_blocks
from kvarn.eval.forward import decoder_layers, head_dim
from kvarn.eval.options import add_common_arguments, parse_methods, positive_int, result_header, setup
from kvarn.eval.results import markdown_table, publish
from kvarn.eval.text import load_tokens, text_name

COMMAND = "pseudo-decode"
HELP = "error vs context length, static vs cumulative (docs/SPEC.md §6 pseudo-decoding)"
DEFAULT_METHODS = "rtn,hadamard,varn,kvarn-k2v2-g128"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, methods=DEFAULT_METHODS, command=COMMAND)
    parser.add_argument("--block", type=positive_int, default=64, help="tokens per block (default: 64)")
    parser.add_argument("--max-len", type=positive_int, default=2048, help="tokens of the text (default: 2048)")
    parser.add_argument("--mode", default="static,cumulative", help="static, cumulative or both (default: both)")


def parse_modes(text: str) -> list[str]:
    modes = list(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"--mode must list {' and/or '.join(MODES)}, got {text!r}")
    return modes


def quarters(x: np.ndarray) -> list[float]:
    """Means over up to four contiguous groups of blocks (Q1..Q4 of the context)."""
    return [float(np.mean(g)) for g in np.array_split(np.asarray(x, dtype=np.float64), min(4, len(x))) if len(g)]


def trace_record(tr: Trace, bits: float) -> dict:
    """JSON record of one run: per-block curves and their summaries."""
    mae = tr.per_block("mae").numpy()  # [n_blocks, L]
    mae_mean, kl, top1 = mae.mean(1), tr.per_block("kl").numpy(), tr.per_block("top1").numpy()
    return {
        "method": tr.spec.method, "mode": tr.spec.mode, "preset": tr.spec.preset.name,
        "bits_per_element": bits, "cache_bytes": tr.nbytes.as_dict(), "seconds": tr.seconds,
        "mae": mae.tolist(), "mae_mean": mae_mean.tolist(), "kl": kl.tolist(), "top1": top1.tolist(),
        "summary": {
            "mae": float(mae_mean.mean()), "mae_quarters": quarters(mae_mean),
            "kl": float(tr.positions("kl").mean()), "kl_quarters": quarters(kl),
            "top1": float(tr.positions("top1").double().mean()),
        },
    }


def pick_pair(methods: list[str]) -> tuple[str | None, str | None]:
    """(KIVI-like, KVarN k2v2) among the methods: `kivi*` first, else the k2v2 RTN ablation."""
    kivi = next((m for m in methods if m.startswith("kivi")), None)
    kivi = kivi or next((m for m in methods if m.startswith("rtn-k2v2")), None)
    kvarn = next((m for m in methods if m.startswith("kvarn-k2v2")), None)
    return kivi, kvarn


def growth(result: dict) -> dict[str, list[float]]:
    """MAE(cumulative) / MAE(static) per quarter, for quantizing methods run in both modes (NaN where the
    static error is 0: no quantized tile attended yet)."""
    by = {(r["method"], r["mode"]): r["summary"]["mae_quarters"] for r in result["runs"]}
    out = {}
    for (m, mode), cum in by.items():
        if mode == "cumulative" and (m, "static") in by and any(x > 0 for x in by[(m, "static")]):
            out[m] = [c / s if s > 0 else float("nan") for c, s in zip(cum, by[(m, "static")])]
    return out


def summary_markdown(result: dict) -> str:
    rows = []
    for r in result["runs"]:
        s = r["summary"]
        rows.append([r["method"], r["mode"], r["bits_per_element"], s["mae"], *s["mae_quarters"], s["kl"],
                     s["kl_quarters"][-1], f"{100 * s['top1']:.1f}%", f"{r['seconds']:.0f}"])
    nq = len(result["runs"][0]["summary"]["mae_quarters"]) if result["runs"] else 0
    head = ["method", "mode", "bits/elem", "MAE", *[f"MAE Q{i + 1}" for i in range(nq)], "KL", f"KL Q{nq}",
            "top-1", "s"]
    md = [f"## Pseudo-decoding ({result['tokens']} tokens, blocks of {result['block']}, {result['model']})\n\n",
          "MAE: attention-output mean absolute error vs the full-precision run, mean over layers and blocks; "
          "Q1..Q4: the four quarters of the context. KL: mean next-token KL(ref || method) over positions. "
          "bits/elem: quantized region, measured from stored bytes. s: wall time of the run's forwards.\n\n",
          markdown_table(head, rows)]
    g = growth(result)
    if g:
        md += ["\nGrowth, MAE(cumulative) / MAE(static), per quarter of the context:\n\n",
               markdown_table(["method", *[f"Q{i + 1}" for i in range(nq)]], [[m, *v] for m, v in g.items()], 3)]
    kivi, kvarn = pick_pair(list(dict.fromkeys(r["method"] for r in result["runs"])))
    by = {(r["method"], r["mode"]): r["summary"]["mae_quarters"][-1] for r in result["runs"]}
    if kivi and kvarn and (kvarn, "cumulative") in by and (kivi, "static") in by:
        md.append(f"\nLast quarter: {kvarn} cumulative MAE {by[(kvarn, 'cumulative')]:.4g} vs {kivi} static MAE "
                  f"{by[(kivi, 'static')]:.4g} (paper: KVarN cumulative ≈ KIVI static).\n")
    return "".join(md)


def write_plots(result: dict, out: Path) -> list[Path]:
    from kvarn.eval import plots

    paths = [plots.error_vs_length(result, out / "error_vs_length.png"),
             plots.static_vs_cumulative(result, out / "static_vs_cumulative.png"),
             plots.mae_per_layer(result, out / "mae_per_layer.png")]
    kivi, kvarn = pick_pair(list(dict.fromkeys(r["method"] for r in result["runs"])))
    if kivi and kvarn:
        paths.append(plots.kivi_gap(result, out / "kivi_gap.png", kivi, kvarn))
    return paths


def run(args: argparse.Namespace) -> int:
    setup(args)
    presets, modes = parse_methods(args.methods), parse_modes(args.mode)
    from kvarn.models import load_model

    model, tok = load_model(args.model)
    ids = load_tokens(tok, args.text, args.max_len)
    specs = [RunSpec(p.name, p, mode) for p in presets for mode in modes]
    _, traces = run_blocks(model, ids, specs, args.block, sink=args.sink, desc=COMMAND)
    d, n_layers = head_dim(model), len(decoder_layers(model))
    result = {
        **result_header(args, COMMAND), "text": text_name(args.text), "tokens": int(ids.shape[1]),
        "block": args.block, "num_layers": n_layers, "block_ends": traces[0].block_ends if traces else [],
        "runs": [trace_record(tr, tr.spec.preset.bits_per_element(d, n_layers)) for tr in traces],
    }
    out = Path(args.out)
    write_plots(result, out)
    publish(result, out / "pseudo_decode.json", out, summary_markdown(result))
    return 0
