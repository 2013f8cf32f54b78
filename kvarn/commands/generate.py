"""`kvarn generate`: stream an answer through a quantized cache, then one summary line."""

from __future__ import annotations

import argparse

from kvarn.presets import DEFAULT_PRESET


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text with a quantized KV cache (streams the answer)")
    p.add_argument("prompt", help="the user prompt (the chat template is applied when the model has one)")
    p.add_argument("--model", default="default", help="named model, HF id or local path (default: embedded)")
    p.add_argument("--preset", default=DEFAULT_PRESET, help=f"quantization preset (default {DEFAULT_PRESET})")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--sink", type=int, default=None, help="full-precision sink tokens (default: the preset's)")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--system", default=None, help="optional system message")
    p.add_argument("--attention", choices=("packed", "reference"), default="packed",
                   help="packed: attention straight from the packed cache; reference: dequantize + SDPA")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import time

    import torch
    from transformers import TextStreamer

    from kvarn.decoding import chat_prompt
    from kvarn.generation import make_cache, prepare_model
    from kvarn.integrations.transformers import cache_kwarg
    from kvarn.models import load_model
    from kvarn.presets import get_preset

    preset = get_preset(args.preset)  # fail fast on a bad name, before loading anything
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    model, tok = load_model(args.model)
    prepare_model(model, args.attention)
    torch.manual_seed(args.seed)
    ids = chat_prompt(tok, args.prompt, args.system)
    cache = make_cache(model, preset, args.sink)
    streamer = TextStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    sampling = dict(do_sample=True, temperature=args.temperature, top_p=args.top_p) if args.sample else dict(
        do_sample=False, temperature=None, top_p=None, top_k=None)
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **{cache_kwarg(model): cache},
                         max_new_tokens=args.max_new_tokens, streamer=streamer, pad_token_id=tok.pad_token_id,
                         **sampling)
    dt = time.perf_counter() - t0
    n = out.shape[1] - ids.shape[1]
    b = cache.nbytes()
    fp16 = cache.fp16_nbytes()
    print(f"\n[{preset.name}] {n} tokens in {dt:.1f} s ({n / dt:.1f} tok/s, prefill included) | KV cache "
          f"{b.total / 2**20:.2f} MiB held vs {fp16 / 2**20:.2f} MiB in fp16 ({fp16 / max(b.total, 1):.2f}x smaller, "
          f"{b.bits_per_element:.2f} bits/element over {ids.shape[1] + n - 1} cached tokens)")
    if preset.quantized and b.packed == 0:
        print(f"  no tile quantized yet: tiles of {preset.tile} tokens are quantized once the cache holds more than "
              f"the sink ({preset.sink if args.sink is None else args.sink}) plus one tile")
    return 0
