"""`kvarn presets`: every registered preset (baselines included) with its bits per element at a head_dim.

Bits per element are measured (`Preset.bits_per_element`): one tile is encoded and its stored bytes
counted, so the figure is what the cache really holds per quantized K/V element. The bytes are the layout's,
whichever implementation fills the tile, so they are counted on the PyTorch reference: listing never compiles the
C++ extension (about a minute on a new machine).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("presets", help="list the presets with bits per element at a head_dim",
                       description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--head-dim", type=int, default=128, help="head_dim the bits are measured at (default: 128)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   help="write JSON (a list of objects) to FILE, or to stdout without FILE")
    p.set_defaults(func=run)


def preset_rows(head_dim: int) -> list[dict[str, Any]]:
    """One dict per preset: name, family, k_bits, v_bits, tile, sink, value_window, fp_layers,
    key_pre_rope, aliases, description, bits_per_element (None with an `error` where the preset cannot
    store this head_dim)."""
    from kvarn.presets import get_preset, preset_names

    if head_dim < 1:
        raise ValueError(f"--head-dim must be a positive integer, got {head_dim}")
    names = preset_names()
    aliases: dict[str, list[str]] = {}
    for alias in sorted(set(preset_names(include_aliases=True)) - set(names)):
        aliases.setdefault(get_preset(alias).name, []).append(alias)
    rows = []
    for name in names:
        p = get_preset(name)
        row: dict[str, Any] = {
            "name": p.name, "family": p.family, "k_bits": p.k_bits, "v_bits": p.v_bits, "tile": p.tile,
            "sink": p.sink, "value_window": p.value_window, "fp_layers": list(p.fp_layers),
            "key_pre_rope": p.key_pre_rope, "aliases": aliases.get(name, []), "description": p.description,
        }
        try:
            with reference_kernels():
                row["bits_per_element"] = p.bits_per_element(head_dim)
        except ValueError as e:  # e.g. codes that cannot be packed along this head_dim
            row["bits_per_element"], row["error"] = None, str(e)
        rows.append(row)
    if all(r["bits_per_element"] is None for r in rows if r["family"] != "fp16"):
        raise ValueError(f"no quantizing preset supports head_dim {head_dim}: {rows[-1].get('error', '')}")
    return rows


@contextmanager
def reference_kernels() -> Iterator[None]:
    """KVARN_KERNEL=torch for the block (kvarn.kernels.cpu.build.mode reads it at each call), then as it was."""
    before = os.environ.get("KVARN_KERNEL")
    os.environ["KVARN_KERNEL"] = "torch"
    try:
        yield
    finally:
        if before is None:
            del os.environ["KVARN_KERNEL"]
        else:
            os.environ["KVARN_KERNEL"] = before


def _bits(v: Any) -> str:
    return f"{v:g}" if isinstance(v, (int, float)) else str(v)


COLUMNS = (("name", "left"), ("family", "left"), ("K bits", "right"), ("V bits", "right"), ("tile", "right"),
           ("sink", "right"), ("V window", "left"), ("bits/elem", "right"), ("description", "left"))


def table_cells(r: dict[str, Any]) -> list[str]:
    bpe = f"{r['bits_per_element']:.4f}" if r["bits_per_element"] is not None else f"n/a: {r['error']}"
    name = r["name"] + (f" ({', '.join(r['aliases'])})" if r["aliases"] else "")
    return [name, r["family"], _bits(r["k_bits"]), _bits(r["v_bits"]), str(r["tile"]), str(r["sink"]),
            str(r["value_window"]), bpe, r["description"]]


def print_table(rows: list[dict[str, Any]], head_dim: int) -> None:
    """A rich table (the `lab` extra), else plain aligned text: the list must work on a bare install."""
    title = f"kvarn presets (bits/element measured at head_dim {head_dim})"
    try:
        from rich.table import Table

        from kvarn.console import console
    except ModuleNotFoundError:
        print_plain(title, [table_cells(r) for r in rows])
        return
    table = Table(title=title)
    for col, just in COLUMNS:
        # names and numbers never wrap; only the description folds when the terminal is narrow
        table.add_column(col, justify=just, no_wrap=col != "description")  # type: ignore[arg-type]
    for r in rows:
        table.add_row(*table_cells(r))
    console().print(table)


def print_plain(title: str, cells: list[list[str]]) -> None:
    widths = [max(len(c[i]) for c in [[h for h, _ in COLUMNS], *cells]) for i in range(len(COLUMNS))]

    def line(row: list[str]) -> str:
        return "  ".join(v.ljust(w) if just == "left" else v.rjust(w)
                         for v, w, (_, just) in zip(row, widths, COLUMNS)).rstrip()

    print(title)
    print(line([h for h, _ in COLUMNS]))
    for row in cells:
        print(line(row))


def run(args: argparse.Namespace) -> int:
    rows = preset_rows(args.head_dim)
    if args.json == "-":
        json.dump(rows, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    if args.json:
        from kvarn.eval.results import write_json

        write_json(args.json, rows)
    print_table(rows, args.head_dim)
    return 0
