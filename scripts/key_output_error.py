"""Attention-output error of key quantizers on one RULER prompt, layer by layer (a proxy; docs/TASKS.md, "Refined key
channels"): each layer's post-RoPE keys (tiles past a 128-token sink) encoded by a preset's key quantizer, with the
weight a cache would give it from E[q q^T] of the whole prompt's queries; values and every other layer exact; the
error |o(K^) - o(K)|^2 / |o(K)|^2 over the last 64 queries, summed over layers. Not the task: see what it misses there.
--part values: the values quantized instead (the preset's value quantizer, keys exact).

    python scripts/key_output_error.py --model qwen2.5-coder-0.5b --seed 0 --index 0 \
        kvarn-auto-k2v2-g128-qar kvarn-c2.5-qar kvarn-auto-k4v2-g128
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvarn.eval.tasks import ruler
from kvarn.eval.tasks.base import encode
from kvarn.eval.tasks.haystack import resolve_haystack
from kvarn.models import load_model
from kvarn.presets import get_preset

try:  # the lab's variants (kvarn-c2.5-qar, ...), when run as scripts/key_output_error.py
    from budget_variants import register_variants
except ImportError:  # pragma: no cover
    register_variants = None

SINK, ROWS = 128, 64


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: int) -> torch.Tensor:
    """Causal attention output of the last ROWS queries q [Hq, T, D] over k, v [H, T, D] (GQA groups of `group`)."""
    t, d = k.shape[1], k.shape[2]
    causal = torch.arange(t)[None, :] <= torch.arange(t - ROWS, t)[:, None]
    s = q[:, -ROWS:] @ k.repeat_interleave(group, 0).transpose(-1, -2) / d ** 0.5
    return torch.softmax(s.masked_fill(~causal, float("-inf")), -1) @ v.repeat_interleave(group, 0)


def recorded(model, ids: torch.Tensor, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(q [Hq, T, D], k, v [H, T, D]) of every layer in `dtype`, post-RoPE, from one full-precision forward."""
    seen: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def record(module, query, key, value, attention_mask, **kw):
        seen[module.layer_idx] = (query[0].to(dtype), key[0].to(dtype), value[0].to(dtype))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("kvarn_record", record)
    model.set_attn_implementation("kvarn_record")
    with torch.inference_mode():
        model(input_ids=ids)
    return [seen[i] for i in sorted(seen)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("presets", nargs="+")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--task", default="niah_multikey_2")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--part", choices=("keys", "values"), default="keys",
                    help="quantize the keys (the weight from the queries) or the values (keys exact)")
    args = ap.parse_args()
    if register_variants is not None:
        register_variants()
    torch.manual_seed(0)
    model, tok = load_model(args.model)
    sample = ruler.fit(args.task, args.length, args.seed, args.index,
                       lambda s: encode(tok, s).shape[1] + s.new_tokens, resolve_haystack("auto"))
    ids = encode(tok, sample)
    total = {p: 0.0 for p in args.presets}
    for q, k, v in recorded(model, ids, torch.float32):
        h, t, d = k.shape
        group = q.shape[0] // h
        qg = q.reshape(h, group * t, d)
        sigma = qg.transpose(1, 2) @ qg / qg.shape[1]  # [H, D, D]
        n = (t - SINK) // 128
        keys = args.part == "keys"
        x = k if keys else v
        tiles = x[:, SINK:SINK + n * 128].reshape(h * n, 128, d)
        exact = attend(q, k, v, group)
        for p in args.presets:
            xq = get_preset(p).quantizers(d)[0 if keys else 1]
            big = sigma.repeat_interleave(n, 0)
            weight = (None if not keys else big if getattr(xq, "takes_covariance", False)
                      else big.diagonal(dim1=-2, dim2=-1))
            xh = x.clone()
            xh[:, SINK:SINK + n * 128] = xq.decode(xq.encode(tiles, weight)).reshape(h, n * 128, d)
            out = attend(q, xh, v, group) if keys else attend(q, k, xh, group)
            total[p] += float((out - exact).square().sum() / exact.square().sum())
    print(json.dumps({"model": args.model, "task": args.task, "length": args.length, "seed": args.seed,
                      "index": args.index, "part": args.part, "tokens": int(ids.shape[1]),
                      "output_error_summed": total}, indent=1))


if __name__ == "__main__":
    main()
