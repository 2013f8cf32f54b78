"""The storage of one attention layer: full-precision sink, packed tiles, full-precision tail.

Positions of one tensor kind (keys or values) along the sequence, for every batch row and KV head:

    [0, sink)                          exact, kept for good
    [sink, sink + n_tiles * G_q)       packed tiles of G_q tokens (the quantizer's tile), never re-quantized
    [.., T)                            exact tail, waiting for its tiles to complete

Keys and values are stored independently (`TensorStore`), so a method may flush them differently
(KIVI keeps a sliding window of exact values). Packed fields are laid out [B, H, n_tiles, ...]: new
tiles are appended along axis 2 and tile j always covers the same positions for every row and head.

A tile whose input holds NaN/Inf, or whose stored scales overflow, is kept exact instead (`exact_*`),
counted in the bytes, and restored bit-for-bit on read.

`exact_dtype` sets the dtype of the sink, kept for good; None keeps the incoming dtype. A 16-bit choice
for a float32 model matches what an fp16 deployment holds; a store that meets a value out of that
dtype's range keeps its sink in the incoming dtype rather than overflow. The tail (fewer than a tile of
tokens, transient) stays in the incoming dtype, so tiles are quantized, or kept exact, from the values
the model produced.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvarn.presets import Preset, get_preset
from kvarn.quant.base import Packed, TileQuantizer
from kvarn.quant.policy import QueryEnergy


@dataclass
class Bytes:
    """Bytes really held, by region."""

    packed: int = 0  # codes and per-tile scales/norms/outliers of the quantized tiles
    sink: int = 0
    tail: int = 0
    exact_tiles: int = 0  # tiles kept exact because of non-finite values
    elements: int = 0  # cached K/V elements
    positions: int = 0  # per-token positions kept to redo RoPE (key_pre_rope presets)

    @property
    def total(self) -> int:
        return self.packed + self.sink + self.tail + self.exact_tiles + self.positions

    @property
    def bits_per_element(self) -> float:
        return self.total * 8 / self.elements if self.elements else 0.0

    def __add__(self, o: Bytes) -> Bytes:
        return Bytes(self.packed + o.packed, self.sink + o.sink, self.tail + o.tail,
                     self.exact_tiles + o.exact_tiles, self.elements + o.elements, self.positions + o.positions)

    def as_dict(self) -> dict[str, float]:
        return {"packed": self.packed, "sink": self.sink, "tail": self.tail, "exact_tiles": self.exact_tiles,
                "positions": self.positions, "total": self.total, "elements": self.elements,
                "bits_per_element": self.bits_per_element}


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class TensorStore:
    """Keys or values of one layer, [B, H, T, D]."""

    def __init__(self, quantizer: TileQuantizer | None, sink: int, flush: int, window: str = "block",
                 keep_decoded: bool = False, exact_dtype: torch.dtype | None = None) -> None:
        if quantizer is not None and flush % quantizer.tile:
            raise ValueError(f"flush unit {flush} is not a multiple of the quantizer tile {quantizer.tile}")
        if window not in ("block", "sliding"):
            raise ValueError(f"window must be 'block' or 'sliding', got {window!r}")
        self.quantizer, self.sink_len, self.flush, self.window = quantizer, sink, flush, window
        self.keep_decoded, self.exact_dtype = keep_decoded, exact_dtype
        self.sink: torch.Tensor | None = None  # [B, H, s, D]
        self.tail: torch.Tensor | None = None  # [B, H, t, D]
        self.packed = Packed()  # fields [B, H, n, ...]
        self.n_tiles = 0
        self.exact_index = torch.zeros(0, 3, dtype=torch.long)  # (b, h, tile) of tiles kept exact
        self.exact_values: torch.Tensor | None = None  # [n_exact, G_q, D]
        self._decoded: torch.Tensor | None = None  # [B, H, n*G_q, D], only with keep_decoded
        self.length = 0
        # per-channel weight [B, H, D] handed to quantizers that take one (rotation policy, kvarn.quant.policy)
        self.weight_source: Callable[[], torch.Tensor | None] | None = None

    # -- writing ---------------------------------------------------------------------------------------
    def append(self, x: torch.Tensor, flush: bool = True) -> None:
        """x [B, H, t, D]: append t tokens; complete tiles are quantized once (later, with flush=False:
        they wait in the tail until `flush_pending`)."""
        if x.dim() != 4:
            raise ValueError(f"expected [batch, heads, tokens, head_dim], got shape {tuple(x.shape)}")
        if self.length and (x.shape[0], x.shape[1], x.shape[3]) != self.shape_bhd:
            raise ValueError(f"cannot append shape {tuple(x.shape)} to a store of [B, H, D] = {self.shape_bhd}")
        self.shape_bhd = (x.shape[0], x.shape[1], x.shape[3])
        self.dtype, self.device = x.dtype, x.device
        self.length += x.shape[2]
        room = self.sink_len - (0 if self.sink is None else self.sink.shape[2])
        if self.quantizer is None:
            room = x.shape[2]
        if room > 0:
            head, x = self._to_exact_dtype(x[:, :, :room]), x[:, :, room:]
            self.sink = head if self.sink is None else torch.cat([self.sink, head], dim=2)
        if x.shape[2] == 0:
            return
        self.tail = x if self.tail is None else torch.cat([self.tail, x], dim=2)
        if flush:
            self._flush()

    def flush_pending(self) -> None:
        """Quantize the complete tiles still waiting in the tail (after `append(..., flush=False)`)."""
        if self.quantizer is not None and self.tail is not None:
            self._flush()

    def _to_exact_dtype(self, x: torch.Tensor) -> torch.Tensor:
        e = self.exact_dtype
        if e is None or e == x.dtype:
            return x
        finite = x[torch.isfinite(x)]
        if finite.numel() and finite.abs().max() > torch.finfo(e).max:
            # out of range: keep this store's sink in the incoming dtype from now on
            self.exact_dtype = None
            self.sink = None if self.sink is None else self.sink.to(x.dtype)
            return x
        return x.to(e)

    def _flush(self) -> None:
        t = self.tail.shape[2]
        g = self.quantizer.tile
        if self.window == "block":
            n = (t // self.flush) * self.flush
        else:  # sliding: keep the newest `flush` tokens exact
            n = max(t - self.flush, 0) // g * g
        if n == 0:
            return
        ready, self.tail = self.tail[:, :, :n], self.tail[:, :, n:]
        self._encode(ready)

    def _encode(self, x: torch.Tensor) -> None:
        b, h, n, d = x.shape
        g = self.quantizer.tile
        tiles = x.reshape(b, h, n // g, g, d)
        flat = tiles.flatten(0, 2)  # [B*H*m, G_q, D]
        finite = torch.isfinite(flat).flatten(1).all(dim=1)
        if not finite.all():
            flat = torch.where(finite.view(-1, 1, 1), flat, torch.zeros_like(flat))
        w = self.weight_source() if self.weight_source is not None else None  # [B, H, D]
        if w is None and self.weight_source is not None:
            warnings.warn("kvarn: key tiles stored before any query was observed (attention implementation "
                          "'eager'?); the rotation choice falls back to unweighted squared error", stacklevel=2)
        if w is None:
            packed = self.quantizer.encode(flat)
        else:  # one weight row per tile, in flat's (b, h, tile) order
            packed = self.quantizer.encode(flat, weight=w.to(flat.device).unsqueeze(2).expand(b, h, n // g, d)
                                           .reshape(-1, d))
        exact = ~(finite & packed.finite_tiles().to(finite.device))
        m = n // g
        if exact.any():
            idx = exact.nonzero().squeeze(1)
            bi, hi, ti = idx // (h * m), idx // m % h, idx % m + self.n_tiles
            self.exact_index = torch.cat([self.exact_index.to(idx.device), torch.stack([bi, hi, ti], 1)])
            ex = tiles.flatten(0, 2)[idx]
            self.exact_values = ex if self.exact_values is None else torch.cat([self.exact_values, ex])
            # zero the stored form so no non-finite value is ever read from it
            packed = Packed({k: torch.where(exact.view(-1, *[1] * (v.dim() - 1)), torch.zeros_like(v), v)
                             for k, v in packed.fields.items()})
        self.packed = Packed.cat([self.packed, packed.unflatten((b, h, m))], dim=2)
        self.n_tiles += m
        if self.keep_decoded:
            dec = self._decode_packed(packed.unflatten((b, h, m)), self.n_tiles - m)
            self._decoded = dec if self._decoded is None else torch.cat([self._decoded, dec], dim=2)

    # -- reading ---------------------------------------------------------------------------------------
    def _decode_packed(self, packed: Packed, first_tile: int) -> torch.Tensor:
        b, h, m = packed.fields[next(iter(packed.fields))].shape[:3]
        g, d = self.quantizer.tile, self.shape_bhd[2]
        x = self.quantizer.decode(packed.flatten(3), self.dtype).reshape(b, h, m, g, d)
        if len(self.exact_index):
            sel = (self.exact_index[:, 2] >= first_tile) & (self.exact_index[:, 2] < first_tile + m)
            if sel.any():
                i = self.exact_index[sel]
                x[i[:, 0], i[:, 1], i[:, 2] - first_tile] = self.exact_values[sel].to(x.dtype)
        return x.reshape(b, h, m * g, d)

    def dequantized_tiles(self) -> torch.Tensor | None:
        """[B, H, n_tiles * G_q, D] reconstruction of the packed region (exact tiles restored)."""
        if not self.n_tiles:
            return None
        if self._decoded is not None:
            return self._decoded
        return self._decode_packed(self.packed, 0)

    def full(self) -> torch.Tensor:
        """[B, H, T, D]: sink, dequantized tiles and tail, in order (the reference read path)."""
        parts = [p.to(self.dtype) for p in (self.sink, self.dequantized_tiles(), self.tail)
                 if p is not None and p.shape[2]]
        if not parts:
            raise ValueError("the store holds no tokens yet")
        return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]

    @property
    def tiles_start(self) -> int:
        return 0 if self.sink is None else self.sink.shape[2]

    def nbytes(self) -> Bytes:
        n = self.length * self.shape_bhd[0] * self.shape_bhd[1] * self.shape_bhd[2] if self.length else 0
        return Bytes(packed=self.packed.nbytes, sink=_nbytes(self.sink), tail=_nbytes(self.tail),
                     exact_tiles=_nbytes(self.exact_values) + _nbytes(self.exact_index) if self.exact_values
                     is not None else 0, elements=n)

    # -- batch reordering (beam search, batch selection) ----------------------------------------------
    def index_batch(self, index: torch.Tensor) -> None:
        if not self.length:
            return
        if len(self.exact_index):
            raise NotImplementedError("reordering a batch that holds exact (non-finite) tiles")
        self.sink = None if self.sink is None else self.sink[index]
        self.tail = None if self.tail is None else self.tail[index]
        self.packed = Packed({k: v[index] for k, v in self.packed.fields.items()})
        self._decoded = None if self._decoded is None else self._decoded[index]
        self.shape_bhd = (int(index.numel()), *self.shape_bhd[1:])


class LayerStore:
    """Keys and values of one attention layer under one preset."""

    def __init__(self, preset: Preset | str, head_dim: int, sink: int | None = None, quantize: bool = True,
                 keep_decoded: bool = False, exact_dtype: torch.dtype | None = None) -> None:
        self.preset = get_preset(preset)
        s = self.preset.sink if sink is None else sink
        if s < 0:
            raise ValueError(f"sink must be >= 0, got {s}")
        kq, vq = self.preset.quantizers(head_dim) if quantize and self.preset.quantized else (None, None)
        p = self.preset
        self.keys = TensorStore(kq, s, p.tile, "block", keep_decoded, exact_dtype)
        self.values = TensorStore(vq, s, p.tile, p.value_window, keep_decoded, exact_dtype)
        self.head_dim = head_dim
        # key rotation chosen per tile from the running query energy (rotate="auto", kvarn.quant.policy)
        self.queries = QueryEnergy() if getattr(kq, "takes_weight", False) else None
        if self.queries is not None:
            self.keys.weight_source = self.queries.weight

    @property
    def length(self) -> int:
        return self.keys.length

    def append(self, k: torch.Tensor, v: torch.Tensor, defer_keys: bool = False) -> None:
        if k.shape[:3] != v.shape[:3]:
            raise ValueError(f"keys {tuple(k.shape)} and values {tuple(v.shape)} disagree on [B, H, T]")
        if k.shape[-1] != self.head_dim:
            raise ValueError(f"head_dim {k.shape[-1]} does not match the store's {self.head_dim}")
        self.settle()
        # defer_keys: the caller promises `observe_queries` for these tokens, so their key tiles are chosen
        # with the statistics of the queries that arrive with them (a prompt's own queries)
        self.keys.append(k, flush=not (defer_keys and self.queries is not None))
        self.values.append(v)

    def observe_queries(self, q: torch.Tensor) -> None:
        """q [B, Hq, t, D] (after RoPE, as attention sees them): update the running query energy that the key
        rotation policy weighs errors with, then quantize key tiles left pending by `append(defer_keys=True)`."""
        if self.queries is None:
            return
        if not self.keys.length:
            raise ValueError("observe_queries before any key was appended: the number of KV heads is unknown")
        self.queries.update(q, self.keys.shape_bhd[1])
        self.settle()

    def settle(self) -> None:
        """Quantize key tiles that completed but wait for their queries (no-op when none)."""
        self.keys.flush_pending()

    def full(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.settle()
        return self.keys.full(), self.values.full()

    def nbytes(self) -> Bytes:
        self.settle()
        return self.keys.nbytes() + self.values.nbytes()
