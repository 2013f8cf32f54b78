"""`kvarn eval ppl`: perplexity and KL vs the full-precision cache over sliding windows of a text.

The first `--max-tokens` tokens are cut into windows of `--window` tokens starting every `--stride` tokens
(the usual strided evaluation): window w = [b_w, e_w) scores only the targets after the previous window's
end, so no target is scored twice (with stride = window, the first token of each window has no context
and is not scored). Each window starts from an
empty cache and is prefilled in blocks of `--block` tokens through the method's `KVarNCache` (cumulative,
engine.run_blocks): the tokens of a block attend to the sink, the quantized tiles and the exact tail left
by the earlier blocks, plus their own block. The reference is the same blocks on a DynamicCache.

Per window: ppl_w = exp(mean NLL of its scored targets), kl_w = mean KL(p_ref || p) over the same
positions. Reported: ppl = exp(mean NLL over all scored targets), mean KL over them, and the mean and
sample standard deviation (ddof = 1) of ppl_w and kl_w over windows.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import torch

from kvarn.eval.engine import RunSpec, Trace, run_blocks
from kvarn.eval.forward import decoder_layers, head_dim
from kvarn.eval.options import add_common_arguments, parse_methods, positive_int, result_header, setup
from kvarn.eval.progress import progress
from kvarn.eval.results import markdown_table, publish
from kvarn.eval.text import load_tokens, text_name

COMMAND = "ppl"
HELP = "perplexity and KL vs full precision over sliding windows, prefilled through the quantized cache"
DEFAULT_METHODS = "fp16,rtn,kvarn-k2v2-g128,kvarn-k4v2-g128"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, methods=DEFAULT_METHODS, command=COMMAND)
    parser.add_argument("--max-tokens", type=positive_int, default=4096, help="tokens of the text (default: 4096)")
    parser.add_argument("--window", type=positive_int, default=1024,
                        help="tokens per window, at most the model's context (default: 1024)")
    parser.add_argument("--stride", type=positive_int, default=None, help="window start step (default: --window)")
    parser.add_argument("--block", type=positive_int, default=64, help="prefill block (default: 64)")


def windows(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored position) of each window; positions predict the next token."""
    if stride > window:
        raise ValueError(f"--stride {stride} is larger than --window {window}: tokens would be skipped")
    out, prev_end = [], 0
    for begin in range(0, n, stride):
        end = min(begin + window, n)
        # targets at window index >= end - trg_len are new; the prediction of target j sits at j - 1
        first = max(prev_end - begin - 1, 0)
        out.append((begin, end, first))
        prev_end = end
        if end == n:
            break
    return out


def _window_stats(tr: Trace, first: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    nll, kl, top1 = (tr.positions(k)[first:] for k in ("nll", "kl", "top1"))
    keep = ~torch.isnan(nll)  # the window's last position has no target
    return nll[keep], kl[keep], top1[keep]


def _summary(method: str, parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], bits: float) -> dict:
    nll = torch.cat([p[0] for p in parts])
    kl = torch.cat([p[1] for p in parts])
    ppl_w = [math.exp(float(p[0].mean())) for p in parts]
    kl_w = [float(p[1].mean()) for p in parts]

    def std(v: list[float]) -> float:
        return float(np.std(v, ddof=1)) if len(v) > 1 else float("nan")

    return {"method": method, "bits_per_element": bits, "scored": int(nll.numel()),
            "nll": float(nll.mean()), "ppl": math.exp(float(nll.mean())), "kl": float(kl.mean()),
            "top1": float(torch.cat([p[2] for p in parts]).double().mean()),
            "ppl_windows": ppl_w, "kl_windows": kl_w, "ppl_mean": float(np.mean(ppl_w)), "ppl_std": std(ppl_w),
            "kl_mean": float(np.mean(kl_w)), "kl_std": std(kl_w)}


def evaluate(model, ids: torch.Tensor, presets, window: int, stride: int, block: int, sink: int | None) -> dict:
    """Reference and per-method records over the windows of ids [1, N]."""
    ctx = getattr(model.config, "max_position_embeddings", None)
    if ctx is not None and window > ctx:
        raise ValueError(f"--window {window} exceeds the model's context of {ctx} tokens")
    wins = windows(ids.shape[1], window, stride)
    specs = [RunSpec(p.name, p) for p in presets]
    ref_parts, parts = [], [[] for _ in specs]
    for begin, end, first in progress(wins, desc=COMMAND, unit="window"):
        ref, traces = run_blocks(model, ids[:, begin:end], specs, block, sink=sink, desc=f"window {begin}",
                                 show_progress=False)
        ref_parts.append(_window_stats(ref, first))
        for acc, tr in zip(parts, traces):
            acc.append(_window_stats(tr, first))
    d, n_layers = head_dim(model), len(decoder_layers(model))
    return {"windows": [list(w) for w in wins], "reference": _summary("reference", ref_parts, 16.0),
            "results": [_summary(p.name, acc, p.bits_per_element(d, n_layers)) for p, acc in zip(presets, parts)]}


def write_plots(result: dict, out: Path) -> list[Path]:
    """Mean KL per window and method, with the std over windows as error bars."""
    from kvarn.eval import plots

    rs = result["results"]
    return [plots.grouped_bars([r["method"] for r in rs], {"KL vs reference": [r["kl_mean"] for r in rs]},
                               out / "ppl_kl.png", "mean next-token KL", "KL per window (mean ± std)",
                               errors={"KL vs reference": [0 if math.isnan(r["kl_std"]) else r["kl_std"]
                                                           for r in rs]})]


def summary_markdown(result: dict) -> str:
    rows = [[r["method"], r["bits_per_element"], r["ppl"], f"{r['ppl_mean']:.4g} ± {r['ppl_std']:.2g}", r["kl"],
             f"{r['kl_mean']:.4g} ± {r['kl_std']:.2g}", f"{100 * r['top1']:.1f}%"]
            for r in [result["reference"], *result["results"]]]
    return (f"## Perplexity ({result['tokens']} tokens, windows of {result['window']} every {result['stride']}, "
            f"prefill blocks of {result['block']}, {len(result['windows'])} windows, {result['model']})\n\n"
            "reference: the same blocks on an unquantized DynamicCache. ± : sample std over windows.\n\n"
            + markdown_table(["method", "bits/elem", "ppl", "ppl per window", "KL", "KL per window", "top-1"], rows))


def run(args: argparse.Namespace) -> int:
    setup(args)
    presets = parse_methods(args.methods)
    from kvarn.models import load_model

    model, tok = load_model(args.model)
    ids = load_tokens(tok, args.text, args.max_tokens)
    stride = args.stride or args.window
    result = {**result_header(args, COMMAND), "text": text_name(args.text), "tokens": int(ids.shape[1]),
              "window": args.window, "stride": stride, "block": args.block,
              **evaluate(model, ids, presets, args.window, stride, args.block, args.sink)}
    out = Path(args.out)
    write_plots(result, out)
    publish(result, out / "ppl.json", out, summary_markdown(result))
    return 0
