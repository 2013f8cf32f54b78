"""Evaluation harness: each analysis is a module exposing `COMMAND`, `add_arguments(parser)` and
`run(args)`; `kvarn eval <COMMAND>` discovers them (`analyses()`). Shared pieces, one topic each: `text.py`
(the text read), `options.py` (common flags, seeding), `provenance.py`, `results.py` (JSON, markdown tables),
`progress.py`, `heap.py`, `forward.py` (caches, hooks), `engine.py` (block-by-block runs in lockstep with the
reference), `plots.py` and `schema.py` (with the schemas in `schemas/`); the KL divergences are kvarn.ops.metrics.
`tasks/` is a package holding one analysis (`kvarn eval tasks`, task accuracy; docs/TASKS.md)."""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType


def analyses() -> dict[str, ModuleType]:
    """COMMAND -> module, for every analysis module of this package (sorted by command)."""
    found: dict[str, ModuleType] = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        command = getattr(module, "COMMAND", None)
        if isinstance(command, str) and callable(getattr(module, "add_arguments", None)) \
                and callable(getattr(module, "run", None)):
            found[command] = module
    return dict(sorted(found.items()))
