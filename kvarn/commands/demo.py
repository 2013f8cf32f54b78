"""`kvarn demo`: the main job — FP16 vs quantized caches on one long answer of a real model."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    from kvarn.demo import DEFAULT_METHODS

    p = sub.add_parser("demo", help="the main job: FP16 vs quantized caches on a long greedy answer")
    p.add_argument("--model", default="default", help="named model, HF id or local path (default: embedded)")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="comma-separated presets")
    p.add_argument("--new-tokens", type=int, default=1024)
    p.add_argument("--prompt", default=None, help="override the step-by-step reasoning prompt")
    p.add_argument("--sink", type=int, default=None, help="full-precision sink tokens (default: each preset's)")
    p.add_argument("--attention", choices=("packed", "reference"), default="packed")
    p.add_argument("--out", type=Path, default=None, help="write demo.json, demo.md and demo_kl.png here")
    p.add_argument("--json", type=Path, default=None, help="write the JSON report alone to this file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.table import Table

    from kvarn.console import console
    from kvarn.demo import DEFAULT_PROMPT, HEADERS, markdown, plot, run_demo, table_rows
    from kvarn.eval.results import write_json

    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    report = run_demo(args.model, methods, args.new_tokens, args.prompt or DEFAULT_PROMPT, args.sink, args.attention)
    table = Table(title=f"kvarn demo — {args.model}, {args.new_tokens} new tokens")
    for h in HEADERS:
        table.add_column(h, justify="left" if h == "method" else "right")
    for row in table_rows(report):
        table.add_row(*row)
    console().print(table)
    if args.json:
        print(f"wrote {write_json(args.json, report)}")
    if args.out:
        png = plot(report, args.out / "demo_kl.png")
        write_json(args.out / "demo.json", report)
        (args.out / "demo.md").write_text(markdown(report, png.name))
        print(f"wrote {args.out}/demo.json, demo.md, {png.name}")
    return 0
