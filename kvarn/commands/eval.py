"""`kvarn eval <analysis>`: the evaluation harness.

Every module in `kvarn/eval/` that defines `COMMAND: str`, `add_arguments(parser)` and `run(args) -> int`
becomes one analysis (an optional `HELP: str` is its one-line help). Nothing here knows the analyses.
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from kvarn.eval import analyses

    p = sub.add_parser("eval", help="evaluation harness: pseudo-decode, decompose, outliers, ppl, lines, tasks, report")
    es = p.add_subparsers(dest="analysis", required=True, metavar="ANALYSIS")
    for command, module in analyses().items():
        ap = es.add_parser(command, help=getattr(module, "HELP", None),
                           description=(module.__doc__ or "").strip().split("\n\n")[0] or None)
        module.add_arguments(ap)
        ap.set_defaults(func=module.run)
