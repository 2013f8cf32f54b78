"""Attention over the kvarn cache. Importing this package registers attn_implementation "kvarn" with transformers
(`AttentionInterface` -> `kvarn_attention_forward`, `AttentionMaskInterface` -> transformers' `sdpa_mask`, so masks
are boolean, True = attend, or None for plain causal)."""

from __future__ import annotations

from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvarn.attention.packed import (
    KVarNPast,
    attach_past,
    kvarn_attention_forward,
    observing,
    packed_attention,
    past_of,
)
from kvarn.attention.reference import past_kv, reference_attention, reference_from_past

IMPLEMENTATION = "kvarn"

AttentionInterface.register(IMPLEMENTATION, kvarn_attention_forward)
# The registered implementations (sdpa, flash, flex) also hand the queries to the observer a KVarNCache attaches
# to the key, so the key-rotation policy (kvarn.quant.policy) sees the same query statistics on the reference read
# path as under "kvarn"; for any other key each is transformers' own function. "eager" is each model's own
# function, outside the registry: it observes nothing and the policy falls back to unweighted squared error.
for _name, _fn in list(AttentionInterface._global_mapping.items()):
    if _name != IMPLEMENTATION:
        AttentionInterface.register(_name, observing(_fn))
AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)


def enable(model, implementation: str = IMPLEMENTATION):
    """Switch `model` to attn_implementation "kvarn" (packed reads from a `KVarNCache`; any other cache or layer
    attends as SDPA would). `implementation` lets a caller switch back, e.g. enable(model, "sdpa"). Returns model."""
    model.set_attn_implementation(implementation)
    return model


__all__ = ["IMPLEMENTATION", "KVarNPast", "attach_past", "enable", "kvarn_attention_forward", "packed_attention",
           "past_kv", "past_of", "reference_attention", "reference_from_past"]
