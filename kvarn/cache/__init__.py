"""Model-agnostic cache storage: sink, packed tiles and tail per layer (`store`), growable buffers, bytes held.
Engines use it through `kvarn.integrations` (transformers, vLLM)."""

from kvarn.cache.store import LayerStore, TensorStore

__all__ = ["LayerStore", "TensorStore"]
