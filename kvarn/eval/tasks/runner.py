"""The resumable loop: every (sample, method, protocol) once, one JSON line appended per result as soon as it is
known (OUT/samples.jsonl); a rerun with the same settings skips the lines already there. The settings that decide
what a line means (model, seed, chunk, haystack, ...) are kept in OUT/run.json, and a rerun with other ones is
refused rather than mixed in."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from kvarn.eval.lines import eos_ids
from kvarn.eval.progress import progress
from kvarn.eval.tasks.base import Sample, encode, encode_gold
from kvarn.eval.tasks.protocol import run_sample
from kvarn.eval.tasks.score import score
from kvarn.eval.tasks.suite import Slot

SAMPLES, RUN = "samples.jsonl", "run.json"


def unit_key(key: str, method: str, protocol: str) -> str:
    return f"{key}|{method}|{protocol}"


def read_records(out: Path) -> list[dict]:
    """The results appended so far (a torn last line, from a run killed mid-write, is dropped)."""
    path = out / SAMPLES
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def check_settings(out: Path, settings: dict[str, Any]) -> None:
    """Record the settings of a new run; refuse to extend a run made with other ones."""
    path = out / RUN
    if path.exists():
        old = json.loads(path.read_text())
        diff = {k: (old.get(k), v) for k, v in settings.items() if old.get(k) != v}
        if diff:
            raise ValueError(f"{out} holds a run with other settings {diff} (old, new); use another --out or "
                             "remove it to start over")
        return
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=2) + "\n")


def record(sample: Sample, method: str, protocol: str, prompt_tokens: int, out) -> dict:
    s, correct, detail = score(sample, out.answer)
    per_token = out.gold_logprob / out.gold_tokens if out.gold_logprob is not None else None
    return {"unit": unit_key(sample.key, method, protocol), "key": sample.key, "task": sample.task,
            "variant": sample.variant, "index": sample.index, "method": method, "protocol": protocol,
            "prompt_tokens": prompt_tokens, "depths": sample.depths, "refs": sample.refs, "answer": out.answer,
            "generated_tokens": out.tokens, "score": s, "correct": correct, "detail": detail,
            "gold_logprob": out.gold_logprob, "gold_tokens": out.gold_tokens, "gold_logprob_per_token": per_token,
            **out.held, "seconds": out.seconds, "meta": sample.meta}


Work = tuple[Iterable[Slot], Sequence[str], Sequence[str]]  # samples, methods, protocols


def run_all(model, tok, cells: Iterable[Work], out: Path, *, chunk: int, gold: bool = True, sink: int | None = None,
            max_context: int | None = None) -> list[dict]:
    """Run what is not done yet of every cell (its samples x its methods x its protocols), sample by sample (all
    methods of a sample before the next, so a run cut short stays paired); returns the records of these units (old
    and new), in file order."""
    cells = [(list(slots), list(methods), list(protocols)) for slots, methods, protocols in cells]
    wanted = {unit_key(s.key, m, p) for slots, methods, protocols in cells for s in slots for m in methods
              for p in protocols}
    done = {r["unit"] for r in read_records(out)}  # grows below: a unit in two cells runs once
    todo = []
    for slots, methods, protocols in cells:
        for s in slots:
            for m in methods:
                for p in protocols:
                    if unit_key(s.key, m, p) not in done:
                        done.add(unit_key(s.key, m, p))
                        todo.append((s, m, p))
    eos = eos_ids(model, tok)
    built: dict[str, tuple[Sample, Any, Any]] = {}
    path = out / SAMPLES
    with path.open("a", encoding="utf-8") as f, progress(total=len(todo), desc="tasks", unit="run") as bar:
        for slot, method, protocol in todo:
            if slot.key not in built:
                built.clear()  # one sample at a time (samples come in order)
                sample = slot.build()
                ids = encode(tok, sample)
                if max_context is not None and ids.shape[1] + sample.new_tokens > max_context:
                    raise ValueError(f"{sample.key}: {ids.shape[1]} prompt tokens + {sample.new_tokens} new ones "
                                     f"exceed the model's context of {max_context}")
                built[slot.key] = (sample, ids, encode_gold(tok, sample) if gold else None)
            sample, ids, gold_ids = built[slot.key]
            bar.set_postfix_str(f"{sample.key} {method} {protocol}", refresh=False)
            res = run_sample(model, tok, ids, gold_ids, method, protocol, chunk=chunk, new_tokens=sample.new_tokens,
                             eos=eos, stop=sample.stop, sink=sink)
            f.write(json.dumps(record(sample, method, protocol, ids.shape[1], res)) + "\n")
            f.flush()
            bar.update(1)
    return [r for r in read_records(out) if r["unit"] in wanted]
