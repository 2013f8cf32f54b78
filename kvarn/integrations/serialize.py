"""Save a `KVarNCache` to one safetensors file and load it back, bit for bit.

    save_cache(cache, "prefix.kvarn.safetensors")
    cache = load_cache("prefix.kvarn.safetensors", model.config)        # resume, or reuse a shared prefix

What is stored, per layer: the sink, the packed fields [B, H, n_tiles, ...] (used part only), the tail and its pad
mask, the tiles kept exact (index and values), the store's counters and dtype, the RoPE positions (key_pre_rope
presets), the rotation policy's running query statistics (rotate="auto"), and the tokens of sliding-window layers.
Decoding continues exactly as it would have from the original cache.

The header (safetensors metadata, key "kvarn") records the format version, kvarn's version, the preset's full
record (`Preset.to_dict`: name, version, each quantizer's `describe()`, the builder parameters and the cache
policy's `to_dict()`), the model (type, layers, KV heads, head_dim, layer types) and a SHA-256 over every tensor's
name, dtype, shape and bytes. `load_cache` rebuilds the preset (by the saved name, or the one passed) and refuses,
naming the mismatch: a file that is not a complete safetensors file (truncated), a checksum that does not match
(corrupted), another format or kvarn version (format 1 recorded less of the preset: save such caches again),
another preset, any field of the method or the policy that differs (e.g. `preset 'x' key.bits`), or a model config
that differs in type, layers, KV heads, head_dim or layer types.
"""

from __future__ import annotations

import hashlib
import json
from os import PathLike
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers.cache_utils import DynamicSlidingWindowLayer

import kvarn
from kvarn.cache.store import StoreStats, TensorStore
from kvarn.integrations.transformers import (
    DummyLayer,
    KVarNCache,
    KVarNLayer,
    config_head_dim,
    config_kv_heads,
    text_config,
)
from kvarn.presets import Preset, get_preset

FORMAT = "kvarn-cache"
FORMAT_VERSION = 2  # 2: the preset's full record (method and policy); 1 had its name and quantizers only


class CacheFileError(ValueError):
    """A cache file that cannot be loaded: unreadable, corrupted or made for something else."""


def _dtype_name(d: torch.dtype | None) -> str | None:
    return None if d is None else str(d).removeprefix("torch.")


def _dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else getattr(torch, name)


def _model_id(config) -> dict[str, Any]:
    from transformers.cache_utils import get_layer_types_and_kwargs

    text = text_config(config)
    return {"model_type": getattr(text, "model_type", None), "num_layers": text.num_hidden_layers,
            "kv_heads": config_kv_heads(text), "head_dim": config_head_dim(text),
            "layer_types": list(get_layer_types_and_kwargs(text)[0])}


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}|{_dtype_name(t.dtype)}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


# -- saving ------------------------------------------------------------------------------------------------------
def _store_state(s: TensorStore, prefix: str, out: dict[str, torch.Tensor]) -> dict[str, Any]:
    if s.length:
        for name, t in (("sink", s.sink), ("tail", s.tail), ("tail_pad", s.tail_pad),
                        ("exact_values", s.exact_values)):
            if t is not None:
                out[f"{prefix}.{name}"] = t
        if len(s.exact_index):
            out[f"{prefix}.exact_index"] = s.exact_index
        for name, t in s.packed.items():
            out[f"{prefix}.packed.{name}"] = t
    return {"length": s.length, "shape_bhd": list(s.shape_bhd) if s.length else None,
            "dtype": _dtype_name(s.dtype) if s.length else None, "exact_dtype": _dtype_name(s.exact_dtype),
            "sink_len": s.sink_len, "stats": vars(s.stats)}


def save_cache(cache: KVarNCache, path: str | PathLike) -> None:
    """Write every layer of `cache` to `path` (safetensors; module docstring)."""
    if not isinstance(cache, KVarNCache):
        raise TypeError(f"save_cache expects a KVarNCache, got {type(cache).__name__}")
    tensors: dict[str, torch.Tensor] = {}
    layers: list[dict[str, Any]] = []
    for i, layer in enumerate(cache.layers):
        p = f"layers.{i}"
        if isinstance(layer, KVarNLayer):
            st = layer.store
            st.settle()
            info: dict[str, Any] = {"kind": "kvarn", "quantized": st.keys.quantizer is not None,
                                    "keys": _store_state(st.keys, f"{p}.keys", tensors),
                                    "values": _store_state(st.values, f"{p}.values", tensors),
                                    "queries_count": None if st.queries is None else st.queries.count}
            if st.queries is not None and st.queries.sum is not None:
                tensors[f"{p}.queries.sum"] = st.queries.sum
            if layer.positions is not None:
                tensors[f"{p}.positions"] = layer.positions
        elif isinstance(layer, DynamicSlidingWindowLayer):
            info = {"kind": "sliding", "cumulative_length": layer.cumulative_length}
            if layer.is_initialized and layer.keys is not None and layer.keys.numel():
                tensors[f"{p}.keys"], tensors[f"{p}.values"] = layer.keys, layer.values
        elif isinstance(layer, DummyLayer):
            info = {"kind": "dummy"}
        else:
            raise TypeError(f"layer {i} is a {type(layer).__name__}, which save_cache does not know")
        layers.append(info)
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    header = {"format": FORMAT, "format_version": FORMAT_VERSION, "kvarn_version": kvarn.__version__,
              "preset": cache.preset.to_dict(cache.head_dim), "model": _model_id(cache.config),
              "attention": cache.attention, "layers": layers, "sha256": _checksum(tensors)}
    if cache.key_allocation is not None:  # budget presets: the online decision (which layers' keys are promoted)
        header["key_allocation"] = dict(cache.key_allocation.report_dict())
    save_file(tensors, str(path), metadata={"kvarn": json.dumps(header)})


# -- loading -----------------------------------------------------------------------------------------------------
def _read(path: str | PathLike) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    except FileNotFoundError:
        raise
    except Exception as e:  # safetensors raises its own error types for truncated or malformed files
        raise CacheFileError(f"{path}: not a complete safetensors file (truncated or corrupted?): {e}") from e
    if "kvarn" not in meta:
        raise CacheFileError(f"{path}: a safetensors file without a kvarn cache header (not saved by save_cache)")
    try:
        header = json.loads(meta["kvarn"])
    except json.JSONDecodeError as e:
        raise CacheFileError(f"{path}: the kvarn header is not valid JSON (corrupted?): {e}") from e
    # checked before anything else is read from the header: another format lays it out differently
    if header.get("format") != FORMAT:
        raise CacheFileError(f"{path}: format mismatch: the file has {header.get('format')!r}, this load has "
                             f"{FORMAT!r}")
    if header.get("format_version") != FORMAT_VERSION:
        raise CacheFileError(f"{path}: format version mismatch: the file has {header.get('format_version')!r}, this "
                             f"load has {FORMAT_VERSION!r}" + (" (format 1 recorded the preset's name and quantizers "
                             "only, not its full method and policy: save the cache again with this kvarn)"
                             if header.get("format_version") == 1 else ""))
    return header, tensors


def _check(header: dict[str, Any], tensors: dict[str, torch.Tensor], path, config, preset: Preset,
           head_dim: int) -> None:
    def refuse(what: str, saved, now) -> None:
        raise CacheFileError(f"{path}: {what} mismatch: the file has {saved!r}, this load has {now!r}")

    if header.get("kvarn_version") != kvarn.__version__:
        refuse("kvarn version", header.get("kvarn_version"), kvarn.__version__)
    if _checksum(tensors) != header.get("sha256"):
        raise CacheFileError(f"{path}: checksum mismatch: the tensors do not match the SHA-256 recorded when the "
                             "file was saved (corrupted)")
    model = _model_id(config)
    for key, what in (("model_type", "model type"), ("num_layers", "number of layers"),
                      ("kv_heads", "number of KV heads"), ("head_dim", "head_dim"), ("layer_types", "layer types")):
        if header["model"].get(key) != model[key]:
            refuse(what, header["model"].get(key), model[key])
    saved = header["preset"]
    if saved.get("name") != preset.name:
        refuse("preset", saved.get("name"), preset.name)
    diffs = preset.differences(saved, head_dim)  # the method (quantizers, parameters) and the policy, by field
    if diffs:
        (field, was, now), more = diffs[0], [d[0] for d in diffs[1:]]
        raise CacheFileError(f"{path}: preset {preset.name!r} {field} mismatch: the file has {was!r}, this load has "
                             f"{now!r}" + (f" (also differ: {', '.join(more)})" if more else ""))


def _restore_store(s: TensorStore, state: dict[str, Any], prefix: str, t: dict[str, torch.Tensor],
                   device: torch.device | str) -> None:
    def get(name: str) -> torch.Tensor | None:
        x = t.get(f"{prefix}.{name}")
        return None if x is None else x.to(device)

    s.exact_dtype = _dtype(state["exact_dtype"])
    s.stats = StoreStats(**state["stats"])
    if not state["length"]:
        return
    s.length, s.shape_bhd = state["length"], tuple(state["shape_bhd"])
    s.dtype, s.device = _dtype(state["dtype"]), torch.device(device)
    s._sink.replace(get("sink"))
    s.tail, s.tail_pad = get("tail"), get("tail_pad")
    fields = {k.removeprefix(f"{prefix}.packed."): v.to(device) for k, v in t.items()
              if k.startswith(f"{prefix}.packed.")}
    packed = s.quantizer.template(s.shape_bhd[2]).with_tensors(fields) if fields else s.packed
    if set(packed.names()) != set(fields):
        raise CacheFileError(f"{prefix}: packed fields {sorted(fields)} are not those of the preset's tiles "
                             f"{sorted(packed.names())} (corrupted)")
    s._packed.replace(packed)
    ei = get("exact_index")
    s.exact_index = ei if ei is not None else torch.zeros(0, 3, dtype=torch.long, device=device)
    s.exact_values = get("exact_values")
    if s._decoded is not None and s.n_tiles:
        s._decoded.replace(s._decode_packed(s.packed, 0))
    if s.tiles_start + s.n_tiles * (s.quantizer.tile if s.quantizer else 0) + (
            0 if s.tail is None else s.tail.shape[2]) != s.length:
        raise CacheFileError(f"{prefix}: regions do not add up to the recorded length {s.length} (corrupted)")


def load_cache(path: str | PathLike, config, preset: Preset | str | None = None, attention: str | None = None,
               keep_decoded: bool = False, device: torch.device | str = "cpu", nonfinite: str = "exact") -> KVarNCache:
    """A `KVarNCache` for `config` holding exactly what `save_cache` wrote to `path`. `preset` defaults to the saved
    preset's name (a custom `Preset` must be passed); `attention` to the saved read path."""
    header, tensors = _read(path)
    if preset is None:
        try:
            preset = get_preset(header["preset"]["name"])
        except ValueError as e:
            saved = header["preset"]
            raise CacheFileError(f"{path}: the file was saved with preset {saved['name']!r}, which is not registered "
                                 f"here (key {saved.get('key')}, value {saved.get('value')}, policy "
                                 f"{saved.get('policy')}): register it or pass it as `preset=`") from e
    preset = get_preset(preset)
    head_dim = config_head_dim(text_config(config))
    _check(header, tensors, path, config, preset, head_dim)
    sink = next((lay["keys"]["sink_len"] for lay in header["layers"] if lay["kind"] == "kvarn"), None)
    cache = KVarNCache(config, preset, sink=sink, keep_decoded=keep_decoded,
                       attention=attention or header.get("attention", "auto"), nonfinite=nonfinite)
    alloc, saved_alloc = cache.key_allocation, header.get("key_allocation")
    if (alloc is None) != (saved_alloc is None):
        raise CacheFileError(f"{path}: the file {'has no' if saved_alloc is None else 'has a'} key allocation, the "
                             f"preset here {'has one' if saved_alloc is None else 'has none'}")
    if alloc is not None:
        try:
            for layer_idx, score in saved_alloc["scores"].items():
                alloc.scores[int(layer_idx)] = float(score)
            for layer_idx, score in saved_alloc.get("mid_scores", {}).items():
                alloc.mid_scores[int(layer_idx)] = float(score)
            if saved_alloc["promoted"] is not None:
                alloc.decide(saved_alloc["promoted"], saved_alloc.get("middle") or ())
        except (KeyError, TypeError, ValueError) as e:
            raise CacheFileError(f"{path}: the saved key allocation {saved_alloc} does not fit this cache: {e}") from e
    for i, (layer, info) in enumerate(zip(cache.layers, header["layers"])):
        p = f"layers.{i}"
        if info["kind"] == "kvarn":
            st = layer.store
            if (st.keys.quantizer is not None) != info["quantized"]:
                raise CacheFileError(f"{path}: layer {i} quantized={info['quantized']} in the file but not here")
            if alloc is not None and alloc.decided and st.allocation is not None:
                st.keys.set_quantizer(alloc.quantizer(i))  # this layer's key code width, before its tiles
            _restore_store(st.keys, info["keys"], f"{p}.keys", tensors, device)
            _restore_store(st.values, info["values"], f"{p}.values", tensors, device)
            if st.queries is not None and f"{p}.queries.sum" in tensors:
                st.queries.sum, st.queries.count = tensors[f"{p}.queries.sum"].to(device), info["queries_count"]
            pos = tensors.get(f"{p}.positions")
            layer.positions = None if pos is None else pos.to(device)
            if st.length:
                layer.device, layer.dtype, layer.is_initialized = torch.device(device), st.keys.dtype, True
        elif info["kind"] == "sliding" and f"{p}.keys" in tensors:
            k, v = tensors[f"{p}.keys"].to(device), tensors[f"{p}.values"].to(device)
            layer.lazy_initialization(k, v)
            layer.keys, layer.values, layer.cumulative_length = k, v, info["cumulative_length"]
    return cache
