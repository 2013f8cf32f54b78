"""`kvarn bench {store,memory}`: speed and memory side by side in one run, reported as ratios."""

from __future__ import annotations

import argparse
from pathlib import Path

STORE_PRESETS = "kvarn-k2v2-g128,kvarn-auto-k2v2-g128,rtn,hadamard,varn,kvarn-k4v2-g128"
MEMORY_PRESETS = "kvarn-k2v2-g128,kvarn-auto-k2v2-g128,kvarn-k4v2-g128,kvarn-k4v4-g128,rtn"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks: tile-store cost and KV memory, as ratios in one run")
    bs = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    s = bs.add_parser("store", help="encode cost of one flush of tiles (all layers/heads) per preset, on real K/V")
    s.add_argument("--model", default="default")
    s.add_argument("--text", default=None, help="text for the K/V (default: pydoc_data.topics)")
    s.add_argument("--presets", default=STORE_PRESETS)
    s.add_argument("--baseline", default="kvarn-k2v2-g128", help="ratios are relative to this preset")
    s.add_argument("--rounds", type=int, default=5)
    s.add_argument("--json", type=Path, default=None)
    s.set_defaults(func=run_store)
    m = bs.add_parser("memory", help="bytes held vs fp16 at several context lengths (model shapes)")
    m.add_argument("--model", default="default", help="only its config is read")
    m.add_argument("--presets", default=MEMORY_PRESETS)
    m.add_argument("--contexts", default="1024,4096,16384")
    m.add_argument("--json", type=Path, default=None)
    m.add_argument("--long", action="store_true", help="long run: bytes held vs nbytes() every 1k tokens, first "
                   "preset of --presets (kvarn.bench.memory.long_run)")
    m.add_argument("--tokens", type=int, default=32768, help="tokens of the --long run")
    m.set_defaults(func=run_memory)


def _print(rows: list[dict], title: str) -> None:
    from rich.table import Table

    from kvarn.console import console

    t = Table(title=title)
    for k in rows[0]:
        t.add_column(k, justify="left" if isinstance(rows[0][k], str) else "right")
    for r in rows:
        t.add_row(*[f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.values()])
    console().print(t)


def _presets(text: str) -> list[str]:
    from kvarn.presets import get_preset

    names = [n.strip() for n in text.split(",") if n.strip()]
    for n in names:
        get_preset(n)
    return names


def run_store(args: argparse.Namespace) -> int:
    from kvarn.bench.store import bench_store
    from kvarn.eval.common import capture_kv, load_tokens, provenance, write_json
    from kvarn.models import load_model

    presets = _presets(args.presets)
    model, tok = load_model(args.model)
    kv = capture_kv(model, load_tokens(tok, args.text, 256))
    rows = bench_store(kv, presets, rounds=args.rounds, baseline=args.baseline)
    _print(rows, f"tile-store cost, one flush of {len(kv)} layers x {kv[0][0].shape[1]} KV heads (real K/V)")
    if args.json:
        write_json(args.json, {"provenance": provenance(**vars(args) | {"func": None}), "rows": rows})
    return 0


def run_memory(args: argparse.Namespace) -> int:
    from transformers import AutoConfig

    from kvarn.bench.memory import bench_memory
    from kvarn.eval.common import provenance, write_json
    from kvarn.models import resolve

    cfg = AutoConfig.from_pretrained(resolve(args.model))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if args.long:
        from kvarn.bench.memory import run_long

        return run_long(args, cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim)
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = bench_memory(_presets(args.presets), contexts, cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim)
    shape = f"{cfg.num_hidden_layers} layers x {cfg.num_key_value_heads} heads x {head_dim}"
    _print(rows, f"KV bytes held vs fp16 ({shape})")
    if args.json:
        write_json(args.json, {"provenance": provenance(**vars(args) | {"func": None}), "rows": rows})
    return 0
