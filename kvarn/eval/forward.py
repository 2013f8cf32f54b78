"""Running a HF causal LM block by block on a cache, and watching what its attention layers produce.

Everything here is model-agnostic: the decoder layers are found through `model.get_decoder().layers`
(Llama, Qwen2/3, Mistral, Phi-3, Gemma 2/3 all expose them), each holding a `self_attn` module whose
output[0] is the attention output after o_proj, [B, t, hidden]. The quantized cache is the library's
own `KVarNCache`; the reference is a transformers `DynamicCache` fed the same blocks.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from kvarn.integrations.transformers import cache_kwarg
from kvarn.presets import Preset


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a HF causal LM (each with `.self_attn`)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not all(hasattr(m, "self_attn") for m in layers):
        raise ValueError(f"{type(model).__name__}: no decoder layers with `self_attn` found")
    return layers


def quantizable_layers(model: nn.Module) -> int:
    """Layers whose cache a preset quantizes: the full-attention ones (sliding-window layers stay the model's own,
    exact, as `KVarNCache` keeps them), so per-model bit counts (`Preset.bits_per_element(d, n)`) average over them."""
    c = model.config
    c = c.get_text_config() if hasattr(c, "get_text_config") else c
    kinds = getattr(c, "layer_types", None)
    return sum(k == "full_attention" for k in kinds) if kinds else len(decoder_layers(model))


def head_dim(model: nn.Module) -> int:
    c = model.config
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


class AttentionRecorder:
    """Forward hooks keeping the latest attention output of every layer: outputs[l] [B, t, hidden]."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = decoder_layers(model)
        self.outputs: list[torch.Tensor | None] = [None] * len(self.layers)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def _hook(self, i: int):
        def keep(_module, _args, output):
            self.outputs[i] = (output[0] if isinstance(output, tuple) else output).detach()

        return keep

    def __enter__(self) -> AttentionRecorder:
        self._handles = [m.self_attn.register_forward_hook(self._hook(i)) for i, m in enumerate(self.layers)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def take(self) -> list[torch.Tensor]:
        """The outputs of the last forward, and forget them."""
        out, self.outputs = self.outputs, [None] * len(self.layers)
        if any(o is None for o in out):
            raise RuntimeError("an attention layer did not run in the last forward")
        return out


def reference_cache(model: nn.Module):
    """An unquantized transformers cache (the full-precision reference)."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def quantized_cache(model: nn.Module, preset: Preset | str, sink: int | None = None, keep_decoded: bool = True):
    """The library's transformers cache under `preset`, on its reference read path (stored content
    dequantized, then the model's own attention), so every quantizer's `decode` is what attention sees.
    `keep_decoded` keeps a decoded copy of the tiles, which only saves decoding them again at each step."""
    try:
        from kvarn.integrations.transformers import KVarNCache
    except ImportError as e:  # pragma: no cover - only while the cache module is missing
        raise ValueError(f"kvarn.integrations.transformers.KVarNCache is not available: {e}") from e
    return KVarNCache(model.config, preset=preset, sink=sink, keep_decoded=keep_decoded, attention="reference")


def newest_kv(cache, t: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The K/V of the newest t positions in every layer of a DynamicCache, each [B, H_kv, t, D]."""
    return [(layer.keys[:, :, -t:], layer.values[:, :, -t:]) for layer in cache.layers]


def override_store(cache, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Static mode: the next update of every layer l stores kv[l] = (k, v) [B, H_kv, t, D] instead of its own."""
    for layer, (k, v) in enumerate(kv):
        cache.set_store_override(layer, k, v)


def forward_block(model: nn.Module, ids: torch.Tensor, cache) -> torch.Tensor:
    """Append the block ids [B, t] to `cache` and return its next-token logits [B, t, V] (float32)."""
    return model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache}).logits.float()


@contextmanager
def inference(model: nn.Module):
    """Eval mode and no autograd for the duration."""
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            yield
    finally:
        model.train(was_training)


@torch.no_grad()
def capture_kv(model, input_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Full-precision (post-RoPE) keys and values of every attention layer, each [B, H_kv, T, D]."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    model(input_ids=input_ids, use_cache=True, **{cache_kwarg(model): cache})
    return [(layer.keys, layer.values) for layer in cache.layers]
