"""Glue between a loaded model and kvarn's cache: attention mode and cache construction."""

from __future__ import annotations

from kvarn.presets import Preset, get_preset


def prepare_model(model, attention: str = "packed") -> None:
    """`packed`: attention reads the packed cache directly (attn_implementation="kvarn");
    `reference`: the model keeps its own attention and caches from `make_cache` hand it dequantized K/V."""
    if attention == "packed":
        import kvarn.attention

        kvarn.attention.enable(model)
    elif attention != "reference":
        raise ValueError(f"attention must be 'packed' or 'reference', got {attention!r}")
    model.kvarn_attention = attention


def make_cache(model, preset: Preset | str, sink: int | None = None, **kwargs):
    """A KVarNCache for `model`, on the read path `prepare_model` chose (packed by default)."""
    from kvarn.integrations.transformers import KVarNCache

    if getattr(model, "kvarn_attention", "packed") == "reference":
        kwargs.setdefault("attention", "reference")
    return KVarNCache(model.config, preset=get_preset(preset), sink=sink, **kwargs)
