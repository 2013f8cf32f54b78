"""Which samples a run holds: task names, their sizes, and the samples they make (built lazily, one at a time)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvarn.eval.tasks import humaneval, ruler
from kvarn.eval.tasks.arith import TASK as ARITH
from kvarn.eval.tasks.arith import arith_sample
from kvarn.eval.tasks.base import Sample, encode, rng_for
from kvarn.eval.tasks.retrieval import TASK as LINES
from kvarn.eval.tasks.retrieval import line_sample

TASKS = (LINES, *ruler.TASKS, *humaneval.TASKS, ARITH)
GROUPS = {"ruler": ruler.TASKS, "all": TASKS}


def parse_tasks(text: str) -> list[str]:
    """Comma-separated task names or groups (ruler, all) -> task names in order, duplicates dropped."""
    out: list[str] = []
    for name in (t.strip() for t in text.split(",")):
        if not name:
            continue
        if name in GROUPS:
            out += GROUPS[name]
        elif name in TASKS:
            out.append(name)
        else:
            raise ValueError(f"unknown task {name!r}; available: {', '.join(TASKS)} (groups: {', '.join(GROUPS)})")
    if not out:
        raise ValueError("--tasks is empty")
    return list(dict.fromkeys(out))


@dataclass(frozen=True)
class Plan:
    """The sizes of a run: line counts, RULER lengths (tokens), arithmetic steps, and samples per (task, size)."""

    lines: tuple[int, ...] = (100, 200, 400, 600)
    lengths: tuple[int, ...] = (4096,)
    steps: tuple[int, ...] = (24,)
    samples: int = 10
    seed: int = 0
    haystack: str = "essay"
    context_tokens: int = 3000


@dataclass(frozen=True)
class Slot:
    """One sample to come: its key (known without building it) and how to build it."""

    key: str
    build: Callable[[], Sample]


def humaneval_indices(n: int, seed: int) -> list[int]:
    """A seeded subset of n problems (all 164 when n >= 164), in problem order."""
    total = len(humaneval.problems())
    if n >= total:
        return list(range(total))
    return sorted(rng_for(seed, "humaneval-subset").sample(range(total), n))


def slots(tasks: list[str], plan: Plan, tok) -> Iterator[Slot]:
    def count(s: Sample) -> int:
        return encode(tok, s).shape[1] + s.new_tokens

    def tokens(text: str) -> int:
        return len(tok(text, add_special_tokens=False).input_ids)

    for task in tasks:
        if task == LINES:
            for n in plan.lines:
                for i in range(plan.samples):
                    yield Slot(f"{task}/L={n}/{i}", lambda n=n, i=i: line_sample(n, plan.seed, i))
        elif task in ruler.TASKS:
            for length in plan.lengths:
                for i in range(plan.samples):
                    yield Slot(f"{task}/{length}/{i}", lambda t=task, length=length, i=i:
                               ruler.fit(t, length, plan.seed, i, count, plan.haystack))
        elif task in humaneval.TASKS:
            form = "plain" if task == "humaneval" else "long"
            for i in humaneval_indices(plan.samples, plan.seed):
                yield Slot(f"{task}/{form}/{i}", lambda form=form, i=i: humaneval.humaneval_sample(
                    i, form, plan.seed, tokens, plan.context_tokens))
        elif task == ARITH:
            for steps in plan.steps:
                for i in range(plan.samples):
                    yield Slot(f"{task}/steps={steps}/{i}", lambda steps=steps, i=i: arith_sample(steps, plan.seed, i))
        else:
            raise ValueError(f"unknown task {task!r}")
