"""The serving loop on any transformers cache: the prompt prefilled in chunks (so every chunk after the first attends
to what the cache stored of the earlier ones, as with chunked prefill or prefix reuse in a server), then greedy
decoding one token at a time. Shared by `kvarn eval tasks` and the lm-eval adapter (`kvarn.integrations.lm_eval`)."""

from __future__ import annotations

import torch


def forward_logprobs(model, ids: torch.Tensor, cache, keep: int = 1) -> torch.Tensor:
    """Append ids [1, t] to `cache`; float64 log-probabilities of the last `keep` positions [keep, V]."""
    from kvarn.integrations.transformers import cache_kwarg

    logits = model(input_ids=ids, use_cache=True, logits_to_keep=keep, **{cache_kwarg(model): cache}).logits[0].double()
    return torch.log_softmax(logits, -1)


def prefill(model, ids: torch.Tensor, cache, chunk: int | None) -> torch.Tensor:
    """Feed ids [1, P] in chunks of `chunk` tokens (None: one forward); the next-token log-probabilities [V]."""
    if ids.dim() != 2 or ids.shape[0] != 1 or not ids.shape[1]:
        raise ValueError(f"expected prompt ids of shape [1, P] with P >= 1, got {tuple(ids.shape)}")
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    step = chunk or ids.shape[1]
    lp = None
    for start in range(0, ids.shape[1], step):
        lp = forward_logprobs(model, ids[:, start:start + step], cache)[-1]
    return lp


def greedy(model, tok, cache, last: torch.Tensor, new_tokens: int, eos: set[int],
           stop: tuple[str, ...] = ()) -> list[int]:
    """Greedy continuation from `last` [V], one token per step on `cache`, until an EOS id, a stop string in the
    decoded continuation, or `new_tokens` tokens."""
    out: list[int] = []
    while len(out) < new_tokens:
        nxt = int(last.argmax())
        out.append(nxt)
        if nxt in eos or len(out) == new_tokens or (stop and any(s in tok.decode(out) for s in stop)):
            break
        last = forward_logprobs(model, torch.tensor([[nxt]], device=last.device), cache)[-1]
    return out
