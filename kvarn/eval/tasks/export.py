"""kvarn's tasks for lm-evaluation-harness users: `kvarn eval tasks --export-lm-eval DIR` writes, per task and size,
the generated samples (JSONL) and an lm-eval task config (YAML, `generate_until`) whose results are scored by kvarn's
own scorers (`utils.py` -> `kvarn.eval.tasks.score`). Then, offline:

    lm-eval run --model kvarn --model_args pretrained=DIR,preset=P --include_path DIR --tasks kvarn_lines_L100 ...

The answer prefix goes in lm-eval's `gen_prefix` (after the chat template's generation prompt with
--apply_chat_template, else right after the prompt)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

from kvarn.eval.tasks.suite import Slot

UTILS = '''"""Scores lm-eval's generations with kvarn's own scorers (written by kvarn eval tasks --export-lm-eval)."""

from kvarn.eval.tasks.base import Sample
from kvarn.eval.tasks.score import score


def process_results(doc, results):
    sample = Sample(**{**doc, "stop": tuple(doc["stop"])})
    value, correct, _ = score(sample, results[0])
    return {"correct": float(correct), "score": value}
'''


def task_name(task: str, variant: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]+", "", f"kvarn_{task}_{variant}")


def _yaml(name: str, data: Path, until: list[str], new_tokens: int) -> str:
    return "\n".join([
        f"task: {name}", "dataset_path: json", "dataset_kwargs:", "  data_files:", f"    test: {data}",
        "test_split: test", "output_type: generate_until", 'doc_to_text: "{{prompt}}"', 'doc_to_target: "{{gold}}"',
        'gen_prefix: "{{prefix}}"', "process_results: !function utils.process_results", "generation_kwargs:",
        f"  until: {json.dumps(until)}", f"  max_gen_toks: {new_tokens}", "  do_sample: false", "metric_list:",
        *[f"  - metric: {m}\n    aggregation: mean\n    higher_is_better: true" for m in ("correct", "score")], ""])


def export(slots: Iterable[Slot], out: Path) -> list[str]:
    """Write the samples and configs into `out`; the lm-eval task names, in order."""
    out.mkdir(parents=True, exist_ok=True)
    groups: dict[str, list[dict]] = {}
    for slot in slots:
        s = slot.build()
        groups.setdefault(task_name(s.task, s.variant), []).append(asdict(s))
    for name, docs in groups.items():
        data = out / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
        until = sorted({x for d in docs for x in d["stop"]})
        (out / f"{name}.yaml").write_text(_yaml(name, data.resolve(), until, max(d["new_tokens"] for d in docs)))
    (out / "utils.py").write_text(UTILS)
    return list(groups)
