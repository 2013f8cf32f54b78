"""What passes between a `KVarNCache` layer and the attention function, besides the K/V themselves.

Packed hand-off. Under packed reads, `KVarNLayer.update` returns the *fresh* K/V of the current tokens; the stored past
travels as an attribute of the returned key tensor (`attach_past` / `past_of`), which every supported modeling file
passes untouched from `cache.update` to the attention function. The layer also leaves a *pending* hand-off in a
thread-local slot (`offer`), which the next kvarn attention function of the same layer (`module.layer_idx`) consumes
(`take`). A model that copies or casts the key between the two (`key.clone()`, `key.to(other dtype)`, a compiled
graph) delivers a key without the past: attending over it would silently ignore the whole cache, so `take` raises
`HandoffError` naming the layer and the cause. A hand-off never consumed (`cache.update` called directly, outside a
model) is forgotten when the next model forward builds its masks, so it cannot be blamed on another model's call.
Not detected: a model whose attention bypasses transformers' AttentionInterface although its config names a wrapped
implementation (no kvarn function ever runs); `KVarNCache` picks the reference path for "eager", the usual case.

Padding. The cache cannot see the attention mask, but transformers builds the masks through its mask interface
right after asking the cache for the mask sizes (`masking_utils.create_causal_mask`: `cache.get_mask_sizes`, then
the mask function with the 2-D padding mask [B, kv_length], True = real token). kvarn wraps every registered mask
function (`recording_padding`): `KVarNCache.get_mask_sizes` marks the cache as the mask's owner (`expect_mask`), the
wrapped mask function records the 2-D mask for it, and each layer update reads the pad positions of its new tokens
from it (`padding`). The record is only used by the cache that asked for it and only when its length covers that
cache's tokens; otherwise (a ready-made 4-D mask, no mask at all) no position is treated as a pad.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvarn.attention.view import KVarNPast

_local = threading.local()


class HandoffError(RuntimeError):
    """The attention function of a layer whose cache holds tokens did not receive the stored past."""


# -- the past and the query observer, attached to the key -------------------------------------------------------
def attach_past(key: torch.Tensor, past: KVarNPast) -> torch.Tensor:
    """An alias of `key` carrying `past` (the caller's tensor is left untouched)."""
    out = key.view_as(key)
    out.kvarn_past = past
    return out


def past_of(key: torch.Tensor) -> KVarNPast | None:
    return getattr(key, "kvarn_past", None)


def attach_observer(key: torch.Tensor, observe) -> torch.Tensor:
    """`key` (aliased unless it already is one of ours) carrying `observe(query)`, which kvarn's attention functions
    call with the queries that read it (the store's running query statistics, kvarn.quant.policy)."""
    out = key if hasattr(key, "kvarn_past") else key.view_as(key)
    out.kvarn_observe = observe
    return out


def observe(key: torch.Tensor, query: torch.Tensor) -> None:
    fn = getattr(key, "kvarn_observe", None)
    if fn is not None:
        fn(query)


# -- pending hand-off -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Pending:
    owner: weakref.ref  # the cache (or layer) that offered it
    layer_idx: int | None
    tokens: int  # tokens the layer held, for the message


def _where(p: _Pending) -> str:
    return f"layer {p.layer_idx}" if p.layer_idx is not None else "a KVarN cache layer"


def offer(owner: object, layer_idx: int | None, tokens: int) -> None:
    """Called by a layer that attached a past of `tokens` tokens to the key it returns."""
    _local.pending = _Pending(weakref.ref(owner), layer_idx, tokens)


def take(key: torch.Tensor, module: object = None) -> KVarNPast | None:
    """Called by every kvarn attention function with the key it received (and its module): the attached past, or
    None when the key carries none. Raises HandoffError when the key lost the past of a hand-off pending for this
    module's layer."""
    p: _Pending | None = getattr(_local, "pending", None)
    _local.pending = None
    past = past_of(key)
    if (past is None and p is not None and p.owner() is not None and p.layer_idx is not None
            and p.layer_idx == getattr(module, "layer_idx", None)):
        raise HandoffError(
            f"kvarn: {_where(p)} holds {p.tokens} cached tokens, but its attention function received a key tensor "
            "without the packed KV cache hand-off: the model copied or cast the key returned by cache.update (e.g. "
            "key_states.clone() or .to(another dtype), or a torch.compile'd graph), and attending over it would "
            "silently ignore the whole cache. Build the cache with KVarNCache(..., attention='reference') to hand "
            "the model dequantized K/V instead.")
    return past


def clear(owner: object) -> None:
    """Forget a hand-off `owner` left pending (cache reset)."""
    p: _Pending | None = getattr(_local, "pending", None)
    if p is not None and p.owner() is owner:
        _local.pending = None


# -- padding, from the mask transformers builds -----------------------------------------------------------------
def expect_mask(owner: object) -> None:
    """`owner` (a cache) is asked for its mask sizes: the mask built next is for its forward."""
    _local.mask_owner = weakref.ref(owner)
    _local.mask = _local.pads = None


def recording_padding(mask_fn):
    """A mask-interface function that first records the 2-D padding mask it is given for the cache that expects it."""
    if getattr(mask_fn, "kvarn_wraps", None) is not None:
        return mask_fn

    def mask(*args, **kwargs):
        _local.pending = None  # a new forward begins: a hand-off left by a direct cache.update is stale
        m = kwargs.get("attention_mask")
        if getattr(_local, "mask_owner", None) is not None:
            _local.mask = m if isinstance(m, torch.Tensor) and m.dim() == 2 else None
            _local.pads = None
        return mask_fn(*args, **kwargs)

    mask.kvarn_wraps = mask_fn
    return mask


def padding(owner: object, batch: int, start: int, length: int) -> torch.Tensor | None:
    """[batch, length] bool, True where positions [start, start + length) of the mask `owner` expected are pads;
    None when no such mask was recorded, it does not cover those positions, or nothing there is a pad. Computed once
    per forward (every layer of the cache asks for the same positions)."""
    ref = getattr(_local, "mask_owner", None)
    m = getattr(_local, "mask", None)
    if ref is None or ref() is not owner or m is None or m.shape[0] != batch or m.shape[1] < start + length:
        return None
    memo = getattr(_local, "pads", None)
    if memo is None or memo[0] != (start, length):
        pad = ~m[:, start:start + length].bool()
        memo = _local.pads = ((start, length), pad if bool(pad.any()) else None)
    return memo[1]
