"""Which key width each layer gets under a budget preset on a text, as the decode protocol feeds it (one token at a
time from the text's start, as `kvarn eval decode`): the allocation's report (`KVarNCache.allocation()`), for
several presets side by side. Stops as soon as every preset has decided (the sink plus one tile).

    python scripts/budget_split.py --model qwen2.5-coder-0.5b --methods kvarn-b2.5,kvarn-b2.5-rank \
        --text ../shared/data/wikitext-2/test.txt
(`-rank`/`-best` names: scripts/budget_variants.py registers them.)
"""

from __future__ import annotations

import argparse
import json

import torch
from budget_variants import register_variants

from kvarn.eval.forward import forward_block, inference, quantized_cache
from kvarn.eval.text import load_tokens
from kvarn.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--methods", default="kvarn-b2.5,kvarn-b3.0")
    ap.add_argument("--text", default=None, help="text file (default: the decode protocol's)")
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    register_variants()
    model, tok = load_model(args.model)
    ids = load_tokens(tok, args.text, args.max_len)
    with inference(model):
        for name in args.methods.split(","):
            cache = quantized_cache(model, name)  # the decode protocol's cache (its read path, the preset's sink)
            if cache.key_allocation is None:
                raise SystemExit(f"{name} is not a budget preset (no key allocation)")
            t = 0
            while t < ids.shape[1] and not cache.key_allocation.decided:
                forward_block(model, ids[:, t:t + 1], cache)
                t += 1
            rep = cache.allocation()
            budget = rep["budget"] or {}
            bits = [b for b in rep["key_bits"] if b is not None]
            print(json.dumps({"method": name, "tokens": t, "key_bits": rep["key_bits"],
                              "layers_at": {w: bits.count(w) for w in sorted(set(bits))},
                              "high": budget.get("promoted"), "mid": budget.get("middle")}))


if __name__ == "__main__":
    main()
