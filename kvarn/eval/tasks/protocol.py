"""How every task sample runs through a cache: the serving and the generate protocol, the teacher-forced gold answer,
and what the cache held at the end.

    serving   the prompt (context, question, chat template, answer prefix) is fed in chunks of `chunk` tokens (default:
              the tile, 128), so every chunk after the first attends to the quantized past, as with chunked prefill or
              prefix reuse in a server; then the answer is decoded greedily one token at a time through the cache.
    generate  `model.generate(input_ids, cache=cache, do_sample=False)` as a transformers user calls it: one prefill
              over exact K/V, quantized tiles read from the first generated token on.
    vllm      the method served by a vLLM engine (stock for "dynamic", the kvarn plugin for a preset), prompts in
              chunks of `chunk` tokens; `vllm_protocol`.

Methods: "dynamic" (transformers' `DynamicCache`, full precision), a kvarn preset name (`kvarn.preset_names()`,
`KVarNCache` as a user builds it) or transformers' `QuantizedCache` anchors "quanto-2bit" / "hqq-2bit" (as
`kvarn bench e2e` builds them: 2 bits, transformers' defaults otherwise, group 64, residual 128). "PRESET+exact:SPEC"
is an oracle for a lever not built yet: the preset on the reference read path with the rows SPEC picks read exact
(`kvarn.eval.exact_rows`; per-tile or per-head specs only). Its reads are what a store keeping those rows exact would
give; its reported bytes are the preset's (the exact copies it reads are held beside the store, not counted). Every
sample gets a fresh cache.

The gold answer's log-probability is teacher-forced on a copy of the prefilled cache (the same quantized past the
greedy answer reads), its tokens fed in chunks as well; the greedy answer then continues from the original cache.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from kvarn.eval import exact_rows
from kvarn.eval.forward import reference_cache
from kvarn.integrations.serving import forward_logprobs, greedy, prefill
from kvarn.integrations.transformers import cache_kwarg

Protocol = Literal["serving", "generate", "vllm"]
PROTOCOLS: tuple[Protocol, ...] = ("serving", "generate", "vllm")  # vllm: `vllm_protocol`, run by the runner
FULL_PRECISION = "dynamic"
ANCHORS = {"quanto-2bit": ("quanto", "optimum.quanto"), "hqq-2bit": ("hqq", "hqq")}  # backend, module it needs


@dataclass
class Output:
    """What one sample produced on one cache."""

    answer: str
    tokens: int  # generated tokens
    gold_logprob: float | None  # sum over the gold answer's tokens (teacher forced)
    gold_tokens: int
    held: dict[str, Any] = field(default_factory=dict)  # `cache_held`
    seconds: float = 0.0


def check_methods(names: list[str]) -> list[str]:
    """Method names in order, duplicates dropped; a clear error for an unknown one or a missing backend."""
    import importlib.util

    from kvarn.presets import get_preset

    names = list(dict.fromkeys(n.strip() for n in names if n.strip()))
    if not names:
        raise ValueError("--methods is empty; give e.g. dynamic,kvarn-auto-k2v2-g128")
    for n in names:
        if n in ANCHORS:
            module = ANCHORS[n][1]
            if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
                raise ValueError(f"{n} needs {module}, which is not installed (pip install 'kvarn[bench]')")
        elif "+exact:" in n:
            base, _, spec = n.partition("+exact:")
            get_preset(base)
            if exact_rows.parse(spec)[1].endswith("-line"):
                raise ValueError(f"{n}: line specs need the sample's gold line; `kvarn eval attribute` takes them")
        elif n != FULL_PRECISION:
            get_preset(n)  # a clear error naming the presets
    return names


def new_cache(model, method: str, sink: int | None = None):
    """A fresh cache of `method` for one sample (`sink` overrides a kvarn preset's)."""
    if method == FULL_PRECISION:
        return reference_cache(model)
    if method in ANCHORS:
        from transformers import QuantizedCache

        return QuantizedCache(ANCHORS[method][0], model.config, nbits=2)
    from kvarn.integrations.transformers import KVarNCache

    if "+exact:" in method:
        base, _, spec = method.partition("+exact:")
        return exact_rows.exact_cache(model.config, base, spec, sink=sink)
    return KVarNCache(model.config, method, sink=sink)


def cache_held(cache) -> dict[str, Any]:
    """The share of the cached tokens held in quantized tiles (mean over the layers that quantize, keys and values
    apart), the bits per element from stored bytes where the cache reports them and, for budget presets, the key bits
    of each layer (`KVarNCache.allocation`). KVarNCache: the store regions
    (sink | tiles | tail) of each layer; QuantizedCache: tokens beyond its residual window; DynamicCache: 0."""
    keys, values, tokens = [], [], 0
    for layer in getattr(cache, "layers", []):
        store = getattr(layer, "store", None)
        if store is not None:  # KVarNLayer
            tokens = max(tokens, store.length)
            if store.keys.quantizer is None or not store.length:
                continue
            keys.append((store.keys.tail_start - store.keys.tiles_start) / store.length)
            values.append((store.values.tail_start - store.values.tiles_start) / store.length)
        elif hasattr(layer, "cumulative_length") and getattr(layer, "keys", None) is not None:  # QuantizedLayer
            total = int(layer.cumulative_length)
            tokens = max(tokens, total)
            if total:
                share = (total - layer.keys.shape[-2]) / total
                keys.append(share)
                values.append(share)
        elif getattr(layer, "keys", None) is not None and layer.keys.numel():
            tokens = max(tokens, layer.keys.shape[-2])
    out: dict[str, Any] = {"tokens": tokens, "quantized_share_keys": sum(keys) / len(keys) if keys else 0.0,
                           "quantized_share_values": sum(values) / len(values) if values else 0.0}
    if hasattr(cache, "nbytes"):
        b = cache.nbytes()
        out["bits_per_element"] = b.bits_per_element
        out["bytes"] = b.total
    if getattr(cache, "key_allocation", None) is not None:  # budget presets: the key bits each layer was given
        out["key_bits"] = cache.allocation()["key_bits"]
    return out


def gold_logprob(model, cache, last: torch.Tensor, gold: torch.Tensor, chunk: int | None) -> float:
    """Sum of log p(gold[i] | prompt, gold[<i]) on `cache` (consumed): `last` [V] predicts gold[0]; gold [g]."""
    total = float(last[gold[0]])
    rest = gold[:-1].unsqueeze(0)
    step = chunk or max(rest.shape[1], 1)
    for start in range(0, rest.shape[1], step):
        x = rest[:, start:start + step]
        lp = forward_logprobs(model, x, cache, keep=x.shape[1])
        total += float(lp.gather(-1, gold[start + 1:start + 1 + x.shape[1]].unsqueeze(-1)).sum())
    return total


def _branch(model, ids: torch.Tensor, cache, last: torch.Tensor, method: str, sink: int | None,
            chunk: int | None) -> tuple[Any, torch.Tensor]:
    """A copy of the prefilled cache and its last log-probabilities; caches that cannot be copied (quanto's
    QuantizedCache holds tensor subclasses without deepcopy) are prefilled again, which gives the same content."""
    try:
        return copy.deepcopy(cache), last
    except (RuntimeError, TypeError):
        side = new_cache(model, method, sink)
        return side, prefill(model, ids, side, chunk)


def run_sample(model, tok, ids: torch.Tensor, gold: torch.Tensor | None, method: str, protocol: Protocol, *,
               chunk: int, new_tokens: int, eos: set[int], stop: tuple[str, ...] = (),
               sink: int | None = None) -> Output:
    """One sample (prompt ids [1, P], gold answer ids [g] or None) on a fresh cache of `method`."""
    if protocol not in ("serving", "generate"):
        raise ValueError(f"run_sample runs the serving and generate protocols, got {protocol!r}")
    t0 = time.perf_counter()
    cache = new_cache(model, method, sink)
    with torch.inference_mode():
        if protocol == "serving":
            last = prefill(model, ids, cache, chunk)
            lp = None if gold is None else gold_logprob(model, *_branch(model, ids, cache, last, method, sink, chunk),
                                                        gold, chunk)
            out = greedy(model, tok, cache, last, new_tokens, eos, stop)
        else:
            lp = None
            if gold is not None:  # the same prefill (one forward over exact K/V), the gold answer in one forward
                side = new_cache(model, method, sink)
                lp = gold_logprob(model, side, prefill(model, ids, side, None), gold, None)
            # greedy as in serving: no repetition penalty from the model's generation config
            seq = model.generate(ids, do_sample=False, max_new_tokens=new_tokens, repetition_penalty=1.0,
                                 eos_token_id=sorted(eos) or None, pad_token_id=tok.pad_token_id,
                                 stop_strings=list(stop) or None, tokenizer=tok if stop else None,
                                 **{cache_kwarg(model): cache})
            out = seq[0, ids.shape[1]:].tolist()
    text = tok.decode(out, skip_special_tokens=True)
    return Output(text, len(out), lp, 0 if gold is None else gold.numel(), cache_held(cache),
                  time.perf_counter() - t0)
