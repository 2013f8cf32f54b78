"""`kvarn` command line. Each subcommand lives in `kvarn/commands/<name>.py` and exposes
`register(subparsers)`; this file only discovers and dispatches them. Heavy imports stay inside the
command functions so `kvarn --help` is instant."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

import kvarn.commands

# What a bare `pip install kvarn` leaves out, by the extra that brings it (pyproject.toml): the lab's commands need
# them, the cache and `kvarn presets` do not.
EXTRAS = {"matplotlib": "lab", "rich": "lab", "tqdm": "lab", "accelerate": "models", "gguf": "models",
          "optimum": "bench", "hqq": "bench", "psutil": "bench", "vllm": "vllm"}


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
    except ModuleNotFoundError as e:  # an optional dependency: say which extra brings it
        top = (e.name or "").split(".")[0]
        if top not in EXTRAS:
            raise
        print(f"kvarn {args.command}: error: this needs {top}, which is not installed; install the "
              f"`{EXTRAS[top]}` extra: pip install 'kvarn[{EXTRAS[top]}]'", file=sys.stderr)
        return 3


if __name__ == "__main__":
    raise SystemExit(main())
