"""`kvarn` command line. Each subcommand lives in `kvarn/commands/<name>.py` and exposes
`register(subparsers)`; this file only discovers and dispatches them. Heavy imports stay inside the
command functions so `kvarn --help` is instant."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

import kvarn.commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvarn", description="Calibration-free KV-cache quantization (KVarN)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(kvarn.commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"kvarn.commands.{info.name}")
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as e:  # bad input: one clear line, no traceback
        print(f"kvarn {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
