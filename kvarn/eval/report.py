"""`kvarn eval report`: run a suite of analyses and write one markdown report with all tables and plots.

The suite comes from `--config FILE` (JSON) and/or flags. Config layout:

    {"model": "default", "text": null, "methods": "rtn,kvarn-k2v2-g128", "seed": 0, "sink": null,
     "analyses": {"pseudo-decode": {"max-len": 4096}, "decompose": {"max-len": 4096, "methods": "rtn"}, ...}}

Top-level keys are common options, given to every analysis that has them; keys under an analysis are its own
options (the names of its flags without "--"; lists are joined with commas, true adds a bare flag) and
override the common ones. Flags given to `report` (--model, --text, --methods, --seed, --sink, --threads) override
the config's common options; --analyses picks and orders the analyses (default: the config's, else all).
Each analysis is parsed by its own parser, so its validation applies, and writes into OUT/<analysis>/.
OUT/report.md gathers their summaries and plots with the wall time of each; OUT/report.json records the
config, timings and provenance. `--replot` redraws plots, summaries and report.md from the JSON files of a
finished report without running anything (after a change to the plots or tables).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from kvarn.eval.provenance import provenance
from kvarn.eval.results import markdown_table, write_json
from kvarn.eval.schema import has_schema, load_schema, validate
from kvarn.eval.text import DEFAULT_TEXT

COMMAND = "report"
HELP = "run a suite of analyses (flags or a JSON config) and write one markdown report"
DEFAULT_ANALYSES = ("pseudo-decode", "decompose", "outliers", "ppl", "lines")
COMMON = ("model", "text", "methods", "seed", "sink", "threads")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="JSON suite config (see `kvarn eval report --help`)")
    parser.add_argument("--analyses", default=None, help=f"comma-separated (default: {','.join(DEFAULT_ANALYSES)})")
    parser.add_argument("--model", default=None, help="named model, HF id or folder (default: embedded SmolLM2)")
    parser.add_argument("--text", default=None, help=f"text file (default: {DEFAULT_TEXT})")
    parser.add_argument("--methods", default=None, help="comma-separated presets (default: each analysis's)")
    parser.add_argument("--seed", type=int, default=None, help="seed (default: 0)")
    parser.add_argument("--sink", type=int, default=None, help="override every preset's sink")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--out", default="out/eval/report", help="output folder (default: out/eval/report)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="analyses run at once, each in its own process (default: 1; 2 uses both cores of a "
                             "2-core machine with --threads 1)")
    parser.add_argument("--replot", action="store_true",
                        help="run nothing: redraw plots, summaries and report.md from the JSON files already in --out "
                             "(analyses whose plots need more than their JSON, like decompose, keep theirs)")


def load_config(path: str | None) -> dict:
    if path is None:
        return {}
    p = Path(path)
    if not p.exists():
        raise ValueError(f"config file not found: {p}")
    try:
        cfg = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"config {p} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"config {p} must hold a JSON object")
    unknown = set(cfg) - {*COMMON, "analyses"}
    if unknown:
        raise ValueError(f"config {p}: unknown keys {sorted(unknown)}; allowed: {', '.join((*COMMON, 'analyses'))}")
    return cfg


def to_argv(options: dict[str, Any], parser: argparse.ArgumentParser, strict: bool, where: str) -> list[str]:
    """{"max-len": 4096, "lines": [20, 40], "flag": true} -> ["--max-len", "4096", "--lines", "20,40", "--flag"]."""
    known = parser._option_string_actions
    argv: list[str] = []
    for key, value in options.items():
        flag = f"--{key}"
        if flag not in known:
            if strict:
                raise ValueError(f"{where}: unknown option {key!r}")
            continue
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        else:
            argv += [flag, ",".join(map(str, value)) if isinstance(value, list) else str(value)]
    return argv


def analysis_parser(name: str, module: Any) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"kvarn eval {name}")
    module.add_arguments(parser)
    return parser


def plan(args: argparse.Namespace) -> list[tuple[str, argparse.Namespace, Any, list[str]]]:
    """(analysis, parsed args, module, its command line) for each analysis of the suite, in order."""
    from kvarn.eval import analyses

    cfg = load_config(args.config)
    found = {k: v for k, v in analyses().items() if k != COMMAND}
    per = cfg.get("analyses", {})
    if not isinstance(per, dict):
        raise ValueError("config key 'analyses' must map analysis names to their options")
    names = ([a.strip() for a in args.analyses.split(",") if a.strip()] if args.analyses
             else list(per) or list(DEFAULT_ANALYSES))
    bad = [n for n in [*names, *per] if n not in found]
    if bad:
        raise ValueError(f"unknown analyses {bad}; available: {', '.join(found)}")
    common = {k: cfg.get(k) for k in COMMON}
    common.update({k: getattr(args, k) for k in COMMON if getattr(args, k) is not None})
    out = []
    for name in names:
        module = found[name]
        parser = analysis_parser(name, module)
        own = per.get(name) or {}
        argv = to_argv(common, parser, strict=False, where=name) + to_argv(own, parser, strict=True, where=name)
        argv += ["--out", str(Path(args.out) / name)]
        try:
            sub = parser.parse_args(argv)
        except SystemExit:
            raise ValueError(f"{name}: invalid options {argv}") from None
        out.append((name, sub, module, argv))
    return out


def report_markdown(entries: list[dict], out: Path, prov: dict, wall: float, jobs: int) -> str:
    total = sum(e["seconds"] for e in entries)
    cpu = [e.get("cpu_seconds") for e in entries]
    cpu_total = sum(cpu) if None not in cpu else None

    def fmt(v: float | None) -> str:
        return "" if v is None else f"{v:.0f}"

    md = ["# kvarn evaluation report\n\n",
          f"Machine: {prov['machine']}, {os.cpu_count()} CPUs; torch {prov['torch']}, transformers "
          f"{prov['transformers']}; git {prov['git']}; {prov['date']}.\n\n",
          markdown_table(["analysis", "wall time (s)", "CPU time (s)", "command"],
                         [[e["analysis"], f"{e['seconds']:.0f}", fmt(e.get("cpu_seconds")),
                           f"`kvarn eval {e['analysis']} {' '.join(e['argv'])}`"] for e in entries]
                         + [["sum", f"{total:.0f}", fmt(cpu_total), ""]]),
          f"\nWall time of the whole report: {wall:.0f} s ({wall / 60:.1f} min) with {jobs} analysis process(es) "
          "in parallel.\n"]
    for e in entries:
        folder = out / e["analysis"]
        summary = folder / "summary.md"
        text = summary.read_text() if summary.exists() else f"## {e['analysis']}\n\n(no summary written)\n"
        md.append("\n" + text)
        for png in sorted(folder.glob("*.png")):
            md.append(f"\n![{png.stem}]({e['analysis']}/{png.name})\n")
    return "".join(md)


def replot(args: argparse.Namespace) -> int:
    """Redraw from OUT/<analysis>/<analysis>.json (modules with `write_plots(result, out)` and
    `summary_markdown(result)`), then rewrite report.md with the timings recorded in report.json."""
    out = Path(args.out)
    saved = out / "report.json"
    if not saved.exists():
        raise ValueError(f"--replot needs a finished report in {out} (no report.json)")
    done = json.loads(saved.read_text())
    for name, _, module, _ in plan(args):
        folder = out / name
        path = folder / f"{name.replace('-', '_')}.json"
        if not path.exists():
            raise ValueError(f"--replot: {path} is missing")
        result = json.loads(path.read_text())
        if hasattr(module, "write_plots"):
            module.write_plots(result, folder)
        if hasattr(module, "summary_markdown"):
            (folder / "summary.md").write_text(module.summary_markdown(result))
    (out / "report.md").write_text(report_markdown(done["steps"], out, done["provenance"],
                                                   done.get("wall_seconds", done["total_seconds"]),
                                                   done.get("jobs", 1)))
    print(f"redrew {out / 'report.md'}")
    return 0


def check_result(path: Path) -> None:
    """Validate a results file against the schema of its analysis (those that have one; kvarn/eval/schemas)."""
    if has_schema(path.stem):
        try:
            validate(json.loads(path.read_text()), load_schema(path.stem))
        except ValueError as e:
            raise ValueError(f"{path} does not match its schema: {e}") from None


def _run_step(name: str, argv: list[str]) -> tuple[int, float, float]:
    """One analysis in a worker process (`--jobs` > 1): its exit code (2 on bad input, as the CLI's), wall time and
    CPU time. Parsed by the analysis's own parser, as `plan` does, so the harness needs nothing of the CLI."""
    import sys

    from kvarn.eval import analyses

    module = analyses()[name]
    parser = analysis_parser(name, module)
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        rc = int(module.run(parser.parse_args(argv)) or 0)
    except ValueError as e:
        print(f"kvarn eval {name}: error: {e}", file=sys.stderr)
        rc = 2
    return rc, time.perf_counter() - t0, time.process_time() - c0


def run(args: argparse.Namespace) -> int:
    if args.replot:
        return replot(args)
    if args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    steps = plan(args)
    out = Path(args.out)
    start = time.perf_counter()
    seconds: dict[str, float] = {}
    cpu: dict[str, float] = {}  # process CPU time: what the analysis needs, whatever else shares the machine
    if args.jobs == 1:
        for name, sub, module, _ in steps:
            t0, c0 = time.perf_counter(), time.process_time()
            module.run(sub)
            seconds[name], cpu[name] = time.perf_counter() - t0, time.process_time() - c0
    else:  # independent analyses in parallel processes, submitted in suite order (put the longest first)
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn")) as pool:
            futures = {name: pool.submit(_run_step, name, argv) for name, _, _, argv in steps}
            for name, fut in futures.items():
                rc, seconds[name], cpu[name] = fut.result()
                if rc:
                    raise ValueError(f"analysis {name} failed (exit code {rc})")
    wall = time.perf_counter() - start
    for name, *_ in steps:
        check_result(out / name / f"{name.replace('-', '_')}.json")
    entries = [{"analysis": name, "seconds": seconds[name], "cpu_seconds": cpu[name],
                "argv": [a for a in _argv_of(sub) if a]} for name, sub, _, _ in steps]
    prov = provenance(config=load_config(args.config), jobs=args.jobs,
                      **{k: getattr(args, k) for k in (*COMMON, "analyses")})
    check_result(write_json(out / "report.json", {
        "analysis": COMMAND, "provenance": prov, "steps": entries, "jobs": args.jobs,
        "total_seconds": sum(e["seconds"] for e in entries), "wall_seconds": wall}))
    md = report_markdown(entries, out, prov, wall, args.jobs)
    (out / "report.md").write_text(md)
    print(f"wrote {out / 'report.md'} ({wall:.0f} s)")
    return 0


def _argv_of(ns: argparse.Namespace) -> list[str]:
    """The parsed options of an analysis as a command line (for the report's reproduction commands)."""
    argv = []
    for key, value in vars(ns).items():
        if key == "func" or value is None:
            continue
        argv += [f"--{key.replace('_', '-')}", ",".join(map(str, value)) if isinstance(value, list) else str(value)]
    return argv
