"""`kvarn bench`: the sections, their full and --quick settings, and one run that writes JSON, plots and markdown."""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import torch

from kvarn.presets import DEFAULT_PRESET, get_preset

SECTIONS = ("attention", "e2e", "store", "memory", "vllm")  # vllm: only where vLLM is installed (.venv-vllm)
KVARN_CACHES = ["kvarn-k2v2-g128", "kvarn-auto-k2v2-g128", "kvarn-k4v2-g128"]
CACHES = ",".join(["dynamic", "static", "quanto-2bit", "hqq-2bit",
                   *dict.fromkeys([*KVARN_CACHES, get_preset(DEFAULT_PRESET).name])])

# option -> (full run, --quick); every option left unset takes one of these
SETTINGS: dict[str, tuple[object, object]] = {
    "shapes": ("smollm2,qwen3-4b", "smollm2,qwen3-4b"),
    "batches": ("1,8", "1,8"),
    "attn_contexts": ("1024,8192,32768", "1024,8192"),
    "attn_presets": ("kvarn-k2v2-g128,kvarn-auto-k2v2-g128", "kvarn-k2v2-g128"),
    "attn_rounds": (7, 3),
    "e2e_contexts": ("1024,4096,8192", "1024,4096"),
    "caches": (CACHES, CACHES),
    "steps": (32, 16),
    "warmup": (2, 1),
    "store_presets": ("kvarn-k2v2-g128,kvarn-auto-k2v2-g128", "kvarn-k2v2-g128,kvarn-auto-k2v2-g128"),
    "store_context": (1024, 1024),
    "store_rounds": (15, 5),
    "mem_contexts": ("8192", "1024"),
    "mem_steps": (8, 4),
    "vllm_presets": ("kvarn-k2v2-g128,kvarn-k4v2-g128,kvarn-auto-k2v2-g128", "kvarn-k2v2-g128,kvarn-auto-k2v2-g128"),
    "vllm_requests": ("8,32", "8"),
    "vllm_prompt_tokens": ("512,2048", "256"),
    "vllm_new_tokens": (128, 64),
    "vllm_kv_gib": (4.0, 1.0),
    "vllm_mem_requests": (32, 12),
    "vllm_mem_prompt_tokens": (2048, 1024),
    "vllm_mem_new_tokens": (256, 32),
    "vllm_mem_kv_mib": ("128,212,424", "64"),
    "vllm_mem_max_num_seqs": (16, 8),
    "vllm_dtype": ("auto", "auto"),
    "vllm_rounds": (1, 1),
}
HELP = {
    "shapes": "attention head shapes (smollm2 = 9 q / 3 KV heads x 64; qwen3-4b = 32 q / 8 KV x 128)",
    "batches": "attention batch sizes", "attn_contexts": "attention context lengths",
    "attn_presets": "kvarn presets timed in the attention section", "attn_rounds": "attention timed rounds",
    "e2e_contexts": "end-to-end prefill lengths", "caches": "end-to-end and memory caches (baselines: dynamic, "
    "static, quanto-2bit, hqq-2bit; anything else is a kvarn preset)", "steps": "end-to-end timed decode steps",
    "warmup": "untimed warm-up calls/steps per contender", "store_presets": "store-section presets",
    "store_context": "context of the decode steps the store is compared with", "store_rounds": "store timed rounds",
    "mem_contexts": "memory-section prefill lengths", "mem_steps": "memory-section decode steps",
    "vllm_presets": "kvarn presets served by vLLM beside stock vLLM",
    "vllm_requests": "equal-batch runs: concurrent requests (= max_num_seqs)",
    "vllm_prompt_tokens": "equal-batch runs: prompt tokens per request",
    "vllm_new_tokens": "equal-batch runs: greedy tokens per request",
    "vllm_kv_gib": "equal-batch runs: KV budget (GiB) of every engine, enough for the whole batch",
    "vllm_mem_requests": "memory-bound runs: requests queued at once (0: no memory-bound run)",
    "vllm_mem_prompt_tokens": "memory-bound runs: prompt tokens per request",
    "vllm_mem_new_tokens": "memory-bound runs: greedy tokens per request",
    "vllm_mem_kv_mib": "memory-bound runs: KV budgets (MiB), one run each; the defaults are doubled for float32 "
                       "engines",
    "vllm_mem_max_num_seqs": "memory-bound runs: vLLM max_num_seqs",
    "vllm_dtype": "the model's dtype in every engine, stock and kvarn alike (auto: bfloat16 on a CPU with native "
                  "bf16, else float32; bfloat16, float16, float32)",
    "vllm_rounds": "every engine that many times, in rounds (stock, presets, stock, ...); ratios: the rounds' median",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="the short settings (whole `all` run: minutes)")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="write every figure here")
    p.add_argument("--plots", type=Path, default=None, metavar="DIR", help="write PNG plots here")
    p.add_argument("--markdown", type=Path, default=None, metavar="FILE",
                   help="replace the generated block of this markdown file (docs/BENCHMARKS.md)")
    p.add_argument("--note", default=None, help="a line printed above the tables in the markdown")
    p.add_argument("--model", default="default", help="model for e2e/store/memory (default: embedded SmolLM2)")
    p.add_argument("--text", default=None, help="text file for the prompts (default: kvarn's default text)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    for name, (full, quick) in SETTINGS.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(full), default=None,
                       help=f"{HELP[name]} (default {full}; --quick {quick})")


def _settings(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) if getattr(args, k) is not None else v[args.quick] for k, v in SETTINGS.items()}


def _ints(text: str) -> list[int]:
    from kvarn.eval.options import int_list

    return int_list(text)


def _floats(text: str) -> list[float]:
    try:
        out = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated numbers, got {text!r}") from None
    if not out or any(x <= 0 for x in out):
        raise ValueError(f"expected positive numbers, got {text!r}")
    return out


def _names(text: str) -> list[str]:
    names = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))  # a repeated name runs once
    if not names:
        raise ValueError("empty list")
    return names


def command_line(args: argparse.Namespace, sections: list[str]) -> str:
    """The command that reproduces this run (options given explicitly, in canonical form)."""
    parts = ["kvarn bench", "all" if len(sections) > 1 else sections[0]]
    if args.quick:
        parts.append("--quick")
    for k in ("json", "plots", "markdown", "model", "text", "threads", *SETTINGS):
        v = getattr(args, k)
        if v is not None and not (k == "model" and v == "default"):
            parts.append(f"--{k.replace('_', '-')} {v}")
    return " ".join(parts)


def run(args: argparse.Namespace, sections: list[str]) -> dict:
    from kvarn.bench.targets import check_targets
    from kvarn.eval.heap import release_freed_buffers
    from kvarn.eval.provenance import provenance
    from kvarn.eval.results import write_json
    from kvarn.eval.text import load_tokens

    if args.threads:
        torch.set_num_threads(args.threads)
    release_freed_buffers()
    s = _settings(args)
    if "vllm" in sections and len(sections) > 1:  # `all`: the vllm section only where vLLM is installed
        from kvarn.bench.vllm import missing

        why = missing()
        if why is not None:
            print(f"kvarn bench all: skipping the vllm section: {why}", file=sys.stderr)
            sections = [x for x in sections if x != "vllm"]
    t0 = time.perf_counter()
    out: dict = {"command": command_line(args, sections), "quick": args.quick, "note": args.note,
                 "provenance": provenance(**s, model=args.model, text=args.text or "default"), "sections": {}}
    model = tok = None
    if set(sections) & {"e2e", "store", "memory"}:
        from kvarn.models import load_model

        model, tok = load_model(args.model)

    def load_ids(n: int) -> torch.Tensor:
        return load_tokens(tok, args.text, n)

    for section in sections:
        if section == "attention":
            from kvarn.bench.attention import bench_attention
            from kvarn.bench.targets import TARGET_CONTEXT

            ctx = _ints(s["attn_contexts"])
            out["sections"]["attention"] = bench_attention(
                _names(s["shapes"]), _ints(s["batches"]), ctx, _names(s["attn_presets"]), s["attn_rounds"],
                s["warmup"], profile_context=TARGET_CONTEXT if TARGET_CONTEXT in ctx else max(ctx))
        elif section == "e2e":
            from kvarn.bench.e2e import bench_e2e

            out["sections"]["e2e"] = bench_e2e(model, load_ids, _ints(s["e2e_contexts"]), _names(s["caches"]),
                                               s["steps"], s["warmup"], profile="kvarn-k2v2-g128")
        elif section == "store":
            from kvarn.bench.store import bench_store

            out["sections"]["store"] = bench_store(model, load_ids, _names(s["store_presets"]), s["store_context"],
                                                   s["store_rounds"], s["warmup"])
        elif section == "memory":
            from kvarn.bench.footprint import bench_memory

            out["sections"]["memory"] = bench_memory(args.model, load_ids, _ints(s["mem_contexts"]),
                                                     _names(s["caches"]), s["mem_steps"])
        elif section == "vllm":
            from kvarn.bench.vllm import (
                bench_vllm,
                check_dtype,
                check_rounds,
                mem_budget_scale,
                missing,
                resolve_dtype,
                scenarios,
            )

            check_dtype(s["vllm_dtype"])  # bad input first, vLLM or not
            check_rounds(s["vllm_rounds"])
            why = missing()
            if why is not None:
                raise ValueError(why)
            dtype = resolve_dtype(s["vllm_dtype"])
            mem_mib = _floats(s["vllm_mem_kv_mib"])
            if args.vllm_mem_kv_mib is None:  # the defaults hold ~4 of stock's 16-bit sequences: as many in float32
                mem_mib = [m * mem_budget_scale(dtype) for m in mem_mib]
            why_dtype = f" (auto: this CPU {'has' if dtype == 'bfloat16' else 'lacks'} native bf16)" \
                if s["vllm_dtype"] == "auto" else ""
            print(f"kvarn bench vllm: dtype {dtype}{why_dtype}", file=sys.stderr, flush=True)
            if tok is None:
                from transformers import AutoTokenizer

                from kvarn.models import resolve

                tok = AutoTokenizer.from_pretrained(str(resolve(args.model)))
            runs = scenarios(_ints(s["vllm_requests"]), _ints(s["vllm_prompt_tokens"]), s["vllm_new_tokens"],
                             s["vllm_kv_gib"], s["vllm_mem_requests"], s["vllm_mem_prompt_tokens"],
                             s["vllm_mem_new_tokens"], mem_mib, s["vllm_mem_max_num_seqs"])
            out["sections"]["vllm"] = bench_vllm(args.model, functools.partial(load_tokens, tok, args.text),
                                                 _names(s["vllm_presets"]), runs, s["vllm_dtype"], s["vllm_rounds"])
        if args.json:  # after every section, so a long run that stops early keeps what it measured
            write_json(args.json, out | {"targets": check_targets(out), "wall_s": time.perf_counter() - t0})
    out["targets"] = check_targets(out)
    out["wall_s"] = time.perf_counter() - t0
    if args.json:
        write_json(args.json, out)
    publish(out, args.plots, args.markdown)
    return out


def publish(result: dict, plots: Path | None, markdown: Path | None) -> None:
    """Print the tables; write the plots and the generated block of the markdown file, if asked."""
    from kvarn.bench import report

    report.print_tables(result)
    images = report.plots(result, plots) if plots else []
    if markdown:
        report.write_markdown(markdown, report.markdown(result, images, markdown.parent))


def render(path: Path, plots: Path | None, markdown: Path | None) -> dict:
    """Tables, plots and markdown from a bench JSON already written (no measuring)."""
    import json

    from kvarn.bench.targets import check_targets

    if not path.exists():
        raise ValueError(f"no bench JSON at {path}")
    result = json.loads(path.read_text())
    result["targets"] = check_targets(result)
    publish(result, plots, markdown)
    return result
