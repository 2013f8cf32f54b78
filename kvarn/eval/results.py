"""Results files and their summaries: JSON (dataclasses, tensors and paths as plain values) and markdown tables."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import torch


def _default(o: Any) -> Any:
    if is_dataclass(o):
        return asdict(o)
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def write_json(path: str | Path, obj: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=_default) + "\n")
    return path


def publish(result: dict, json_path: str | Path, out: str | Path, md: str) -> None:
    """Write an analysis's JSON and its markdown summary (`out`/summary.md), and print the summary."""
    write_json(json_path, result)
    Path(out, "summary.md").write_text(md)
    print(md)


def markdown_table(header: list[str], rows: list[list[Any]], digits: int = 4) -> str:
    """A GitHub markdown table; floats shown with `digits` significant digits."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return "nan" if math.isnan(v) else f"{v:.{digits}g}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
