"""Scorers: (score in 0..1, correct, detail) of an answer to a sample.

    code       line retrieval: the last 10-character alphanumeric token equals the code (kvarn.eval.lines.score)
    all        RULER's string_match_all: the share of references found in the answer (case-insensitive);
               correct when every one is
    number     the final integer of the answer equals the reference (kvarn.eval.tasks.arith.final_number)
    humaneval  the program (prompt + completion + tests) passes in the sandbox
"""

from __future__ import annotations

from collections.abc import Callable

from kvarn.eval.lines import score as code_match
from kvarn.eval.tasks.arith import final_number
from kvarn.eval.tasks.base import Sample

Scored = tuple[float, bool, str]


def score_code(sample: Sample, answer: str) -> Scored:
    ok = code_match(answer, sample.refs[0])
    return float(ok), ok, ""


def score_all(sample: Sample, answer: str) -> Scored:
    low = answer.lower()
    found = sum(r.lower() in low for r in sample.refs)
    share = found / len(sample.refs)
    return share, found == len(sample.refs), f"{found}/{len(sample.refs)}"


def score_number(sample: Sample, answer: str) -> Scored:
    got = final_number(answer)
    ok = got is not None and got == sample.refs[0]
    return float(ok), ok, f"final {got}"


def score_humaneval(sample: Sample, answer: str) -> Scored:
    from kvarn.eval.tasks.humaneval import problems, program
    from kvarn.eval.tasks.sandbox import run_program

    r = run_program(program(problems()[sample.index], answer))
    return float(r.passed), r.passed, f"{r.status}: {r.detail}" if r.detail else r.status


SCORERS: dict[str, Callable[[Sample, str], Scored]] = {
    "code": score_code, "all": score_all, "number": score_number, "humaneval": score_humaneval}


def score(sample: Sample, answer: str) -> Scored:
    if sample.scorer not in SCORERS:
        raise ValueError(f"{sample.key}: unknown scorer {sample.scorer!r}; known: {', '.join(SCORERS)}")
    return SCORERS[sample.scorer](sample, answer)
