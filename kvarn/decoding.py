"""Decoding loops shared by `kvarn generate`, `kvarn demo` and the evaluations, and the demo's protocol: a greedy
FP16 reference answer (`greedy_reference`) teacher-forced through a quantized cache (`follow_reference`).

`teacher_forced_logits` feeds a fixed token sequence through a cache the way decoding does: the first
`prefill` tokens in one forward, then one token per forward, so every position attends to the cache as
it stands at that step (quantization errors feed forward exactly as in generation). Under greedy decoding,
the first position where the quantized model's argmax differs from the reference token is exactly where a
free-running greedy generation with that cache would first diverge from the reference.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvarn.generation import make_cache
from kvarn.integrations.transformers import cache_kwarg
from kvarn.ops.metrics import kl_divergence
from kvarn.presets import get_preset


def chat_prompt(tokenizer, prompt: str, system: str | None = None) -> torch.Tensor:
    """Token ids [1, T] of `prompt`, through the chat template when the tokenizer has one."""
    if getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)
        return out["input_ids"]
    return tokenizer(prompt, return_tensors="pt").input_ids


@torch.no_grad()
def teacher_forced_logits(model, input_ids: torch.Tensor, cache, prefill: int = 1,
                          on_step: Callable[[int], None] | None = None) -> torch.Tensor:
    """Logits [T - prefill + 1, V] predicting tokens prefill .. T (row i predicts token prefill + i).

    input_ids [1, T]; `cache` is any transformers cache (DynamicCache, KVarNCache) and is filled in place.
    The last row predicts the token after the sequence.
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"teacher forcing takes input_ids of shape [1, T], got {tuple(input_ids.shape)}")
    t = input_ids.shape[1]
    if not 1 <= prefill <= t:
        raise ValueError(f"prefill must be in [1, {t}], got {prefill}")
    out = model(input_ids=input_ids[:, :prefill], use_cache=True, **{cache_kwarg(model): cache})
    rows = [out.logits[0, -1].float()]
    for i in range(prefill, t):
        out = model(input_ids=input_ids[:, i : i + 1], use_cache=True, **{cache_kwarg(model): cache})
        rows.append(out.logits[0, -1].float())
        if on_step is not None:
            on_step(i)
    return torch.stack(rows)


DEFAULT_PROMPT = (
    "Solve this step by step, showing all your reasoning: a train leaves a station at 9:00 travelling at "
    "60 km/h, and a second train leaves the same station at 10:30 on the same track travelling at 90 km/h. "
    "When and where does the second train catch up with the first? Then check the answer in two different "
    "ways, and finally explain how the answer changes if the second train is 20% slower."
)


@dataclass
class MethodResult:
    method: str
    bits_per_element: float
    kv_bytes: int
    kv_bytes_fp16: int
    tokens_per_s: float
    first_divergence: int | None  # index into the generated answer; None: never diverged
    top1_agreement: float
    mean_kl: float
    kl_last_256: float
    kl: list[float] = field(repr=False, default_factory=list)


@torch.no_grad()
def greedy_reference(model, tok, ids: torch.Tensor, new_tokens: int, on_step=None):
    """FP16 greedy answer of exactly `new_tokens` tokens (EOS suppressed) and its logits.

    Returns (tokens [n], logits [n, V], seconds, cache)."""
    cache = make_cache(model, "fp16")

    class _Tick:  # streamer protocol: put() once for the prompt, then once per generated token
        def put(self, _):
            if on_step is not None:
                on_step()

        def end(self):
            pass

    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         **{cache_kwarg(model): cache},
                         temperature=None, top_p=None, top_k=None, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, output_logits=True, return_dict_in_generate=True,
                         pad_token_id=tok.pad_token_id, streamer=_Tick())
    dt = time.perf_counter() - t0
    return out.sequences[0, ids.shape[1]:], torch.stack([x[0].float() for x in out.logits]), dt, cache


def follow_reference(model, method: str, ids: torch.Tensor, ref_tokens: torch.Tensor, ref_logits: torch.Tensor,
                     sink: int | None = None, on_step=None) -> MethodResult:
    """Teacher-force the reference answer through a cache of `method` (see the module docstring)."""
    cache = make_cache(model, get_preset(method), sink)
    seq = torch.cat([ids, ref_tokens[None, :-1]], dim=1)  # the answer's last token is never fed
    t0 = time.perf_counter()
    logits = teacher_forced_logits(model, seq, cache, prefill=ids.shape[1], on_step=on_step)
    dt = time.perf_counter() - t0
    kl = kl_divergence(ref_logits, logits)
    match = logits.argmax(-1) == ref_tokens
    miss = (~match).nonzero()
    b = cache.nbytes()
    n = ref_tokens.numel()
    return MethodResult(
        method=method, bits_per_element=b.bits_per_element, kv_bytes=b.total, kv_bytes_fp16=cache.fp16_nbytes(),
        tokens_per_s=(n - 1) / dt, first_divergence=int(miss[0]) if len(miss) else None,
        top1_agreement=match.float().mean().item(), mean_kl=kl.mean().item(), kl_last_256=kl[-256:].mean().item(),
        kl=kl.tolist())
