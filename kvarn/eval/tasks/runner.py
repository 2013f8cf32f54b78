"""The resumable loop: every (sample, method, protocol) once, one JSON line appended per result as soon as it is
known (OUT/samples.jsonl); a rerun with the same settings skips the lines already there. The settings that decide
what a line means (model, seed, chunk, haystack, ...) are kept in OUT/run.json, and a rerun with other ones is
refused rather than mixed in."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from kvarn.eval.lines import eos_ids
from kvarn.eval.progress import progress
from kvarn.eval.tasks.base import Sample, encode, encode_gold
from kvarn.eval.tasks.protocol import run_sample
from kvarn.eval.tasks.score import score
from kvarn.eval.tasks.suite import Slot
from kvarn.eval.tasks.vllm_protocol import VLLM

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
            max_context: int | None = None, model_path: str | None = None,
            engine_dtype: str | None = None, engine_per_sample: bool = False) -> list[dict]:
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
    engine = [u for u in todo if u[2] == VLLM]
    todo = [u for u in todo if u[2] != VLLM]
    built: dict[str, tuple[Sample, Any, Any]] = {}
    path = out / SAMPLES
    if engine:
        _run_engines(model, tok, engine, path, chunk=chunk, gold=gold, sink=sink, max_context=max_context, eos=eos,
                     model_path=model_path or model.config._name_or_path, dtype=engine_dtype,
                     per_sample=engine_per_sample)
    with path.open("a", encoding="utf-8") as f, progress(total=len(todo), desc="tasks", unit="run") as bar:
        for slot, method, protocol in todo:
            if slot.key not in built:
                built.clear()  # one sample at a time (samples come in order)
                sample = slot.build()
                ids = encode(tok, sample)
                built[slot.key] = (sample, ids, encode_gold(tok, sample) if gold else None)
            sample, ids, gold_ids = built[slot.key]
            check_context(sample, ids, max_context)
            bar.set_postfix_str(f"{sample.key} {method} {protocol}", refresh=False)
            res = run_sample(model, tok, ids, gold_ids, method, protocol, chunk=chunk, new_tokens=sample.new_tokens,
                             eos=eos, stop=sample.stop, sink=sink)
            f.write(json.dumps(record(sample, method, protocol, ids.shape[1], res)) + "\n")
            f.flush()
            bar.update(1)
    return [r for r in read_records(out) if r["unit"] in wanted]


def check_context(sample: Sample, ids, max_context: int | None) -> None:
    if max_context is not None and ids.shape[1] + sample.new_tokens > max_context:
        raise ValueError(f"{sample.key}: {ids.shape[1]} prompt tokens + {sample.new_tokens} new ones exceed the "
                         f"model's context of {max_context}")


def engine_groups(units: list[tuple[str, Any]], per_sample: bool) -> list[tuple[str, list[Any]]]:
    """(method, item) pairs -> the engines to start, (method, its items) in first-seen order: one per method, or one
    per item (per_sample: nothing an engine decides once, e.g. a budget preset's key widths, is shared)."""
    methods = list(dict.fromkeys(m for m, _ in units))
    groups = [(m, [x for mm, x in units if mm == m]) for m in methods]
    return [(m, [x]) for m, xs in groups for x in xs] if per_sample else groups


def _run_engines(model, tok, units: list[tuple[Slot, str, str]], path: Path, *, chunk: int, gold: bool,
                 sink: int | None, max_context: int | None, eos: set[int], model_path: str,
                 dtype: str | None, per_sample: bool = False) -> None:
    """The vllm protocol's units (`vllm_protocol`): one engine per method over all of its samples (per_sample: one
    per sample and method), the records appended when the engine is done (a rerun skips what is written)."""
    from kvarn.eval.tasks.vllm_protocol import engine_kwargs, kv_budget, missing, run_engine

    why = missing()
    if why:
        raise RuntimeError(why)
    samples: dict[str, tuple[Sample, Any, Any]] = {}
    for slot, _, _ in units:
        if slot.key not in samples:
            sample = slot.build()
            ids = encode(tok, sample)
            check_context(sample, ids, max_context)
            samples[slot.key] = (sample, ids, encode_gold(tok, sample) if gold else None)
    dtype = dtype or str(model.dtype).removeprefix("torch.")
    itemsize = getattr(torch, dtype).itemsize
    groups = engine_groups([(m, samples[s.key]) for s, m, _ in units], per_sample)
    for i, (method, mine) in enumerate(groups):
        lengths = [ids.shape[1] + (0 if g is None else g.numel()) + s.new_tokens for s, ids, g in mine]
        seqs = min(len(mine), 16)
        llm = engine_kwargs(model_path, method, chunk=chunk, max_len=max(lengths) + 8, seqs=seqs, dtype=dtype,
                            sink=sink, kv_bytes=kv_budget(model.config, itemsize,
                                                          sum(sorted(lengths)[-seqs:])))
        print(f"vllm protocol: engine {i + 1}/{len(groups)} ({method}), {len(mine)} samples ...", flush=True)
        requests = [{"prompt": ids[0].tolist(), "max_tokens": s.new_tokens, "stop": list(s.stop),
                     "gold": None if g is None else g.tolist()} for s, ids, g in mine]
        outs = run_engine(method, llm, requests, sorted(eos))
        with path.open("a", encoding="utf-8") as f:
            for (s, ids, _), o in zip(mine, outs, strict=True):
                f.write(json.dumps(record(s, method, VLLM, ids.shape[1], o)) + "\n")
