"""Named runs of `kvarn eval tasks --plan NAME`: tasks, sizes, methods and sample counts in one place, so the tables
in docs/TASKS.md come from one command each and a rerun resumes them.

    ci       the CI subset (tests/eval/test_tasks_model.py): 3 easy needles at 1k tokens, full precision and the
             default preset; a few minutes with the model fetch
    main     the main table: one task per family at ~4k tokens (multi-key needle, variable tracking, HumanEval after
             ~3k tokens of solved problems, 24-step arithmetic) x full precision, KIVI-2, the default, k4v2
    presets  every method of today (kvarn's presets, the paper's baselines, transformers' QuantizedCache anchors)
             on the main table's retrieval task
    presets-1k  every method on the CI subset's task (one needle in the essays at 1k tokens), 10 samples: the
             quick look (under an hour here)
    lines    the line-retrieval curve of the paper's figure: 100, 200, 400, 600 lines x the main table's methods,
             under both protocols (serving and generate)
    copy     the copying tasks where 2-bit keys lose first: RULER's niah_multikey_2 (near-identical key lines) at 4k
             tokens and line retrieval at 20 and 50 lines (full precision answers some) x full precision, the
             default, its query-aware variant, k4v2 and kvarn-b2.5-qar; 10 samples (docs/TASKS.md, seventh session)
    full     main + presets + lines, one output folder

Samples per cell are what fits on the machine of docs/TASKS.md; `--samples N` overrides every cell's count (a
larger N extends a finished run: the samples already done are skipped, the new ones appended).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvarn.eval.tasks.suite import Plan
from kvarn.presets import DEFAULT_PRESET

FULL = "dynamic"
KIVI = "kivi-k2v2-g128"
K4V2 = "kvarn-auto-k4v2-g128"
MAIN_METHODS = (FULL, KIVI, DEFAULT_PRESET, K4V2)
COPY_METHODS = (FULL, DEFAULT_PRESET, "kvarn-auto-k2v2-g128-qar", K4V2, "kvarn-b2.5-qar")
ALL_METHODS = (FULL, "rtn-k2v2-g128", KIVI, "quarot-k2v2", "kvarn-k2v2-g128", DEFAULT_PRESET, K4V2,
               "quanto-2bit", "hqq-2bit")


@dataclass(frozen=True)
class Cell:
    """Tasks x sizes (`plan`) x methods x protocols: one block of a named run."""

    tasks: tuple[str, ...]
    methods: tuple[str, ...]
    plan: Plan
    protocols: tuple[str, ...] = ("serving",)


def _main(samples: int) -> tuple[Cell, ...]:
    at4k = Plan(lengths=(4096,), steps=(24,), samples=samples, context_tokens=3000)
    return (Cell(("niah_multikey_1", "vt", "humaneval_long", "arith"), MAIN_METHODS, at4k),)


PLANS: dict[str, tuple[Cell, ...]] = {
    "ci": (Cell(("niah_single_2",), (FULL, DEFAULT_PRESET), Plan(lengths=(1024,), samples=3)),),
    "main": _main(20),
    "presets": (Cell(("niah_multikey_1",), ALL_METHODS, Plan(lengths=(4096,), samples=20)),),
    "presets-1k": (Cell(("niah_single_2",), ALL_METHODS, Plan(lengths=(1024,), samples=10)),),
    "lines": (Cell(("lines",), MAIN_METHODS, Plan(lines=(100, 200, 400, 600), samples=10), ("serving", "generate")),),
    "copy": (Cell(("niah_multikey_2",), COPY_METHODS, Plan(lengths=(4096,), samples=10)),
             Cell(("lines",), COPY_METHODS, Plan(lines=(20, 50), samples=10))),
}
PLANS["full"] = PLANS["main"] + PLANS["presets"] + PLANS["lines"]  # presets-1k stays apart: another size


def plan_cells(name: str, *, samples: int | None = None, seed: int = 0, haystack: str = "essay") -> tuple[Cell, ...]:
    """The cells of a named run, with the run's seed and haystack (and `samples`, where given, in every cell); the
    protocols are the plan's (`--protocols` applies to runs without a plan)."""
    if name not in PLANS:
        raise ValueError(f"unknown plan {name!r}; available: {', '.join(PLANS)}")
    out = []
    for cell in PLANS[name]:
        plan = replace(cell.plan, seed=seed, haystack=haystack, samples=samples or cell.plan.samples)
        out.append(replace(cell, plan=plan))
    return tuple(out)
