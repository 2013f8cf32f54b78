"""Where a preset loses a task's answers: the gold answer's teacher-forced log-probability under the preset, with one
part of the cache given more bits at a time (issue 20, item 1).

Variants, each on the same samples and under the serving protocol (`kvarn eval tasks`): `full` (DynamicCache), `base`
(the preset), `keys`/`values` (every quantized layer's keys or values with `--high`'s quantizer), `keys@L`/`values@L`
(layer L only), `exact:PART:WHICH` (the preset with chosen rows read exact: by token or KV head,
`kvarn.eval.exact_rows`), and the `--compare` presets whole (`preset:NAME`; budget presets record their online layer
scores and the layers they promoted, `kvarn.cache.allocation`, so the score can be set beside the swaps). A variant's
recovery is its gold log-probability minus the base's on the same sample (an `exact:` variant's: minus the
reference-path control `exact:keys:none`, when it ran); its share of the gap is that over (full - that).

Results are appended per (sample, variant) to OUT/attribute.jsonl (a rerun skips what is done); OUT/attribute.json
holds the table and OUT/attribute.png the per-layer recoveries.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from kvarn.eval import exact_rows
from kvarn.eval.options import positive_int, result_header, setup
from kvarn.eval.results import publish

COMMAND = "attribute"
HELP = "which layers' keys or values lose a task's gold answer: one part of the cache at more bits at a time"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="named model, HF id or folder "
                        "(default: the task model, qwen2.5-coder-0.5b)")
    parser.add_argument("--preset", default=None, help="the preset to attribute (default: kvarn.DEFAULT_PRESET)")
    parser.add_argument("--high", default="kvarn-auto-k4v4-g128",
                        help="the preset whose key/value quantizers a promoted part gets (default: kvarn-auto-k4v4)")
    parser.add_argument("--task", default="niah_single_2", help="a `kvarn eval tasks` RULER task (default: "
                        "niah_single_2)")
    parser.add_argument("--length", type=positive_int, default=1024, help="sample length in tokens (default: 1024)")
    parser.add_argument("--indices", type=indices, default=[0, 1, 2, 3], help="sample indices (default: 0,1,2,3)")
    parser.add_argument("--compare", default="kvarn-b2.5,kvarn-b3.0",
                        help="whole presets to run on the same samples beside the swaps (their online layer scores "
                             "are recorded; default: kvarn-b2.5,kvarn-b3.0)")
    parser.add_argument("--parts", default="keys", help="per-layer swaps: keys, values or keys,values (default: keys)")
    parser.add_argument("--whole", default="keys,values",
                        help="whole-cache swaps: every layer's keys and/or values at once (default: keys,values)")
    parser.add_argument("--exact", default="",
                        help="exact-row mixes, comma-separated PART:WHICH (kvarn.eval.exact_rows: e.g. "
                             "keys:none,keys:gold-line,keys:other-line,keys:head0,keys:top-err1; default: none)")
    parser.add_argument("--chunk", type=positive_int, default=128, help="serving prefill chunk (default: 128)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated data (default: 0)")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--out", default=f"out/eval/{COMMAND}", help="output folder (default: out/eval/attribute)")


def indices(text: str) -> list[int]:
    """argparse type: comma-separated sample indices >= 0."""
    out = [int(t) for t in text.split(",") if t.strip()]
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated indices >= 0, got {text!r}")
    return out


def variants(quantized: list[int], parts: list[str], compare: list[str], whole: list[str] | None = None,
             exact: list[str] | None = None) -> list[str]:
    return ["full", "base", *(f"preset:{c}" for c in compare), *(parts if whole is None else whole),
            *(f"exact:{e}" for e in exact or ()), *(f"{p}@{i}" for p in parts for i in quantized)]


def promote(cache, variant: str, high: tuple) -> None:
    """Give `variant`'s part of a fresh KVarNCache the high quantizers (before any token is cached)."""
    if variant in ("full", "base") or variant.startswith(("preset:", "exact:")):
        return
    part, _, layer = variant.partition("@")
    hk, hv = high
    for i, layer_obj in enumerate(cache.layers):
        store = getattr(layer_obj, "store", None)
        if store is None or store.keys.quantizer is None or (layer and int(layer) != i):
            continue
        if part == "keys":
            store.keys.set_quantizer(hk)
        else:
            store.values.set_quantizer(hv)


def gold_under(model, ids: torch.Tensor, gold: torch.Tensor, cache, chunk: int) -> float:
    from kvarn.eval.tasks.protocol import gold_logprob
    from kvarn.integrations.serving import prefill

    with torch.inference_mode():
        return gold_logprob(model, cache, prefill(model, ids, cache, chunk), gold, chunk)


def summarize(records: list[dict], quantized: list[int], parts: list[str]) -> dict:
    by: dict[str, dict[int, float]] = {}
    for r in records:
        by.setdefault(r["variant"], {})[r["index"]] = r["gold_logprob"]
    idx = sorted(set(by.get("base", {})) & set(by.get("full", {})))
    gap = [by["full"][i] - by["base"][i] for i in idx]
    # exact-row mixes read through the reference path: their recovery is against its own control when it ran
    control = next((c for c in ("exact:keys:none", "exact:kv:none") if c in by), None)
    rows = []
    for v, got in by.items():
        ref = by[control] if control and v.startswith("exact:") else by["base"]
        common = [i for i in idx if i in got and i in ref]
        rec = [got[i] - ref[i] for i in common]
        mean = sum(rec) / len(rec) if rec else math.nan
        g = sum(by["full"][i] - ref[i] for i in common)
        rows.append({"variant": v, "samples": len(common), "mean_gold_logprob": sum(got[i] for i in common) /
                     max(len(common), 1), "recovered": mean, "share_of_gap": sum(rec) / g if g else math.nan,
                     "against": control if ref is not by["base"] else "base"})
    layer_rows = {p: [next((r for r in rows if r["variant"] == f"{p}@{i}"), None) for i in quantized] for p in parts}
    return {"rows": rows, "gap": sum(gap) / len(gap) if gap else math.nan, "samples": idx,
            "per_layer": {p: [None if r is None else r["recovered"] for r in rs] for p, rs in layer_rows.items()},
            "layers": quantized}


def markdown(result: dict) -> str:
    lines = [f"# attribute: {result['preset']} on {result['task']} at {result['length']} tokens "
             f"(samples {result['summary']['samples']})", "",
             f"gap full - base: {result['summary']['gap']:.3f} nats (gold answer, summed over its tokens)", "",
             "| variant | samples | mean gold log-prob | recovered | against | share of gap |",
             "|---|---|---|---|---|---|"]
    for r in sorted(result["summary"]["rows"], key=lambda r: -r["recovered"] if r["recovered"] == r["recovered"]
                    else 0):
        lines.append(f"| {r['variant']} | {r['samples']} | {r['mean_gold_logprob']:.3f} | {r['recovered']:+.3f} | "
                     f"{r.get('against', 'base')} | {r['share_of_gap']:.2f} |")
    if result.get("scores"):
        lines += ["", f"online layer scores of {result['compare'][0]} (kvarn.cache.allocation; mean over samples):", "",
                  " ".join(f"L{i}:{s:.3g}" for i, s in zip(result["summary"]["layers"], result["scores"])), "",
                  f"layers it promoted (any sample): {result['promoted']}"
                  + (f"; at the mid width: {result['middle']}" if result.get("middle") else "")]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["summary"]
    fig, ax = plt.subplots(figsize=(8, 3.2))
    parts = list(s["per_layer"])
    if not parts:  # whole-cache swaps and exact-row mixes only: one bar a variant
        rows = sorted((r for r in s["rows"] if r["variant"] != r.get("against", "base")), key=lambda r: -r["recovered"])
        ax.barh([f"{r['variant']} (vs {r.get('against', 'base')})" for r in rows], [r["recovered"] for r in rows],
                color=["tab:orange" if r["variant"].startswith("exact:") else "tab:blue" for r in rows])
        ax.axvline(0.0, color="k", lw=0.6)
        ax.invert_yaxis()
        ax.tick_params(axis="y", labelsize=7)
        ax.set_xlabel(f"gold log-prob recovered, {result['preset']} (nats, mean of {len(s['samples'])} samples)")
        ax.set_title(f"{result['task']} at {result['length']} tokens, {result['model']}", fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path
    w = 0.8 / max(len(parts), 1)
    for j, p in enumerate(parts):
        ax.bar([i + j * w for i in range(len(s["layers"]))], [x or 0.0 for x in s["per_layer"][p]], w,
               label=f"{p} of one layer at more bits")
    ax.axhline(s["gap"], color="k", ls="--", lw=0.8, label="full precision (the whole gap)")
    chosen = [s["layers"].index(i) for i in result.get("promoted") or [] if i in s["layers"]]
    if chosen:
        ax.plot(chosen, [0.0] * len(chosen), "rv", ms=7, label=f"promoted by {result['compare'][0]} (online)")
    ax.set_xticks(range(len(s["layers"])), [str(i) for i in s["layers"]], fontsize=7)
    ax.set_xlabel("layer")
    ax.set_ylabel("gold log-prob recovered (nats)")
    ax.set_title(f"{result['preset']}: {result['task']} at {result['length']} tokens, {result['model']}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run(args: argparse.Namespace) -> int:
    from kvarn.eval.lines import prompt_text
    from kvarn.eval.progress import progress
    from kvarn.eval.tasks import ruler
    from kvarn.eval.tasks.base import encode, encode_gold
    from kvarn.eval.tasks.haystack import resolve_haystack
    from kvarn.eval.tasks.protocol import new_cache
    from kvarn.integrations.transformers import KVarNCache, config_head_dim, text_config
    from kvarn.models import load_model
    from kvarn.presets import DEFAULT_PRESET, get_preset

    setup(args)
    preset = args.preset or DEFAULT_PRESET
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    whole = [p.strip() for p in args.whole.split(",") if p.strip()]
    if any(p not in ("keys", "values") for p in parts + whole):
        raise ValueError(f"--parts and --whole name keys and/or values, got {args.parts!r} and {args.whole!r}")
    if args.task not in ruler.TASKS:
        raise ValueError(f"--task must be a RULER task ({', '.join(ruler.TASKS)}), got {args.task!r}")
    exact = [e.strip() for e in args.exact.split(",") if e.strip()]
    for e in exact:
        exact_rows.parse(e)
    get_preset(preset)
    model, tok = load_model(args.model)
    high = get_preset(args.high).quantizers(config_head_dim(text_config(model.config)))
    probe = KVarNCache(model.config, preset)
    quantized = [i for i, la in enumerate(probe.layers) if getattr(getattr(la, "store", None), "keys", None) is not None
                 and la.store.keys.quantizer is not None]
    compare = [c.strip() for c in args.compare.split(",") if c.strip()]
    for c in compare:
        get_preset(c)
    names = variants(quantized, parts, compare, whole, exact)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "attribute.jsonl"
    setting = {"model": args.model, "preset": preset, "high": args.high, "task": args.task, "length": args.length,
               "chunk": args.chunk, "seed": args.seed}
    records = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    records = [r for r in records if r["setting"] == setting]
    done = {(r["index"], r["variant"]) for r in records}
    haystack = resolve_haystack("auto")

    def count(s) -> int:
        return encode(tok, s).shape[1] + s.new_tokens

    scores: list[list[float]] = []
    todo = [(i, v) for i in args.indices for v in names if (i, v) not in done]
    samples = {}
    with path.open("a") as f:
        for i, v in progress(todo, desc="attribute", unit="run"):
            if i not in samples:
                s = ruler.fit(args.task, args.length, args.seed, i, count, haystack)
                samples[i] = (encode(tok, s), encode_gold(tok, s), s)
            ids, gold, s = samples[i]
            if v.startswith("exact:"):
                spec = v.removeprefix("exact:")
                lines = exact_rows.needle_lines(tok, prompt_text(tok, s.prompt), ids, s.refs[0]) \
                    if spec.endswith("-line") and len(s.refs) == 1 else None
                cache = exact_rows.exact_cache(model.config, preset, spec, lines)
            else:
                method = "dynamic" if v == "full" else v.removeprefix("preset:") if v.startswith("preset:") else preset
                cache = new_cache(model, method)
                promote(cache, v, high)
            lp = gold_under(model, ids, gold, cache, args.chunk)
            rec = {"setting": setting, "index": i, "variant": v, "gold_logprob": lp, "gold_tokens": int(gold.numel())}
            budget = cache.allocation()["budget"] if hasattr(cache, "allocation") else None
            if budget is not None:
                rec["scores"], rec["promoted"] = budget["scores"], budget["promoted"]
                rec["middle"] = budget.get("middle")  # pick "best": the layers at the mid width
            f.write(json.dumps(rec) + "\n")
            f.flush()
            records.append(rec)
    promoted: set[int] = set()
    middle: set[int] = set()
    for r in records if compare else ():
        if r.get("scores") and r["variant"] == f"preset:{compare[0]}":
            scores.append([r["scores"][str(i)] for i in quantized])
            promoted |= set(r.get("promoted") or ())
            middle |= set(r.get("middle") or ())
    records = [r for r in records if r["index"] in args.indices]  # the table holds the samples asked for
    result = {**result_header(args, COMMAND), "preset": preset, "high": args.high, "compare": compare,
              "task": args.task,
              "length": args.length, "summary": summarize(records, quantized, parts),
              "scores": [sum(c) / len(c) for c in zip(*scores)] if scores else None, "promoted": sorted(promoted),
              "middle": sorted(middle)}
    plot(result, out / "attribute.png")
    publish(result, out / "attribute.json", out, markdown(result))
    return 0
