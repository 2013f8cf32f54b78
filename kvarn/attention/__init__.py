"""Attention over the kvarn cache. Importing this package

* registers attn_implementation "kvarn" with transformers (`AttentionInterface` -> `kvarn_attention_forward`,
  `AttentionMaskInterface` -> transformers' `sdpa_mask`, so masks are boolean, True = attend, or None for causal);
* wraps every other registered attention implementation ("sdpa", flash, flex, ...) with `reading_packed`: a key that
  carries a KVarN past is answered from the packed cache, any other key by transformers' own function;
* wraps every registered mask function so a `KVarNCache` learns which positions are left padding
  (`kvarn.attention.handoff`).

`KVarNCache` hands the packed past only to implementations that read it *and* whose masks the packed path reads
(4-D boolean or additive, or None): `packed_reads(name)`. "eager" is each model's own function, outside the registry,
so a model running it gets dequantized K/V (the reference path) and one warning saying so.
"""

from __future__ import annotations

from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from kvarn.attention.handoff import HandoffError, attach_past, past_of, recording_padding
from kvarn.attention.packed import KVarNPast, kvarn_attention_forward, packed_attention, reading_packed
from kvarn.attention.reference import past_kv, reference_attention, reference_from_past

IMPLEMENTATION = "kvarn"
# mask functions whose output the packed path reads (4-D bool / additive float, or None for plain causal)
_READABLE_MASKS = (sdpa_mask, eager_mask)

AttentionInterface.register(IMPLEMENTATION, kvarn_attention_forward)
AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)
for _name, _fn in list(AttentionInterface._global_mapping.items()):
    if _name != IMPLEMENTATION:
        AttentionInterface.register(_name, reading_packed(_fn))
for _name, _fn in list(AttentionMaskInterface._global_mapping.items()):
    AttentionMaskInterface.register(_name, recording_padding(_fn))


def _unwrapped(fn):
    return getattr(fn, "kvarn_wraps", fn)


def packed_reads(implementation: str | None) -> str | None:
    """None when a model running attn_implementation `implementation` reads a KVarN past from the packed cache, else
    the reason it cannot (for the warning of the reference path)."""
    if implementation == IMPLEMENTATION:
        return None
    if not implementation:
        return "the model config names no attention implementation (build the cache from model.config)"
    fn = AttentionInterface._global_mapping.get(implementation)
    if fn is None:
        return (f"attention implementation {implementation!r} is the model's own function, outside transformers' "
                "AttentionInterface registry that kvarn wraps")
    if getattr(fn, "kvarn_wraps", None) is None:
        return f"attention implementation {implementation!r} was registered after kvarn wrapped the registry"
    if _unwrapped(AttentionMaskInterface._global_mapping.get(implementation)) not in _READABLE_MASKS:
        return (f"attention implementation {implementation!r} builds masks (2-D padding masks or block masks) that "
                "kvarn's packed path does not read")
    return None


def enable(model, implementation: str = IMPLEMENTATION):
    """Switch `model` to attn_implementation "kvarn" (packed reads from a `KVarNCache`; any other cache or layer
    attends as SDPA would). Not needed for packed reads under "sdpa", which kvarn wraps too. `implementation` lets a
    caller switch back, e.g. enable(model, "sdpa"). Returns model."""
    model.set_attn_implementation(implementation)
    return model


__all__ = ["IMPLEMENTATION", "HandoffError", "KVarNPast", "attach_past", "enable", "kvarn_attention_forward",
           "packed_attention", "packed_reads", "past_kv", "past_of", "reference_attention", "reference_from_past"]
