"""Which clip each key-row width's grid search picks on a model's real key tiles (`kvarn-w2.5`, PyTorch path):
per width 1-4, the share of rows whose least-error grid is at each clip of `kvarn.ops.widths.CLIPS`, over all rows
and over the rows the allocation put at that width (docs/TASKS.md, "The widths' clip search").

    KVARN_KERNEL=torch python scripts/width_clips.py [--model M] [--tokens N]

The text (kvarn's default) is fed in one forward; the tiles are stored as the cache stores them, with the query
statistics that prefill leaves.
"""

from __future__ import annotations

import argparse
import collections

import torch

import kvarn.quant.affine as affine
from kvarn.eval.text import load_tokens
from kvarn.integrations.transformers import KVarNCache
from kvarn.models import load_model
from kvarn.ops import widths as W
from kvarn.ops.rtn import rtn_targets

every = {b: collections.Counter() for b in range(1, W.MAX_WIDTH + 1)}
at_width = {b: collections.Counter() for b in range(1, W.MAX_WIDTH + 1)}


def recording(b, s_col, s_row, gain, total, clips=None):
    """`width_targets`, counting each row's best clip per width (the first of least error, as it chooses)."""
    out = W.width_targets(b, s_col, s_row, gain, total, clips)
    wt = W.row_weights(s_col, s_row, gain)
    for bits in range(1, W.MAX_WIDTH + 1):
        err = torch.stack([W.grid_error(b, wt, rtn_targets(b, bits, c), bits) for c in W.CLIPS], -1)
        best = err.argmin(-1)
        every[bits].update(best.flatten().tolist())
        at_width[bits].update(best[out[4] == bits].tolist())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--tokens", type=int, default=1200)
    a = ap.parse_args()
    affine.width_targets = recording
    model, tok = load_model(a.model)
    ids = load_tokens(tok, None, a.tokens)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=KVarNCache(model.config, "kvarn-w2.5"), use_cache=True)
    print(f"{a.model}, {a.tokens} tokens: share of rows whose best grid is at each clip")
    for bits in range(1, W.MAX_WIDTH + 1):
        for label, counts in (("all rows", every[bits]), ("rows at this width", at_width[bits])):
            n = max(sum(counts.values()), 1)
            shares = ", ".join(f"{W.CLIPS[k]:.2f}: {v / n:.3f}" for k, v in sorted(counts.items()))
            print(f"  width {bits}, {label} ({n}): {shares}")


if __name__ == "__main__":
    main()
