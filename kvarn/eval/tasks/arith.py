"""Long-generation arithmetic: a running value through `steps` operations (add, subtract, multiply by 2-9, integer
halving), solved step by step, so the chain of thought runs to several hundred generated tokens and every step reads
the earlier ones through the cache (the setting in which errors snowball). Values stay in 0..9999. The answer is
the last integer after "Answer:" (else the last integer of the reply); the gold answer is the worked solution in
the format the prompt asks for.
"""

from __future__ import annotations

import re

from kvarn.eval.tasks.base import Sample, rng_for

TASK = "arith"
ANSWER = re.compile(r"Answer:\s*(-?\d+)")
INTEGER = re.compile(r"-?\d+")


def _ops(rng, steps: int, start: int) -> list[tuple[str, int, int]]:
    """(phrase, operand, result) per step."""
    x, out = start, []
    for _ in range(steps):
        choices = ["add", "subtract", "multiply", "halve"]
        if x > 999:
            choices = ["subtract", "halve"]
        op = rng.choice(choices)
        if op == "add":
            n = rng.randint(11, 99)
            x2 = x + n
        elif op == "subtract":
            n = rng.randint(1, min(x, 99)) if x > 0 else 0
            x2 = x - n
        elif op == "multiply":
            n = rng.randint(2, 9)
            x2 = x * n
        else:
            n, x2 = 2, x // 2
        out.append((op, n, x2))
        x = x2
    return out


PHRASE = {"add": "add {n}", "subtract": "subtract {n}", "multiply": "multiply by {n}",
          "halve": "divide by 2, rounding down"}
SYMBOL = {"add": "{x} + {n} = {y}", "subtract": "{x} - {n} = {y}", "multiply": "{x} * {n} = {y}",
          "halve": "{x} // 2 = {y}"}


def arith_sample(steps: int, seed: int, index: int) -> Sample:
    if steps < 1:
        raise ValueError(f"arithmetic needs at least one step, got {steps}")
    rng = rng_for(seed, TASK, steps, index)
    start = rng.randint(10, 99)
    ops = _ops(rng, steps, start)
    listing = "\n".join(f"{i + 1}. {PHRASE[op].format(n=n)}" for i, (op, n, _) in enumerate(ops))
    prompt = (f"Start with the number {start}. Apply the following {steps} operations in order:\n{listing}\n\n"
              "Work step by step: for each operation write one line 'Step i: <calculation> = <result>'. "
              "After the last step write 'Answer: <final number>'.")
    lines, x = [], start
    for i, (op, n, y) in enumerate(ops):
        lines.append(f"Step {i + 1}: {SYMBOL[op].format(x=x, n=n, y=y)}")
        x = y
    gold = "\n".join(lines) + f"\nAnswer: {x}"
    return Sample(TASK, f"steps={steps}", index, prompt, [str(x)], gold, "number", 16 * steps + 32,
                  meta={"steps": steps})


def final_number(answer: str) -> str | None:
    found = ANSWER.findall(answer)
    if found:
        return found[-1]
    found = INTEGER.findall(answer)
    return found[-1] if found else None
