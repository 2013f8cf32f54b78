"""Stored key codes of a preset on a model's text, to compare two versions of the store (docs/TASKS.md, "Query-aware
presets: the store cost cut"): `dump` prefills the model through the cache and saves every quantized layer's packed
key tiles; `diff` counts the codes (b-bit fields of the packed bytes) and the other fields that differ between dumps.

    python scripts/key_codes.py dump OUT.pt [--model default] [--preset kvarn-auto-k2v2-g128-qar] [--tokens 2048]
    python scripts/key_codes.py diff A.pt B.pt
"""

from __future__ import annotations

import argparse

import torch


def dump(out: str, model_name: str, preset: str, tokens: int) -> None:
    from kvarn.bench.e2e import prefilled
    from kvarn.eval.text import load_tokens
    from kvarn.models import load_model
    from kvarn.presets import get_preset

    torch.set_num_threads(1)
    model, tok = load_model(model_name)
    ids = load_tokens(tok, None, tokens)
    with torch.no_grad():
        cache, _ = prefilled(model, ids, ids.shape[1], preset, ids.shape[1])
    layers = {i: {k: v.clone() for k, v in layer.store.keys.packed.tensors().items()}
              for i, layer in enumerate(cache.layers)
              if getattr(layer, "store", None) is not None and layer.store.keys.quantizer is not None}
    torch.save({"bits": get_preset(preset).k_bits, "layers": layers}, out)
    print(f"{len(layers)} layers of key tiles -> {out}")


def diff(a: str, b: str) -> None:
    x, y = torch.load(a), torch.load(b)
    bits = x["bits"]
    mask = (1 << bits) - 1
    codes = total = 0
    fields: dict[str, int] = {}
    for i, fa in x["layers"].items():
        for k, va in fa.items():
            vb = y["layers"][i][k]
            if k == "codes":
                d = va.view(torch.uint8) ^ vb.view(torch.uint8)
                codes += sum(int(((d >> s) & mask).ne(0).sum()) for s in range(0, 8, bits))
                total += va.numel() * (8 // bits)
            elif not torch.equal(va, vb):
                fields[k] = fields.get(k, 0) + 1
    print(f"codes differing: {codes} of {total}; other fields differing (layers): {fields or 'none'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("out")
    d.add_argument("--model", default="default")
    d.add_argument("--preset", default="kvarn-auto-k2v2-g128-qar")
    d.add_argument("--tokens", type=int, default=2048)
    f = sub.add_parser("diff")
    f.add_argument("a")
    f.add_argument("b")
    args = ap.parse_args()
    if args.cmd == "dump":
        dump(args.out, args.model, args.preset, args.tokens)
    else:
        diff(args.a, args.b)


if __name__ == "__main__":
    main()
