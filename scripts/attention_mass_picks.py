"""Which key rows `top-mass<r>` (kvarn/eval/exact_rows.py) keeps exact on a task prompt: per 128-token tile and KV
head, the row that received the most softmax weight from the queries of the tile's own prompt chunk
(`kvarn.eval.exact_rows.open_tile_mass`), from one full-precision forward (the oracle's choice without
quantization). Prints where in the tile the picks sit, their most common tokens, how far the pick stands above the
rest of its tile, and the share of the last 64 queries' attention on the first token (the usual attention sink) in
three layers.

    PYTHONPATH=$PWD .venv/bin/python scripts/attention_mass_picks.py [--seed 7 --index 0]
(run as a script: it takes `recorded` from scripts/key_output_error.py)
"""

from __future__ import annotations

import argparse
import collections

import torch
from key_output_error import recorded

from kvarn.eval.exact_rows import open_tile_mass
from kvarn.eval.tasks import ruler
from kvarn.eval.tasks.base import encode
from kvarn.eval.tasks.haystack import resolve_haystack
from kvarn.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--task", default="niah_multikey_2")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--index", type=int, default=0)
    args = ap.parse_args()
    g, sink = 128, 128
    model, tok = load_model(args.model)
    s = ruler.fit(args.task, args.length, args.seed, args.index, lambda s: encode(tok, s).shape[1] + s.new_tokens,
                  resolve_haystack("auto"))
    ids = encode(tok, s)
    offsets, tokens, ratio = collections.Counter(), collections.Counter(), []
    layers = recorded(model, ids, torch.float32)
    for q, k, _ in layers:
        t = k.shape[1]
        for a in range(sink, t - g + 1, g):
            # the tile's own chunk of queries over the keys so far: `top-mass`'s own arithmetic
            mass = open_tile_mass(q[None, :, a:a + g], k[None, :, :a + g], sink, g)[0, :, a:a + g]  # [H, G]
            for row in mass:
                top = row.sort(descending=True).values
                j = int(row.argmax())
                offsets[j // 16 * 16] += 1
                tokens[tok.decode(ids[0, a + j])] += 1
                ratio.append(float(top[0] / top[1:].mean()))
    n = sum(offsets.values())
    print(f"{args.task} {args.length} seed {args.seed} #{args.index}: {ids.shape[1]} tokens, {n} tile-heads")
    print("picks by offset in the tile (16-row bins): " + ", ".join(f"{o}: {c}" for o, c in sorted(offsets.items())))
    print("most common picked tokens: " + ", ".join(f"{x!r}: {c}" for x, c in tokens.most_common(8)))
    r = torch.tensor(ratio).quantile(torch.tensor([0.1, 0.5, 0.9])).tolist()
    print("pick's mass / the mean of its tile's other rows, 10/50/90 %: " + ", ".join(f"{x:.1f}" for x in r))
    for i in (0, len(layers) // 2, len(layers) - 1):
        q, k, _ = layers[i]
        h, d = k.shape[0], k.shape[2]
        w = ((q[:, -64:].reshape(h, -1, 64, d) @ k[:, None].transpose(-1, -2)) / d ** 0.5).softmax(-1)
        print(f"layer {i}: the last 64 queries' mean weight on the first token {float(w[..., 0].mean()):.4f}")


if __name__ == "__main__":
    main()
