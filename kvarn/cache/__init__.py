"""Cache storage (model-agnostic) and the transformers integration."""

from kvarn.cache.store import LayerStore, TensorStore

__all__ = ["LayerStore", "TensorStore"]
