"""The memory-bound run's ceiling: stock vLLM given a KV budget that holds `--max-num-seqs` sequences at once, beside
stock in the run's own budget. No KV cache that keeps stock's attention cost can serve the queue faster than stock
with the memory to hold as many sequences as kvarn does, so the ratio of the two stock rows bounds what kvarn's
capacity can buy on this machine (kvarn's attention would have to be cheaper than stock's to pass it).

    PYTHONPATH=$PWD .venv-vllm/bin/python scripts/vllm_ceiling.py [--dtype float32] [--requests 32]
        [--prompt-tokens 2048] [--new-tokens 256] [--kv-mib 424] [--ample-mib 1800] [--max-num-seqs 16]
        [--presets P1,P2] [--json F]

Prints the rows (requests/s, tokens/s, TTFT, TPOT, KV tokens, preemptions) and the ceiling ratio; --json keeps
them. Exits with an error when vLLM's KV tokens at --ample-mib hold fewer than --max-num-seqs sequences (the
default 1800 MiB is sized for float32 SmolLM2; bf16 needs about half). Every run is `kvarn bench vllm`'s
memory-bound job (`kvarn.bench.vllm.bench_vllm`): stock in both budgets, and --presets (kvarn presets, none by
default) in the run's own budget beside it.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

from kvarn.bench.vllm import DTYPES, MIB, Scenario, bench_vllm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32", choices=DTYPES)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--kv-mib", type=float, default=424, help="the memory-bound run's budget")
    ap.add_argument("--ample-mib", type=float, default=1800, help="a budget that holds max-num-seqs sequences")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--presets", default="", help="kvarn presets to run in --kv-mib beside stock")
    ap.add_argument("--model", default="default")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from kvarn.eval.text import load_tokens
    from kvarn.models import resolve

    tok = AutoTokenizer.from_pretrained(str(resolve(args.model)))
    presets = [p for p in args.presets.split(",") if p]
    load = functools.partial(load_tokens, tok, None)
    t0 = time.perf_counter()
    rows = []
    for mib, names in ((args.kv_mib, presets), (args.ample_mib, [])):
        sc = Scenario("memory", args.requests, args.prompt_tokens, args.new_tokens, int(mib * MIB), args.max_num_seqs)
        res = bench_vllm(args.model, load, names, [sc], args.dtype)
        rows += [r | {"kv_mib": mib} for r in res["runs"][0]["rows"]]
    stock = [r for r in rows if r["engine"] == "stock"]
    for r in rows:
        r["requests_per_s_vs_stock"] = r["requests_per_s"] / stock[0]["requests_per_s"]
        print(f"{r['engine']}, {r['kv_mib']:.0f} MiB: {r['requests_per_s']:.4f} requests/s "
              f"({r['requests_per_s_vs_stock']:.2f}x stock in {args.kv_mib:.0f} MiB), {r['tokens_per_s']:.2f} "
              f"tokens/s, TTFT {r['ttft_mean_s']:.1f} s, TPOT {r['tpot_mean_s']:.3f} s, {r['kv_tokens']} KV tokens, "
              f"{r['preemptions']} preemptions")
    ceiling = stock[1]["requests_per_s"] / stock[0]["requests_per_s"]
    held = stock[1]["kv_tokens"] // (args.prompt_tokens + args.new_tokens)  # whole sequences the ample budget holds
    print(f"ceiling: stock with {args.ample_mib:.0f} MiB serves {ceiling:.2f}x stock's requests/s in {args.kv_mib:.0f} "
          f"MiB ({args.requests} x ({args.prompt_tokens} + {args.new_tokens}), max_num_seqs {args.max_num_seqs}, "
          f"{args.dtype})")
    if args.json:
        from kvarn.eval.provenance import provenance

        with open(args.json, "w") as f:
            json.dump({"command": "scripts/vllm_ceiling.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in
                                                                        vars(args).items() if v not in (None, "")),
                       "provenance": provenance(**vars(args)), "vllm": res["vllm"], "rows": rows,
                       "ceiling": ceiling, "ample_sequences": held, "wall_s": time.perf_counter() - t0}, f, indent=1)
    if held < args.max_num_seqs:  # after the JSON: the runs are kept, the ratio is not the ceiling
        raise SystemExit(f"--ample-mib {args.ample_mib:.0f} holds {held} sequences of {args.prompt_tokens} + "
                         f"{args.new_tokens} tokens, fewer than max_num_seqs {args.max_num_seqs}: the ratio above "
                         "understates the ceiling; raise --ample-mib")


if __name__ == "__main__":
    main()
