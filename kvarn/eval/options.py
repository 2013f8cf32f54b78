"""What every `kvarn eval` analysis shares on the command line: argparse types, the common options, the presets
they name, seeding and the header of their results."""

from __future__ import annotations

import argparse
import random
from typing import Any

import torch

from kvarn.eval.heap import release_freed_buffers
from kvarn.eval.provenance import git_revision, provenance
from kvarn.eval.text import DEFAULT_TEXT
from kvarn.presets import Preset, get_preset


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {n}")
    return n


def int_list(text: str) -> list[int]:
    """argparse type: comma-separated integers >= 1 ("100,200")."""
    return [positive_int(t) for t in text.split(",") if t.strip()]


def add_common_arguments(parser: argparse.ArgumentParser, *, methods: str, command: str) -> None:
    """--model, --text, --methods, --out, --seed, --sink, --threads: the same meaning in every analysis."""
    parser.add_argument("--model", default="default", help="named model, HF id or folder (default: embedded SmolLM2)")
    parser.add_argument("--text", default=None, help=f"text file (default: {DEFAULT_TEXT})")
    parser.add_argument("--methods", default=methods, help=f"comma-separated preset names (default: {methods})")
    parser.add_argument("--out", default=f"out/eval/{command}", help="output folder (JSON, summary.md, PNGs)")
    parser.add_argument("--seed", type=int, default=0, help="seed of every random choice (default: 0)")
    parser.add_argument("--sink", type=int, default=None, help="override every preset's full-precision sink")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch CPU threads (default: torch's; 1 is fastest on a busy shared machine)")


def parse_methods(text: str | list[str]) -> list[Preset]:
    """Comma-separated preset names -> presets (order kept, duplicates dropped); get_preset validates."""
    names = text if isinstance(text, list) else [t.strip() for t in text.split(",")]
    names = list(dict.fromkeys(n for n in names if n))
    if not names:
        raise ValueError("--methods is empty; give comma-separated preset names, e.g. rtn,kvarn")
    return [get_preset(n) for n in names]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    git_revision()  # pinned now: the run records the code it starts with (every analysis seeds first)


def result_header(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """The first fields of every analysis's JSON: its name, the provenance of the run (all options), the model."""
    return {"analysis": command, "provenance": provenance(**{k: v for k, v in vars(args).items() if k != "func"}),
            "model": args.model}


def setup(args: argparse.Namespace) -> None:
    """Seed every generator with --seed, apply --threads and limit heap fragmentation, before an analysis runs."""
    seed_everything(args.seed)
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    release_freed_buffers()
