"""Decoding loops shared by `kvarn generate`, `kvarn demo` and the evaluations.

`teacher_forced_logits` feeds a fixed token sequence through a cache the way decoding does: the first
`prefill` tokens in one forward, then one token per forward, so every position attends to the cache as
it stands at that step (quantization errors feed forward exactly as in generation). Under greedy decoding,
the first position where the quantized model's argmax differs from the reference token is exactly where a
free-running greedy generation with that cache would first diverge from the reference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


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
    out = model(input_ids=input_ids[:, :prefill], cache=cache, use_cache=True)
    rows = [out.logits[0, -1].float()]
    for i in range(prefill, t):
        out = model(input_ids=input_ids[:, i : i + 1], cache=cache, use_cache=True)
        rows.append(out.logits[0, -1].float())
        if on_step is not None:
            on_step(i)
    return torch.stack(rows)
