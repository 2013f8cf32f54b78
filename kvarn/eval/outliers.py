"""`kvarn eval outliers`: fix the worst 5% of quantization errors, or the other 95%, and compare (docs/SPEC.md §6).

Each method runs in cumulative mode (engine.run_blocks) three ways per granularity:
    base    the method as is
    worst   the `--fraction` largest errors of every quantizer tile kept exact
    rest    every other entry of the tile kept exact (the worst `--fraction` stay quantized)
Granularity (patch.PatchedQuantizer): "token" ranks whole token vectors of one KV head by ||x - x^||^2
(round(fraction * G) tokens per tile); "element" ranks single entries by (x - x^)^2 (round(fraction * G * D)
entries per tile). Keys and values are patched alike. The end-to-end metric is the mean next-token
KL(ref || run) over all positions; drop = KL(base) - KL(variant), reported also as a share of KL(base).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvarn.eval.engine import RunSpec, Trace, run_blocks
from kvarn.eval.forward import head_dim
from kvarn.eval.options import add_common_arguments, parse_methods, positive_int, result_header, setup
from kvarn.eval.patch import patched_preset
from kvarn.eval.results import markdown_table, publish
from kvarn.eval.text import load_tokens, text_name

COMMAND = "outliers"
HELP = "KL after fixing the worst 5% of errors vs the other 95% (cumulative mode, docs/SPEC.md §6)"
DEFAULT_METHODS = "rtn,kvarn-k2v2-g128"
GRANULARITIES = ("token", "element")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, methods=DEFAULT_METHODS, command=COMMAND)
    parser.add_argument("--block", type=positive_int, default=64, help="tokens per block (default: 64)")
    parser.add_argument("--max-len", type=positive_int, default=1024, help="tokens of the text (default: 1024)")
    parser.add_argument("--fraction", type=float, default=0.05, help="share of errors fixed (default: 0.05)")
    parser.add_argument("--granularity", default="token,element", help="token, element or both (default: both)")


def parse_granularities(text: str) -> list[str]:
    g = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    if not g or any(x not in GRANULARITIES for x in g):
        raise ValueError(f"--granularity must list token and/or element, got {text!r}")
    return g


def fixed_share(fraction: float, granularity: str, which: str, tile: int, d: int) -> float:
    """The share of a tile's entries actually kept exact (the rounding of fraction * count)."""
    count = tile if granularity == "token" else tile * d
    k = round(fraction * count) / count
    return k if which == "worst" else 1 - k


def record(tr: Trace, variant: str, granularity: str | None, share: float) -> dict:
    kl = tr.per_block("kl")
    last = kl[-max(1, len(kl) // 4):]
    return {"method": tr.spec.method, "variant": variant, "granularity": granularity, "fixed_share": share,
            "kl": float(tr.positions("kl").mean()), "kl_last_quarter": float(last.mean()),
            "mae": float(tr.per_block("mae").mean()), "top1": float(tr.positions("top1").double().mean()),
            "seconds": tr.seconds}


def write_plots(result: dict, out: Path) -> list[Path]:
    """KL per method: as is, worst fixed, rest fixed, per granularity (log scale)."""
    from kvarn.eval import plots

    rs, frac = result["results"], result["fraction"]
    methods = list(dict.fromkeys(r["method"] for r in rs))
    series = {"as is": [r["kl"] for r in rs if r["variant"] == "base"]}
    for g in dict.fromkeys(r["granularity"] for r in rs if r["granularity"]):
        for which in ("worst", "rest"):
            label = f"{'worst' if which == 'worst' else 'other'} {g}s exact"
            series[label] = [r["kl"] for r in rs if r["variant"] == which and r["granularity"] == g]
    return [plots.grouped_bars(methods, series, out / "outliers.png", "mean next-token KL",
                               f"fixing the worst {100 * frac:g}% vs the other {100 * (1 - frac):g}%", log=True)]


def summary_markdown(result: dict) -> str:
    frac = result["fraction"]
    base = {r["method"]: r["kl"] for r in result["results"] if r["variant"] == "base"}
    rows = []
    for r in result["results"]:
        b = base[r["method"]]
        drop = "" if r["variant"] == "base" else f"{100 * (b - r['kl']) / b:.1f}%" if b > 0 else "nan"
        what = "as is" if r["variant"] == "base" else (
            f"{'worst' if r['variant'] == 'worst' else 'other'} {100 * r['fixed_share']:.2f}% of {r['granularity']}s"
            " exact")
        rows.append([r["method"], what, r["kl"], r["kl_last_quarter"], drop, f"{100 * r['top1']:.1f}%"])
    return (f"## Outlier replacement ({result['tokens']} tokens, cumulative, blocks of {result['block']}, "
            f"{result['model']})\n\nWorst = the {100 * frac:g}% largest errors of each quantizer tile (one KV head, "
            "G tokens) at quantization time; token granularity ranks whole token vectors by squared error, element "
            "granularity single entries. KL: mean next-token KL vs the full-precision run; drop: share of the "
            "method's own KL removed.\n\n" + markdown_table(
                ["method", "kept exact", "KL", "KL last quarter", "KL drop", "top-1"], rows))


def run(args: argparse.Namespace) -> int:
    setup(args)
    if not 0.0 < args.fraction < 1.0:
        raise ValueError(f"--fraction must be in (0, 1), got {args.fraction}")
    presets = [p for p in parse_methods(args.methods) if p.quantized]
    if not presets:
        raise ValueError("outliers needs at least one quantizing method")
    grans = parse_granularities(args.granularity)
    from kvarn.models import load_model

    model, tok = load_model(args.model)
    ids = load_tokens(tok, args.text, args.max_len)
    d = head_dim(model)
    specs, meta = [], []
    for p in presets:
        specs.append(RunSpec(p.name, p))
        meta.append(("base", None, 0.0))
        for g in grans:
            for which in ("worst", "rest"):
                specs.append(RunSpec(p.name, patched_preset(p, args.fraction, g, which)))
                meta.append((which, g, fixed_share(args.fraction, g, which, p.key(d).tile, d)))
    _, traces = run_blocks(model, ids, specs, args.block, sink=args.sink, desc=COMMAND)
    result = {**result_header(args, COMMAND), "text": text_name(args.text), "tokens": int(ids.shape[1]),
              "block": args.block, "fraction": args.fraction,
              "results": [record(tr, *m) for tr, m in zip(traces, meta)]}
    out = Path(args.out)
    write_plots(result, out)
    publish(result, out / "outliers.json", out, summary_markdown(result))
    return 0
