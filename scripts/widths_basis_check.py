"""Do `kvarn-w2.5`'s key tiles all keep the plain basis? (docs/TASKS.md, "Row widths in the library": whether storing
widths keys in one basis would be free.) On SmolLM2, a stretch of text fed in chunks of 128 tokens then decoded one
token at a time, once with the preset and once with its keys stored plain only; prints how many key tiles the preset
stored rotated and how far the logits of the two runs differ.

    PYTHONPATH=$PWD .venv/bin/python scripts/widths_basis_check.py [--text ../shared/data/wikitext-2/test.txt]
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from kvarn.integrations.transformers import KVarNCache
from kvarn.models import load_model
from kvarn.presets import get_preset
from kvarn.quant.affine import QueryAwareQuantizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", default="../shared/data/wikitext-2/test.txt")
    ap.add_argument("--offset", type=int, default=20000, help="first character of the stretch")
    ap.add_argument("--prefill", type=int, default=1536)
    ap.add_argument("--decode", type=int, default=64)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    base = get_preset("kvarn-w2.5")
    plain = dataclasses.replace(base, name="kvarn-w2.5-plain", key=lambda d: QueryAwareQuantizer(
        dataclasses.replace(base.key(d).config, rotate="none")))
    model, tok = load_model("default")
    with open(args.text) as f:
        text = f.read()[args.offset:args.offset + 20 * (args.prefill + args.decode)]
    ids = tok(text, return_tensors="pt").input_ids[:, :args.prefill + args.decode]
    logits = []
    for preset in (base, plain):
        cache, out = KVarNCache(model.config, preset), []
        with torch.no_grad():
            for s in range(0, args.prefill, 128):
                out.append(model(ids[:, s:s + 128], past_key_values=cache, use_cache=True).logits)
            for i in range(args.prefill, ids.shape[1]):
                out.append(model(ids[:, i:i + 1], past_key_values=cache, use_cache=True).logits)
        logits.append(torch.cat(out, 1))
        flags = [lay.store.keys.packed.rotated for lay in cache.layers if lay.store.keys.n_tiles]
        if flags[0] is not None:
            rotated = torch.cat([f.flatten() for f in flags])
            print(f"{preset.name}: {int(rotated.sum())} of {rotated.numel()} key tiles stored rotated")
    diff = (logits[0] - logits[1]).abs().max().item()
    same = (logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean().item()
    print(f"plain keys only: max |logit difference| {diff:.3f}, argmax equal at {same:.2%} of positions")


if __name__ == "__main__":
    main()
