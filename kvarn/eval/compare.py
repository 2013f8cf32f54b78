"""`kvarn eval compare`: one table comparing methods on a model (the issue-5 comparison).

Per method:
  bits/elem     quantized region, from the bytes its quantizers store (fp layers averaged in)
  cache bits    bits per element of the whole cache after `--max-len` tokens (sink, tail, windows counted)
  MAE, KL       cumulative pseudo-decoding over the first `--max-len` tokens of the text in blocks of
                `--block` (engine.run_blocks): attention-output MAE (mean over layers and blocks) and mean
                next-token KL(ref || method)
  agreement     greedy agreement with FP16 over `--gen-tokens` generated tokens: the FP16 greedy answer to
                a reasoning prompt is teacher-forced through each cache (kvarn.decoding.follow_reference); top-1
                agreement and the first diverging position (where greedy decoding with that cache diverges)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvarn.eval.options import add_common_arguments, parse_methods, positive_int, result_header, seed_everything
from kvarn.eval.progress import progress
from kvarn.eval.results import markdown_table, publish
from kvarn.eval.text import load_tokens, text_name

COMMAND = "compare"
HELP = "one comparison table: bits, attention MAE, KL (cumulative pseudo-decoding), greedy agreement"
DEFAULT_METHODS = ("rtn,kivi,kivi-g128,quarot,kvquant-1pct,polarquant,turboquant,kitty,hadamard,varn,"
                   "kvarn-k2v2-g128,kvarn-auto-k2v2-g128,kvarn-k4v2-g128")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, methods=DEFAULT_METHODS, command=COMMAND)
    parser.add_argument("--max-len", type=positive_int, default=4096, help="tokens of the text (default: 4096)")
    parser.add_argument("--block", type=positive_int, default=64, help="pseudo-decoding block (default: 64)")
    parser.add_argument("--gen-tokens", type=positive_int, default=512, help="greedy tokens compared (default: 512)")


def run(args: argparse.Namespace) -> int:
    from kvarn.decoding import DEFAULT_PROMPT, chat_prompt, follow_reference, greedy_reference
    from kvarn.eval.engine import RunSpec, run_blocks
    from kvarn.eval.forward import head_dim, quantizable_layers
    from kvarn.models import load_model

    seed_everything(args.seed)
    presets = [p for p in parse_methods(args.methods) if p.quantized]
    model, tok = load_model(args.model)
    d, n_layers = head_dim(model), quantizable_layers(model)
    ids = load_tokens(tok, args.text, args.max_len)
    _, traces = run_blocks(model, ids, [RunSpec(p.name, p, "cumulative") for p in presets], args.block,
                           sink=args.sink, desc="pseudo-decode")
    prompt = chat_prompt(tok, DEFAULT_PROMPT)
    bar = progress(total=args.gen_tokens * (len(presets) + 1), desc="greedy agreement", unit="tok")
    ref_tokens, ref_logits, _, _ = greedy_reference(model, tok, prompt, args.gen_tokens, lambda: bar.update())
    rows = []
    for p, tr in zip(presets, traces):
        g = follow_reference(model, p.name, prompt, ref_tokens, ref_logits, args.sink, lambda _: bar.update())
        mae = tr.per_block("mae").mean().item()
        rows.append({"method": p.name, "bits_per_element": p.bits_per_element(d, n_layers),
                     "cache_bits_per_element": tr.nbytes.bits_per_element, "attention_mae": mae,
                     "kl": tr.positions("kl").mean().item(), "top1_text": tr.positions("top1").double().mean().item(),
                     "greedy_agreement": g.top1_agreement, "first_divergence": g.first_divergence,
                     "greedy_kl": g.mean_kl})
    bar.close()
    result = {**result_header(args, COMMAND), "text": text_name(args.text), "tokens": int(ids.shape[1]),
              "block": args.block, "gen_tokens": args.gen_tokens, "rows": rows}
    out = Path(args.out)
    publish(result, out / "compare.json", out, summary_markdown(result))
    return 0


def summary_markdown(result: dict) -> str:
    head = ["method", "bits/elem", "cache bits/elem", "attn MAE", "KL vs FP16", "greedy agreement", "first diff"]
    rows = [[r["method"], r["bits_per_element"], r["cache_bits_per_element"], r["attention_mae"], r["kl"],
             f"{100 * r['greedy_agreement']:.1f}%",
             "never" if r["first_divergence"] is None else r["first_divergence"]] for r in result["rows"]]
    return (f"## Comparison on `{result['model']}` ({result['tokens']} tokens, cumulative pseudo-decoding in blocks "
            f"of {result['block']}; greedy agreement over {result['gen_tokens']} tokens)\n\n"
            + markdown_table(head, rows))
