"""The transformers cache: one `KVarNLayer` (a `LayerStore`) per full-attention decoder layer.

    cache = KVarNCache(model.config, preset="kvarn-k2v2-g128")
    model.generate(**inputs, cache=cache)            # or past_key_values=cache

Semantics of one forward over q new tokens, per layer: the new tokens attend to the cache content *as stored* (sink
exact, tiles quantized, tail exact) plus their own fresh K/V exactly; then their K/V are appended, and every tile
that completes is quantized once and never again.

Two read paths, chosen per update from the model config's attention implementation:
  * reference (any implementation: "sdpa", "eager", ...): `update` returns the stored content dequantized and
    concatenated with the fresh K/V, [B, H, T_past + q, D], so the model's own attention runs unchanged;
  * packed ("kvarn", see `kvarn.attention.enable`): `update` returns the fresh K/V only, with a view of the stored
    content attached to the returned key tensor (`kvarn.attention.packed.past_of`); the "kvarn" attention function
    computes attention from the packed codes and folded scales. Every supported modeling file passes `key_states`
    from `cache.update` to the attention function untouched, which is what makes this hand-off work.
  `attention="reference"` forces the reference path even under "kvarn" (for benchmarks and checks).

Layers the method does not touch:
  * sliding-window / chunked layers (`layer_types`, Gemma2/3, Mistral with `sliding_window`) are transformers'
    `DynamicSlidingWindowLayer`, in the model dtype, with its window semantics;
  * the first/last layers named by `preset.fp_layers` keep everything exact (a `LayerStore` that never quantizes);
  * the `fp16` preset quantizes nothing, which makes the cache behave exactly like `DynamicCache`.

Keys quantized before RoPE (`preset.key_pre_rope`): the layer learns each token's position (`position_ids` from the
attention kwargs, else consecutive positions after those already cached), stores keys with RoPE undone
(`kvarn.cache.rope`), and re-applies it after dequantizing; the positions are kept per token (int32, counted in
`Bytes.positions`). The exact regions then come back within float32 rounding of the RoPE round trip, not bitwise.

Batches with left padding: pad positions are stored like any token (the cache does not see the padding mask) and
are excluded by the attention mask. They do share quantization tiles with real tokens of their row, so a pad key in
a tile takes part in that tile's per-channel ranges; with the default sink of 128 tokens, left pads of prompts
shorter than that lie in the exact sink.

Non-finite K/V: a tile holding NaN/Inf is kept exact by the store (counted in `Bytes.exact_tiles`); attention then
propagates the non-finite values exactly as full-precision attention would.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DummyLayer,
    DynamicSlidingWindowLayer,
    get_layer_types_and_kwargs,
)

from kvarn.attention.packed import KVarNPast, attach_observer, attach_past
from kvarn.attention.view import StoredKV
from kvarn.cache.rope import Rope
from kvarn.cache.store import Bytes, LayerStore
from kvarn.presets import DEFAULT_PRESET, Preset, get_preset

AttentionPath = Literal["auto", "reference"]
SLIDING_TYPES = ("sliding_attention", "chunked_attention")


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def text_config(config):
    """The decoder text config of a (possibly multimodal) config."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def config_head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def config_kv_heads(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


class KVarNLayer(CacheLayerMixin):
    """One full-attention layer backed by a `LayerStore` (sink exact, packed tiles, exact tail)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, preset: Preset | str, num_kv_heads: int, head_dim: int, sink: int | None = None,
                 quantize: bool = True, keep_decoded: bool = False, rope: Rope | None = None,
                 packed: Callable[[], bool] = lambda: False, layer_idx: int | None = None,
                 exact_dtype: torch.dtype | None = None, nonfinite: str = "exact") -> None:
        super().__init__()
        self.preset = get_preset(preset)
        self.num_kv_heads, self.head_dim, self.layer_idx = num_kv_heads, head_dim, layer_idx
        self._store_args = (self.preset, head_dim, sink, quantize, keep_decoded, exact_dtype, nonfinite)
        self.store = LayerStore(*self._store_args)
        self.rope = rope
        self.positions: torch.Tensor | None = None  # [B, T] int32, only with `rope`
        self._packed = packed

    def __repr__(self) -> str:
        q = "quantized" if self.store.keys.quantizer is not None else "exact"
        return f"KVarNLayer({self.preset.name}, {q}, T={self.get_seq_length()})"

    # -- transformers layer API -----------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def _check(self, k: torch.Tensor, v: torch.Tensor) -> None:
        where = f"layer {self.layer_idx}: " if self.layer_idx is not None else ""
        if k.dim() != 4 or v.dim() != 4:
            raise ValueError(f"{where}expected K/V of shape [batch, kv_heads, tokens, head_dim], got "
                             f"{tuple(k.shape)} and {tuple(v.shape)}")
        if k.shape[1] != self.num_kv_heads:
            raise ValueError(f"{where}the model produced {k.shape[1]} KV heads but the cache was built for "
                             f"{self.num_kv_heads}: was it built from another model's config?")
        if k.shape[-1] != self.head_dim or v.shape[-1] != self.head_dim:
            raise ValueError(f"{where}the model produced head_dim {k.shape[-1]}/{v.shape[-1]} (K/V) but the cache "
                             f"was built for {self.head_dim}: was it built from another model's config?")
        if k.shape[:3] != v.shape[:3]:
            raise ValueError(f"{where}keys {tuple(k.shape)} and values {tuple(v.shape)} disagree on [B, H, T]")
        if self.store.length and k.shape[0] != self.store.keys.shape_bhd[0]:
            raise ValueError(f"{where}batch size {k.shape[0]} differs from the {self.store.keys.shape_bhd[0]} rows "
                             "already cached")

    def _new_positions(self, k: torch.Tensor, attn_kwargs: dict) -> torch.Tensor:
        """[B, q] positions of the new tokens (int32)."""
        b, q = k.shape[0], k.shape[2]
        pos = attn_kwargs.get("position_ids")
        if pos is None:
            start = self.get_seq_length()
            pos = torch.arange(start, start + q, device=k.device).unsqueeze(0)
        if pos.dim() != 2 or pos.shape[-1] != q:
            raise ValueError(f"position_ids of shape {tuple(pos.shape)} do not fit {q} new tokens; key_pre_rope "
                             "presets need 2-D [batch, tokens] positions")
        return pos.to(device=k.device, dtype=torch.int32).expand(b, q)

    def _rope_post(self, positions: torch.Tensor) -> Callable[[torch.Tensor, int], torch.Tensor]:
        def post(x: torch.Tensor, first: int) -> torch.Tensor:
            return self.rope.apply(x, positions[:, first:first + x.shape[2]])

        return post

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               store: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Return what attention needs for the new tokens, then append their K/V (or `store`, if given)."""
        self._check(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        sk, sv = (key_states, value_states) if store is None else store
        new_pos = None
        if self.rope is not None:
            new_pos = self._new_positions(key_states, kwargs.get("kwargs") or {})
            sk = self.rope.invert(sk, new_pos)
        past_pos = self.positions
        if self._packed():
            post = self._rope_post(past_pos) if self.rope is not None else None
            self.store.settle()  # key tiles left pending by a previous step that observed no query
            past = KVarNPast(StoredKV.of(self.store.keys, post), StoredKV.of(self.store.values))
            # the attention function observes this step's queries, which settles the deferred key tiles
            self._append(sk, sv, new_pos, defer=True)
            key = attach_past(key_states, past) if past.length else key_states
            return self._observed(key), value_states
        if self.store.length:
            pk, pv = self.store.full()
            if self.rope is not None:
                pk = self.rope.apply(pk, past_pos)
            out = torch.cat([pk.to(key_states.dtype), key_states], dim=2), torch.cat([pv.to(value_states.dtype),
                                                                                      value_states], dim=2)
        else:
            out = key_states, value_states
        self._append(sk, sv, new_pos, defer=True)
        return self._observed(out[0]), out[1]

    def _observed(self, key: torch.Tensor) -> torch.Tensor:
        """Hand the store's query observer to the attention function (policy statistics, kvarn.quant.policy)."""
        return key if self.store.queries is None else attach_observer(key, self.store.observe_queries)

    def _append(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None, defer: bool = False) -> None:
        self.store.append(k, v, defer_keys=defer)
        if positions is not None:
            self.positions = positions if self.positions is None else torch.cat([self.positions, positions], dim=1)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.store.length

    def get_max_length(self) -> int:
        return -1

    def nbytes(self) -> Bytes:
        b = self.store.nbytes()
        b.positions = _nbytes(self.positions)
        return b

    # -- housekeeping -----------------------------------------------------------------------------------
    def reset(self) -> None:
        self.store = LayerStore(*self._store_args)
        self.positions = None
        self.is_initialized = False

    def offload(self) -> None:  # the packed store stays where it is
        pass

    def prefetch(self) -> None:
        pass

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise ValueError("KVarNCache cannot be cropped: complete tiles are quantized once and not kept exact")

    def _index_batch(self, index: torch.Tensor) -> None:
        if not self.store.length:
            return
        index = index.to(self.store.keys.device)
        self.store.keys.index_batch(index)
        self.store.values.index_batch(index)
        if self.store.queries is not None:
            self.store.queries.index_batch(index)
        if self.positions is not None:
            self.positions = self.positions[index]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._index_batch(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._index_batch(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.store.length:
            self._index_batch(torch.arange(self.store.keys.shape_bhd[0]).repeat_interleave(repeats))


class KVarNCache(Cache):
    """A transformers `Cache` storing K/V under a kvarn preset (see the module docstring).

    config        the model config (multimodal configs: their decoder text config is used)
    preset        a preset name or `Preset` (`kvarn.preset_names()`)
    sink          tokens kept exact at the start (default: the preset's, 128); 0 allowed
    keep_decoded  also keep the decoded tiles (faster reference reads; memory not counted in `nbytes`)
    exact_dtype   dtype of the sink of quantized layers: float16 by default, what an fp16 deployment holds (a
                  float32 model's sink would otherwise cost 4 bytes per element); None keeps the model's dtype.
                  Values beyond float16's range keep that store's sink in the model's dtype (`kvarn.cache.store`).
                  The transient tail, full-precision layers and the `fp16` preset keep the model's dtype.
    nonfinite     "exact": tiles with NaN/Inf or overflow are kept exact (counted); "error": refuse them
                  (kvarn.cache.store)
    attention     "auto": packed reads when the model runs attn_implementation "kvarn", else reference;
                  "reference": always return dequantized K/V
    """

    def __init__(self, config, preset: Preset | str = DEFAULT_PRESET, sink: int | None = None,
                 keep_decoded: bool = False, attention: AttentionPath = "auto",
                 exact_dtype: torch.dtype | None = torch.float16, nonfinite: str = "exact") -> None:
        if attention not in ("auto", "reference"):
            raise ValueError(f"attention must be 'auto' or 'reference', got {attention!r}")
        self.config = config
        self.preset = get_preset(preset)
        self.attention = attention
        text = text_config(config)
        self.num_kv_heads, self.head_dim = config_kv_heads(text), config_head_dim(text)
        n = text.num_hidden_layers
        first, last = self.preset.fp_layers
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
        layers: list = []
        for i, (kind, kw) in enumerate(zip(layer_types, layer_kwargs)):
            if kind in SLIDING_TYPES:
                layers.append(DynamicSlidingWindowLayer(**kw))
            elif kind == "full_attention":
                quantize = self.preset.quantized and not (i < first or i >= n - last)
                rope = Rope(text, "full_attention") if quantize and self.preset.key_pre_rope else None
                layers.append(KVarNLayer(self.preset, self.num_kv_heads, self.head_dim, sink, quantize, keep_decoded,
                                         rope, self._packed_reads, i, exact_dtype if quantize else None, nonfinite))
            elif kind == "dummy":
                layers.append(DummyLayer())
            else:
                raise ValueError(f"layer {i} has type {kind!r}; KVarNCache supports full attention, sliding-window "
                                 "and chunked attention layers")
        self._overrides: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        super().__init__(layers=layers)

    def _packed_reads(self) -> bool:
        return self.attention == "auto" and getattr(self.config, "_attn_implementation", None) == "kvarn"

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx >= len(self.layers):
            raise ValueError(f"the model updated layer {layer_idx} but the cache was built for {len(self.layers)} "
                             "layers: was it built from another model's config?")
        if layer_idx == 0:
            self._check_lengths()
        layer = self.layers[layer_idx]
        override = self._overrides.pop(layer_idx, None)
        if override is None:
            return layer.update(key_states, value_states, *args, **kwargs)
        ok, ov = override
        if ok.shape != key_states.shape or ov.shape != value_states.shape:
            raise ValueError(f"store override for layer {layer_idx} has shapes {tuple(ok.shape)}/{tuple(ov.shape)}, "
                             f"the fresh K/V {tuple(key_states.shape)}/{tuple(value_states.shape)}")
        ok, ov = ok.to(key_states), ov.to(value_states)
        if isinstance(layer, KVarNLayer):
            return layer.update(key_states, value_states, *args, store=(ok, ov), **kwargs)
        # full-precision transformers layer: return what it held plus the fresh K/V, store the override
        past = (layer.keys, layer.values) if layer.is_initialized and layer.keys.numel() else None
        layer.update(ok, ov, *args, **kwargs)
        if past is None:
            return key_states, value_states
        return torch.cat([past[0], key_states], dim=-2), torch.cat([past[1], value_states], dim=-2)

    def _check_lengths(self) -> None:
        lengths = {layer.get_seq_length() for layer in self.layers if isinstance(layer, CacheLayerMixin)}
        if len(lengths) > 1:
            raise ValueError(f"cache layers hold different numbers of tokens {sorted(lengths)}: the model that ran "
                             "has fewer layers than the config this cache was built from")

    def set_store_override(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """One-shot: the next update of `layer_idx` stores k, v [B, H, q, D] instead of the fresh K/V, while that
        step's attention still uses the fresh ones (static pseudo-decoding)."""
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(f"layer index {layer_idx} is out of range for a cache of {len(self.layers)} layers")
        if isinstance(self.layers[layer_idx], DummyLayer):
            raise ValueError(f"layer {layer_idx} holds no cache (shared/dummy layer)")
        self._overrides[layer_idx] = (k, v)

    # -- accounting -----------------------------------------------------------------------------------------
    def nbytes_by_layer(self) -> list[Bytes]:
        """Bytes held per layer. Full-precision transformers layers (sliding window) count as `tail`."""
        out = []
        for layer in self.layers:
            if isinstance(layer, KVarNLayer):
                out.append(layer.nbytes())
            elif isinstance(layer, CacheLayerMixin) and layer.is_initialized and layer.keys is not None:
                held = _nbytes(layer.keys) + _nbytes(layer.values)
                out.append(Bytes(tail=held, elements=layer.keys.numel() + layer.values.numel()))
            else:
                out.append(Bytes())
        return out

    def nbytes(self) -> Bytes:
        total = Bytes()
        for b in self.nbytes_by_layer():
            total = total + b
        return total

    def fp16_nbytes(self) -> int:
        """Bytes an fp16 cache would hold for the same tokens (2 bytes per cached element)."""
        return 2 * self.nbytes().elements
