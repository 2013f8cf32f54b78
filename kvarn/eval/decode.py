"""`kvarn eval decode`: the docs/SPEC.md §8 decode protocol, next-token KL and top-1 agreement, token by token.

The first `--max-len` tokens of the text (the standard library's `pydoc_data.topics` by default; from `--offset`
characters in), tokenized with the model's default special tokens, are fed ONE token at a time (teacher forcing)
through each method's `KVarNCache`, in lockstep with the same run on an unquantized transformers `DynamicCache`
(`engine.run_blocks` with blocks of 1 token).
Quantization errors therefore feed forward exactly as in decoding. Per position p and method:

    kl[p]   = KL(p_ref(. | ids[<=p]) || p_method(. | ids[<=p]))     float64, over the whole vocabulary
    top1[p] = argmax p_method == argmax p_ref

Summaries: mean KL over all positions, mean KL over the last `--last` (256) positions, top-1 agreement, and the
bits per element of the quantized region (from stored bytes) and of the whole cache at the end (sink and tail
included). With sink S = 128 and tiles G = 128 the first tile is quantized after position S + G - 1, so KL is 0
before it. For presets that choose a rotation per tile (`kvarn-auto-*`), the share of rotated key (and value)
tiles per layer and KV head, read from the stored flags (`AffineTiles.rotated`).

Outputs in --out: decode.json (or --json FILE; schema kvarn/eval/schemas/decode.schema.json), summary.md, and
kl_vs_position.png.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvarn.eval.engine import RunSpec, Trace, run_blocks
from kvarn.eval.forward import decoder_layers, head_dim, quantizable_layers
from kvarn.eval.options import add_common_arguments, parse_methods, positive_int, result_header, seed_everything
from kvarn.eval.results import markdown_table, publish
from kvarn.eval.text import load_tokens, text_name
from kvarn.quant.tiles import AffineTiles

COMMAND = "decode"
HELP = "docs/SPEC.md §8 decode protocol: token-by-token KL and top-1 vs an unquantized cache"
DEFAULT_METHODS = ("rtn-k2v2-g128,hadamard-k2v2-g128,varn-k2v2-g128,kvarn-k2v2-g128,kvarn-auto-k2v2-g128,"
                   "kvarn-k4v2-g128")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, methods=DEFAULT_METHODS, command=COMMAND)
    parser.add_argument("--max-len", type=positive_int, default=1024, help="tokens of the text (default: 1024)")
    parser.add_argument("--offset", type=int, default=0, metavar="CHARS",
                        help="start this many characters into the text (another stretch of it; default: 0)")
    parser.add_argument("--last", type=positive_int, default=256,
                        help="the summary's late window: mean KL over the last N positions (default: 256)")
    parser.add_argument("--json", default=None, metavar="FILE", help="results JSON (default: <out>/decode.json)")
    parser.add_argument("--attention", choices=("sdpa", "kvarn"), default="sdpa",
                        help="sdpa: attention on dequantized K/V (default); kvarn: straight from the packed codes")


def rotation_shares(cache) -> dict:
    """{"keys": [[share per KV head] per layer], "values": ...}: mean of the stored per-tile rotation flags over
    tiles (and batch rows); None for layers without flags (not quantized, or no tile yet). Only tensor kinds
    that store flags appear."""
    out: dict[str, list] = {}
    for kind in ("keys", "values"):
        per_layer, any_flags = [], False
        for layer in cache.layers:
            store = getattr(getattr(layer, "store", None), kind, None)
            packed = store.packed if store is not None and store.n_tiles else None
            flags = packed.rotated if isinstance(packed, AffineTiles) else None  # [B, H, n]
            if flags is None:
                per_layer.append(None)
                continue
            any_flags = True
            per_layer.append(flags.float().mean(dim=(0, 2)).tolist())
        if any_flags:
            out[kind] = per_layer
    return out


def cache_record(cache) -> dict:
    """What a run records of its cache at the end: the rotation shares (`rotation_shares`) and, for budget presets,
    the key bits each layer was given (`KVarNCache.allocation`)."""
    out: dict = {"rotated": rotation_shares(cache)}
    if getattr(cache, "key_allocation", None) is not None:
        out["key_bits"] = cache.allocation()["key_bits"]
    return out


def run_record(tr: Trace, bits: float, last: int) -> dict:
    kl, top1 = tr.positions("kl"), tr.positions("top1").double()
    return {
        "method": tr.spec.method, "preset": tr.spec.preset.name, "bits_per_element": bits,
        "cache_bytes": tr.nbytes.as_dict(), "seconds": tr.seconds,
        "kl": kl.tolist(), "top1": top1.tolist(),
        "summary": {"kl_mean": float(kl.mean()), "kl_last": float(kl[-last:].mean()), "top1": float(top1.mean())},
        "rotated": tr.extra.get("rotated", {}),
        **({"key_bits": tr.extra["key_bits"]} if "key_bits" in tr.extra else {}),
    }


def summary_markdown(result: dict) -> str:
    last = result["last"]
    rows = [[r["method"], r["summary"]["kl_mean"], r["summary"]["kl_last"], f"{100 * r['summary']['top1']:.1f}%",
             r["bits_per_element"], r["cache_bytes"]["bits_per_element"], f"{r['seconds']:.0f}"]
            for r in result["runs"]]
    where = f", from character {result['offset']}" if result.get("offset") else ""
    md = [f"## Decode protocol ({result['tokens']} tokens one at a time, {result['model']}, {result['text']}{where}, "
          f"sink {result['sink']}, attention {result['attention']})\n\n",
          f"KL(ref || method) of the next-token distribution, mean over all positions and over the last {last}; "
          "top-1: agreement of the argmax with the unquantized run. bits/elem: quantized tiles, from stored bytes; "
          "cache bits/elem: the whole cache at the end (sink and tail in full precision included).\n\n",
          markdown_table(["method", "mean KL", f"KL last {last}", "top-1", "bits/elem", "cache bits/elem", "s"],
                         rows)]
    for r in result["runs"]:
        for kind, shares in r["rotated"].items():
            vals = [s for layer in shares if layer for s in layer]
            if not vals:
                continue
            md.append(f"\n{r['method']}: share of rotated {kind[:-1]} tiles per layer (KV heads separated by /), "
                      f"overall {sum(vals) / len(vals):.2f}:\n\n")
            md.append(markdown_table(["layer", "rotated share"], [[i, " / ".join(f"{s:.2f}" for s in layer)]
                                                                  for i, layer in enumerate(shares) if layer]))
        if r.get("key_bits"):
            md.append(f"\n{r['method']}: key bits per layer {r['key_bits']}\n")
    return "".join(md)


def run(args: argparse.Namespace) -> int:
    seed_everything(args.seed)
    presets = parse_methods(args.methods)
    from kvarn.models import load_model

    model, tok = load_model(args.model)
    if args.attention == "kvarn":
        from kvarn.attention import enable

        enable(model)
    if args.offset < 0:
        raise ValueError(f"--offset must be >= 0, got {args.offset}")
    ids = load_tokens(tok, args.text, args.max_len, offset_chars=args.offset)
    specs = [RunSpec(p.name, p, "cumulative") for p in presets]
    _, traces = run_blocks(model, ids, specs, 1, sink=args.sink, desc=COMMAND, inspect=cache_record)
    d, n_layers, n_quant = head_dim(model), len(decoder_layers(model)), quantizable_layers(model)
    sink = args.sink if args.sink is not None else sorted({p.sink for p in presets})
    result = {
        **result_header(args, COMMAND), "text": text_name(args.text), "offset": args.offset,
        "tokens": int(ids.shape[1]),
        "sink": sink, "last": args.last, "attention": args.attention, "num_layers": n_layers, "head_dim": d,
        "runs": [run_record(tr, tr.spec.preset.bits_per_element(d, n_quant), args.last) for tr in traces],
    }
    out = Path(args.out)
    from kvarn.eval import plots

    plots.kl_vs_position(result, out / "kl_vs_position.png")
    publish(result, Path(args.json) if args.json else out / "decode.json", out, summary_markdown(result))
    return 0
