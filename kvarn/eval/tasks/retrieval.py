"""Line retrieval (LongChat; docs/SPEC.md §6): L lines "line i: REGISTER_CONTENT is <CODE>", CODE 10 random
characters of [A-Z0-9]; the question asks for the code of one line, chosen at 10-90% depth of the record (`kvarn eval
lines` draws it anywhere). Exact match of the last 10-character alphanumeric token of the answer;
32 new tokens (SPEC)."""

from __future__ import annotations

from kvarn.eval.lines import ALPHABET, INTRO
from kvarn.eval.tasks.base import Sample, rng_for

TASK = "lines"
NEW_TOKENS = 32


def line_sample(n_lines: int, seed: int, index: int) -> Sample:
    if n_lines < 10:
        raise ValueError(f"line retrieval needs at least 10 lines (the asked line sits at 10-90% depth), got {n_lines}")
    rng = rng_for(seed, TASK, n_lines, index)
    codes = ["".join(rng.choice(ALPHABET) for _ in range(10)) for _ in range(n_lines)]
    lo, hi = int(0.1 * n_lines), int(0.9 * n_lines)
    asked = rng.randrange(lo, max(hi, lo + 1))
    body = "".join(f"line {i + 1}: REGISTER_CONTENT is <{c}>\n" for i, c in enumerate(codes))
    question = (f"\nNow the record is over. Tell me what is the <REGISTER_CONTENT> in line {asked + 1}? "
                "I need the answer.")
    return Sample(TASK, f"L={n_lines}", index, INTRO + body + question, [codes[asked]],
                  f"The <REGISTER_CONTENT> in line {asked + 1} is <{codes[asked]}>.", "code", NEW_TOKENS,
                  depths=[(asked + 0.5) / n_lines], meta={"lines": n_lines, "line": asked + 1})
