"""`kvarn bench {attention,e2e,store,memory,vllm,all}`: speed and memory side by side in one process, as ratios.
The logic lives in `kvarn.bench`; this file only declares the subcommands."""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = {
    "attention": "decode attention alone: kvarn packed vs SDPA over dense fp32/bf16 K/V",
    "e2e": "end-to-end decode tokens/s: KVarNCache vs Dynamic/Static/quanto/HQQ caches",
    "store": "tile-store time as a share of the decode time of the tokens it covers",
    "memory": "KV bytes held and peak process memory per cache (a process each)",
    "vllm": "vLLM throughput (tokens/s, requests/s) and KV capacity, stock vs the kvarn plugin (needs .venv-vllm)",
    "all": "every section, one JSON/markdown (docs/BENCHMARKS.md); vllm only where vLLM is installed",
}


def register(sub: argparse._SubParsersAction) -> None:
    from kvarn.bench.suite import add_arguments

    p = sub.add_parser("bench", help="benchmarks: attention, end-to-end decode, store cost, memory (ratios)")
    bs = p.add_subparsers(dest="bench", required=True, metavar="SECTION")
    for name, text in HELP.items():
        s = bs.add_parser(name, help=text, description=text)
        add_arguments(s)
        s.set_defaults(func=run)
    m = bs.add_parser("memory-long", help="bytes held vs nbytes() every 1k tokens over a long run (model shapes)")
    m.add_argument("--model", default="default", help="only its config is read")
    m.add_argument("--preset", default="kvarn-k2v2-g128")
    m.add_argument("--tokens", type=int, default=32768)
    m.add_argument("--json", type=Path, default=None, metavar="FILE")
    m.set_defaults(func=run_memory_long)
    r = bs.add_parser("render", help="tables, plots and markdown from a bench JSON (no measuring)")
    r.add_argument("json", type=Path, help="a `kvarn bench ... --json` file")
    r.add_argument("--plots", type=Path, default=None, metavar="DIR")
    r.add_argument("--markdown", type=Path, default=None, metavar="FILE")
    r.set_defaults(func=run_render)


def run(args: argparse.Namespace) -> int:
    from kvarn.bench.suite import SECTIONS
    from kvarn.bench.suite import run as run_sections

    run_sections(args, list(SECTIONS) if args.bench == "all" else [args.bench])
    return 0


def run_render(args: argparse.Namespace) -> int:
    from kvarn.bench.suite import render

    render(args.json, args.plots, args.markdown)
    return 0


def run_memory_long(args: argparse.Namespace) -> int:
    from transformers import AutoConfig

    from kvarn.bench.memory import run_long
    from kvarn.integrations.transformers import config_head_dim, config_kv_heads
    from kvarn.models import resolve

    cfg = AutoConfig.from_pretrained(resolve(args.model))
    return run_long(args, cfg.num_hidden_layers, config_kv_heads(cfg), config_head_dim(cfg))
