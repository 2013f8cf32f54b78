"""RULER-style synthetic tasks (Hsieh et al. 2024; templates, needle format and task settings as in RULER's
`synthetic.yaml` and `constants.py`), generated here from a seed so they run offline:

    niah_single_1     repeat haystack, word key, 7-digit number     niah_multikey_1  essay, 4 keys, ask 1
    niah_single_2     essay haystack, word key, number              niah_multikey_2  haystack of other needles
    niah_single_3     essay haystack, word key, UUID                niah_multikey_3  needle haystack, UUID keys/values
    niah_multivalue   essay, 1 key with 4 values                    niah_multiquery  essay, 4 keys, ask all 4
    vt                variable tracking: 1 chain of 4 hops in noise, one short worked example first (RULER's few-shot)
    cwe               common-words extraction: 10 words 30 times among others 3 times, with one short worked example

The variant is the length in tokens the sample is built to fill (prompt + answer <= length, with the model's own
tokenizer). Needles, chain links sit at 10-90% depth (RULER: 0-100%). Scoring is RULER's string_match_all: the share
of references that appear in the answer (case-insensitive); a sample is correct when all do. Departures from RULER:
the depths, sizes refined below RULER's increments so samples fill the length, sentence splitting by punctuation (not
nltk), key words from a built-in adjective-noun list (not wonderwords), and the essay haystack replaced by a
synthetic one where the essays are not installed.
"""

from __future__ import annotations

import random
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from kvarn.eval.tasks import haystack as hs
from kvarn.eval.tasks.base import Sample, depths_between, rng_for

NIAH = ("Some special magic {type_v} are hidden within the following text. Make sure to memorize it. I will quiz you "
        "about the {type_v} afterwards.\n{context}\nWhat are all the special magic {type_v} for {query} mentioned in "
        "the provided text?")
NIAH_PREFIX = " The special magic {type_v} for {query} mentioned in the provided text are"
NEEDLE = "One of the special magic {type_v} for {key} is: {value}."
VT = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\nQuestion: "
      "Find all variables that are assigned the value {query} in the text above.")
VT_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
             "assgined the value {query}, they are: ")  # RULER's spelling
CWE = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that "
       "appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?")
CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"


@dataclass(frozen=True)
class Niah:
    haystack: str  # "essay" (real text; synthetic where missing), "repeat" or "needle"
    key: str = "words"
    value: str = "numbers"
    keys: int = 1
    values: int = 1
    queries: int = 1


NIAH_TASKS = {
    "niah_single_1": Niah("repeat"), "niah_single_2": Niah("essay"), "niah_single_3": Niah("essay", value="uuids"),
    "niah_multikey_1": Niah("essay", keys=4), "niah_multikey_2": Niah("needle"),
    "niah_multikey_3": Niah("needle", key="uuids", value="uuids"),
    "niah_multivalue": Niah("essay", values=4), "niah_multiquery": Niah("essay", keys=4, queries=4),
}
NEW_TOKENS = {"niah": 128, "vt": 30, "cwe": 120}  # RULER's tokens_to_generate
TASKS = (*NIAH_TASKS, "vt", "cwe")


def _random(kind: str, rng: random.Random) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        return rng.choice(hs.key_words())
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _insert(units: list[str], items: list[str], depths: list[float]) -> list[str]:
    """Insert items (in order) into units at the given sorted depths."""
    out, last = [], 0
    for item, d in zip(items, depths):
        at = round(d * len(units))
        out += [*units[last:at], item]
        last = at
    return out + units[last:]


def niah(spec: Niah, size: int, seed: int, index: int, hay: str, variant: str, name: str) -> Sample:
    """One needle sample with `size` haystack units (words of the essay, noise sentences or distractor needles)."""
    rng = rng_for(seed, name, variant, index)
    n_keys = max(spec.keys, spec.queries)
    keys, values, needles = [], [], []
    for _ in range(n_keys):
        keys.append(_random(spec.key, rng))
        values.append([_random(spec.value, rng) for _ in range(spec.values)])
        needles += [NEEDLE.format(type_v=spec.value, key=keys[-1], value=v) for v in values[-1]]
    rng.shuffle(needles)
    depths = depths_between(rng, len(needles))
    if spec.haystack == "essay":
        units = hs.sentences(hs.haystack_words(hay, size, seed))
        context = " ".join(_insert(units, needles, depths))
    else:
        units = ([hs.NOISE] * size if spec.haystack == "repeat" else
                 [NEEDLE.format(type_v=spec.value, key=_random(spec.key, rng), value=_random(spec.value, rng))
                  for _ in range(size)])
        context = "\n".join(_insert(units, needles, depths))
    asked = rng.sample(range(n_keys), spec.queries)
    queries = [keys[i] for i in asked]
    refs = [v for i in asked for v in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    template, prefix, type_v = NIAH, NIAH_PREFIX, spec.value
    if spec.queries * spec.values == 1:  # RULER's singular wording
        template = template.replace("Some", "A").replace("are all", "is").replace("are", "is")
        prefix, type_v = prefix.replace("are", "is"), type_v[:-1]
    gold = " " + ", ".join(refs) + "."
    return Sample(name, variant, index, template.format(type_v=type_v, context=context, query=query), refs, gold,
                  "all", NEW_TOKENS["niah"], prefix.format(type_v=type_v, query=query), depths=depths,
                  meta={"haystack": hay if spec.haystack == "essay" else spec.haystack, "units": size})


def _chain(rng: random.Random, hops: int) -> tuple[list[str], list[str], str]:
    names: list[str] = []
    while len(names) < hops + 1:
        v = "".join(rng.choices(string.ascii_uppercase, k=5))
        if v not in names:
            names.append(v)
    value = str(rng.randint(10000, 99999))
    links = [f"VAR {names[0]} = {value}", *[f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(hops)]]
    return names, links, value


def _vt_text(rng: random.Random, noises: int, hops: int) -> tuple[str, list[str], str, list[float]]:
    names, links, value = _chain(rng, hops)
    depths = depths_between(rng, len(links))
    context = " ".join(_insert([hs.NOISE + "\n"] * noises, links, depths)).replace(". \n", ".\n")
    return VT.format(context=context, query=value), names, value, depths


def vt(size: int, seed: int, index: int, variant: str, hops: int = 4) -> Sample:
    """Variable tracking with `size` noise lines; one worked example of 5 noise lines first (RULER's few-shot)."""
    rng = rng_for(seed, "vt", variant, index)
    ex_text, ex_names, ex_value, _ = _vt_text(rng, 5, hops)
    example = ex_text + VT_PREFIX.format(num_v=hops + 1, query=ex_value) + " ".join(ex_names) + "\n\n"
    text, names, value, depths = _vt_text(rng, size, hops)
    return Sample("vt", variant, index, example + text, names, " ".join(names), "all", NEW_TOKENS["vt"],
                  VT_PREFIX.format(num_v=hops + 1, query=value), depths=depths, meta={"units": size})


def _cwe_list(rng: random.Random, n_words: int, common: int, rep_common: int, rep_rare: int) -> tuple[str, list[str]]:
    pool = hs.word_pool()
    if n_words > len(pool):
        raise ValueError(f"common-words extraction asked for {n_words} distinct words; the pool holds {len(pool)}")
    chosen = rng.sample(pool, n_words)
    top = chosen[:common]
    words = top * rep_common + chosen[common:] * rep_rare
    rng.shuffle(words)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words)), top


def cwe(size: int, seed: int, index: int, variant: str) -> Sample:
    """`size` distinct words: 10 common ones 30 times, the others 3 times, after one worked example of 40 words (RULER
    at >= 4k tokens; below, as RULER: 6 and 1 times, the example of 20 words 3 and 1 times)."""
    rng = rng_for(seed, "cwe", variant, index)
    short = variant.isdigit() and int(variant) < 4096
    ex_context, ex_top = _cwe_list(rng, 20, 10, 3, 1) if short else _cwe_list(rng, 40, 10, 10, 3)
    example = CWE.format(context=ex_context) + CWE_PREFIX + " " + " ".join(f"{i + 1}. {w}" for i, w in
                                                                           enumerate(ex_top)) + "\n"
    context, top = _cwe_list(rng, max(size, 11), 10, *((6, 1) if short else (30, 3)))
    gold = " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(top))
    return Sample("cwe", variant, index, example + CWE.format(context=context), top, gold, "all",
                  NEW_TOKENS["cwe"], CWE_PREFIX, meta={"units": size})


def builder(name: str, hay: str, length: int) -> tuple[Callable[[int, int, int, str], Sample], int, int | None]:
    """(build(size, seed, index, variant), the step of sizes, the largest size or None) of task `name` at `length`
    tokens."""
    if name in NIAH_TASKS:
        spec = NIAH_TASKS[name]
        step = 500 if spec.haystack == "essay" else 25 if length >= 4096 else 5  # RULER's increments
        top = len(hs.essay_words()) if spec.haystack == "essay" and hay == "essay" else None
        return (lambda size, seed, index, variant: niah(spec, size, seed, index, hay, variant, name)), step, top
    if name == "vt":
        return vt, 10, None
    if name == "cwe":
        return cwe, 10, len(hs.word_pool())
    raise ValueError(f"unknown RULER task {name!r}; available: {', '.join(TASKS)}")


def fit(name: str, length: int, seed: int, index: int, count: Callable[[Sample], int], hay: str) -> Sample:
    """The largest sample of task `name` whose prompt plus answer tokens (`count`) fit in `length` tokens."""
    build, step, top = builder(name, hay, length)
    variant = str(length)

    def make(size: int) -> Sample:
        return build(size, seed, index, variant)

    size = step
    s = make(size)
    if count(s) > length:
        raise ValueError(f"{name}: even the smallest sample takes {count(s)} tokens, more than {length}")
    for _ in range(8):  # grow from the measured tokens per unit while the guess fits
        guess = int(size * length / count(s)) // step * step
        if top is not None:
            guess = min(guess, top)
        if guess <= size:
            break
        t = make(guess)
        if count(t) > length:
            break
        size, s = guess, t
    while step >= 1:  # then RULER's increments until the next would not fit, then halved ones (RULER stops there)
        if top is not None and size + step > top:
            step //= 2
            continue
        t = make(size + step)
        if count(t) > length:
            step = step // 2 if step > 1 else 0
            continue
        size, s = size + step, t
    return s
