"""The storage of one attention layer: full-precision sink, packed tiles, full-precision tail.

Positions of one tensor kind (keys or values) along the sequence, for every batch row and KV head:

    [0, sink)                          exact, kept for good
    [sink, sink + n_tiles * G_q)       packed tiles of G_q tokens (the quantizer's tile), never re-quantized
    [.., T)                            exact tail, waiting for its tiles to complete

Keys and values are stored independently (`TensorStore`), so a method may flush them differently
(KIVI keeps a sliding window of exact values). Packed fields are laid out [B, H, n_tiles, ...]: new
tiles are appended along axis 2 and tile j always covers the same positions for every row and head.

Memory: the store owns compact storage at every moment. The sink and the packed fields live in growable buffers
(`kvarn.cache.buffer`: spare capacity <= 4% of the used part, reported as `Bytes.reserved`); the tail is a compact
copy, replaced (never written in place) at every append. Nothing the caller passed is kept by reference, so a
prompt's full-precision K/V are not pinned by a slice of them. A `StoredKV` view taken before an append stays valid
after it (appends write beyond the view's end; crop and batch reordering allocate fresh tensors).

Tiles kept exact (`exact_*`, counted in the bytes, restored bit-for-bit on read), by cause (`stats`):
  * nonfinite       the tile's input holds NaN/Inf;
  * scale_overflow  a stored scale is not finite (fp16 overflow, or an 8-bit scale out of range);
  * dtype_overflow  the reconstruction overflows the store's dtype (float16 models: a rotated tile of values near
                    65504 can decode beyond it). Checked by decoding only the tiles whose max |x| exceeds
                    finfo.max / (2 D): for the affine quantizers |x^| <= D (1 + eps) max |x| (the reconstruction
                    stays within each row's range in the rotated basis, and |H^T y|_i <= |y|_2 <= sqrt(D) max |y|,
                    |y|_j <= sqrt(D) max |x|), so no other tile can overflow.
`nonfinite="error"` refuses instead: any NaN/Inf appended, or a tile that would be kept exact, raises a ValueError
naming the position (the store is left as it was before that append).

Left padding (`append(..., pad=[B, t] bool)`): positions that attention never reads. Before a tile is quantized, its
pad rows are replaced by the mean of the tile's non-pad rows of the same batch row and head (an all-pad tile becomes
zeros): the mean lies in the convex hull of the real rows, so in any linear basis (rotated or not) every per-channel
minimum and maximum is unchanged, and a per-token row made of the mean is a row of its own. Pad rows in the sink and
tail are kept as they came (exact storage has no ranges to widen). Counted in `stats.pad_tokens` / `pad_tiles`.

Crop (`crop(n)`, the newest n tokens removed): within the tail, exact. Across tiles: the tiles holding removed
positions are dropped; the surviving tokens of a partly removed tile return to the tail in their dequantized form
(exactly what attention read from that tile; lossy against the original K/V, counted in `stats.restored_tokens`) and
are quantized again when their tile completes. A crop reaching into the sink truncates it.

`exact_dtype` sets the dtype of the sink, kept for good; None keeps the incoming dtype. A 16-bit choice
for a float32 model matches what an fp16 deployment holds; a store that meets a value out of that
dtype's range keeps its sink in the incoming dtype rather than overflow. The tail (fewer than a tile of
tokens, transient) stays in the incoming dtype, so tiles are quantized, or kept exact, from the values
the model produced.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from kvarn.cache.allocation import OUTPUT_ROWS, KeyAllocation, output_gains, promotion_gains
from kvarn.cache.buffer import Buffer, PackedBuffer
from kvarn.quant.base import TileQuantizer
from kvarn.quant.cache_policy import CachePolicy
from kvarn.quant.policy import query_statistics
from kvarn.quant.tiles import Tiles

NonFinite = Literal["exact", "error"]
_NO_INDEX = torch.zeros(0, 3, dtype=torch.long)  # no tile kept exact (never written to)


def fits_dtype(quantizer: TileQuantizer, packed: Tiles, flat: torch.Tensor, ok: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    """[N] bool: `ok` and tile n of flat [N, G, D] (encoded as `packed`) decodes to finite values in `dtype` (module
    docstring: the bound that selects which tiles to decode). Shared with the paged vLLM store."""
    top = torch.finfo(dtype).max
    if top >= torch.finfo(torch.float32).max:
        return ok  # nothing can overflow
    fits = ok.clone()
    cand = (ok & (flat.abs().amax(dim=(1, 2)).float() > top / (2 * flat.shape[2]))).nonzero().squeeze(1)
    if len(cand):
        dec = quantizer.decode(packed.select(cand), torch.float32)
        fits[cand] = torch.isfinite(dec.to(dtype)).flatten(1).all(dim=1)
    return fits


@dataclass
class Bytes:
    """Bytes held, by region. `total` is what the cache really holds (reserved capacity included);
    `decoded` (keep_decoded's copy of the tiles, a reading aid) is reported apart and not in `total`."""

    packed: int = 0  # codes and per-tile scales/norms/outliers of the quantized tiles
    sink: int = 0
    tail: int = 0
    exact_tiles: int = 0  # tiles kept exact (non-finite input, overflow)
    elements: int = 0  # cached K/V elements
    positions: int = 0  # per-token positions kept to redo RoPE (key_pre_rope presets)
    reserved: int = 0  # allocated beyond the used part of growable buffers (<= 4% of it, kvarn.cache.buffer)
    policy: int = 0  # running query statistics of the rotation policy (rotate="auto")
    decoded: int = 0  # keep_decoded only: decoded tiles, not in `total`

    @property
    def total(self) -> int:
        return (self.packed + self.sink + self.tail + self.exact_tiles + self.positions + self.reserved
                + self.policy)

    @property
    def content(self) -> int:
        """`total` without the reserved capacity: the formula of what the regions need."""
        return self.total - self.reserved

    @property
    def bits_per_element(self) -> float:
        return self.total * 8 / self.elements if self.elements else 0.0

    def __add__(self, o: Bytes) -> Bytes:
        return Bytes(**{f.name: getattr(self, f.name) + getattr(o, f.name) for f in dataclasses.fields(self)})

    def as_dict(self) -> dict[str, float]:
        return {**dataclasses.asdict(self), "total": self.total, "bits_per_element": self.bits_per_element}


@dataclass
class StoreStats:
    """What the store did to unusual input, counted in (batch row, KV head, tile) units unless stated."""

    exact_nonfinite: int = 0  # tiles kept exact: NaN/Inf in their input
    exact_scale_overflow: int = 0  # tiles kept exact: a stored scale not finite
    exact_dtype_overflow: int = 0  # tiles kept exact: reconstruction beyond the store dtype's range
    pad_tokens: int = 0  # (batch row, position) pad rows neutralized before quantization
    pad_tiles: int = 0  # (batch row, tile) tiles made entirely of pads, stored as zeros
    restored_tokens: int = 0  # (batch row, position) tokens returned from a dropped tile to the tail by crop

    def __add__(self, o: StoreStats) -> StoreStats:
        return StoreStats(**{f.name: getattr(self, f.name) + getattr(o, f.name) for f in dataclasses.fields(self)})


_NO_STATS = StoreStats()  # nothing unusual (compared with, never changed)


@dataclass
class _Encoded:
    """Tiles quantized but not yet committed (so a refusal leaves the store unchanged)."""

    packed: Tiles  # fields [B, H, m, ...], exact tiles zeroed
    exact_index: torch.Tensor  # [k, 3] (b, h, tile relative to the first new tile)
    exact_values: torch.Tensor  # [k, G, D]
    stats: StoreStats


@dataclass
class _Plan:
    """One append, checked and quantized, not yet applied."""

    x: torch.Tensor  # [B, H, t, D] as appended
    head: torch.Tensor  # [B, H, s', D] the part that goes to the sink
    pending: torch.Tensor | None = None  # [B, H, tail + t - s', D] the tail before the flush
    pending_pad: torch.Tensor | None = None  # [B, tail + t - s'] bool
    n: int = 0  # tokens of `pending` that go into tiles
    enc: _Encoded | None = None


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _owned(t: torch.Tensor) -> torch.Tensor:
    """t itself when it is the whole of a contiguous storage, else a compact copy."""
    if t.is_contiguous() and t.untyped_storage().nbytes() == _nbytes(t):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def neutral_pads(tiles: torch.Tensor, pad: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """tiles [B, H, m, G, D], pad [B, m, G] bool -> (tiles with pad rows replaced by the mean of the tile's non-pad
    rows of their batch row and head, computed in float32 (float64 input: float64); zeros for an all-pad tile,
    pad tokens, all-pad tiles). Non-pad rows are left untouched."""
    p = pad[:, None, :, :, None]  # [B, 1, m, G, 1]
    real = (~pad).sum(-1)  # [B, m]
    x = tiles if tiles.dtype == torch.float64 else tiles.float()
    mean = torch.where(p, 0.0, x).sum(3) / real.clamp_min(1)[:, None, :, None]  # [B, H, m, D]
    out = torch.where(p, mean.to(tiles.dtype).unsqueeze(3), tiles)
    return out, int(pad.sum()), int((real == 0).sum())


class TensorStore:
    """Keys or values of one layer, [B, H, T, D]."""

    def __init__(self, quantizer: TileQuantizer | None, sink: int, flush: int, window: str = "block",
                 keep_decoded: bool = False, exact_dtype: torch.dtype | None = None,
                 nonfinite: NonFinite = "exact") -> None:
        if quantizer is not None and flush % quantizer.tile:
            raise ValueError(f"flush unit {flush} is not a multiple of the quantizer tile {quantizer.tile}")
        if window not in ("block", "sliding"):
            raise ValueError(f"window must be 'block' or 'sliding', got {window!r}")
        if nonfinite not in ("exact", "error"):
            raise ValueError(f"nonfinite must be 'exact' or 'error', got {nonfinite!r}")
        self.quantizer, self.sink_len, self.flush, self.window = quantizer, sink, flush, window
        self.keep_decoded, self.exact_dtype, self.nonfinite = keep_decoded, exact_dtype, nonfinite
        self._sink = Buffer(limit=sink if quantizer is not None else None)  # [B, H, s, D]
        self.tail: torch.Tensor | None = None  # [B, H, t, D], compact, replaced at every append
        self.tail_pad: torch.Tensor | None = None  # [B, t] bool, only while a pad waits in the tail
        self._packed = PackedBuffer()  # fields [B, H, n, ...]
        self.exact_index = torch.zeros(0, 3, dtype=torch.long)  # (b, h, tile) of tiles kept exact
        self.exact_values: torch.Tensor | None = None  # [n_exact, G_q, D]
        self._decoded = Buffer() if keep_decoded else None  # [B, H, n*G_q, D]
        self.length = 0
        self.stats = StoreStats()
        # per-channel weight [B, H, D] handed to quantizers that take one (rotation policy, kvarn.quant.policy)
        self.weight_source: Callable[[], torch.Tensor | None] | None = None

    # -- regions ---------------------------------------------------------------------------------------
    @property
    def sink(self) -> torch.Tensor | None:
        return self._sink.view()

    @property
    def packed(self) -> Tiles:
        """The tiles' fields [B, H, n_tiles, ...] (slices of the buffers)."""
        return self._packed.view()

    @property
    def n_tiles(self) -> int:
        return self._packed.n

    @property
    def tiles_start(self) -> int:
        return self._sink.n

    @property
    def tail_start(self) -> int:
        return self._sink.n + self.n_tiles * (self.quantizer.tile if self.quantizer is not None else 0)

    # -- writing ---------------------------------------------------------------------------------------
    def append(self, x: torch.Tensor, flush: bool = True, pad: torch.Tensor | None = None) -> None:
        """x [B, H, t, D]: append t tokens; complete tiles are quantized once (later, with flush=False:
        they wait in the tail until `flush_pending`). pad [B, t] bool: positions attention never reads."""
        self._apply(self._plan(x, flush, pad))

    def _plan(self, x: torch.Tensor, flush: bool, pad: torch.Tensor | None) -> _Plan:
        """Check x and quantize its complete tiles without changing the store (a refusal leaves it intact)."""
        if x.dim() != 4:
            raise ValueError(f"expected [batch, heads, tokens, head_dim], got shape {tuple(x.shape)}")
        if self.length and (x.shape[0], x.shape[1], x.shape[3]) != self.shape_bhd:
            raise ValueError(f"cannot append shape {tuple(x.shape)} to a store of [B, H, D] = {self.shape_bhd}")
        if self.length and x.dtype != self.dtype:
            raise ValueError(f"cannot append {x.dtype} K/V to a store of {self.dtype}")
        if pad is not None and (pad.shape != (x.shape[0], x.shape[2]) or pad.dtype != torch.bool):
            raise ValueError(f"pad must be a bool mask [batch, tokens] = {(x.shape[0], x.shape[2])}, got "
                             f"{tuple(pad.shape)} {pad.dtype}")
        if self.nonfinite == "error":
            self._refuse_nonfinite(x)
        room = max(self.sink_len - self._sink.n, 0) if self.quantizer is not None else x.shape[2]
        plan = _Plan(x, x[:, :, :room])
        rest = x[:, :, room:]
        if rest.shape[2]:
            plan.pending = rest if self.tail is None else torch.cat([self.tail, rest], dim=2)
            plan.pending_pad = self._pending_pad(pad[:, room:] if pad is not None else None, x.shape[0],
                                                 rest.shape[2])
            plan.n = self._ready(plan.pending.shape[2]) if flush else 0
            if plan.n:
                pp = plan.pending_pad
                plan.enc = self._prepare(plan.pending[:, :, :plan.n], None if pp is None else pp[:, :plan.n])
        return plan

    def _apply(self, plan: _Plan) -> None:
        x = plan.x
        if not x.shape[2]:
            return
        self.shape_bhd = (x.shape[0], x.shape[1], x.shape[3])
        self.dtype, self.device = x.dtype, x.device
        if plan.head.shape[2]:
            self._append_sink(plan.head)
        self.length += x.shape[2]
        if plan.pending is not None:
            if plan.enc is not None:
                self._commit(plan.enc)
            pp = plan.pending_pad
            self._set_tail(plan.pending[:, :, plan.n:], None if pp is None else pp[:, plan.n:])

    def set_quantizer(self, quantizer: TileQuantizer) -> None:
        """Quantize this store's tiles with `quantizer` from now on; only before its first tile (a store holds one
        code width: its fields are stacked across tiles)."""
        if self.quantizer is None or quantizer is None:
            raise ValueError("set_quantizer swaps one quantizer for another; a store kept exact stays exact")
        if self.n_tiles:
            raise ValueError(f"the store already holds {self.n_tiles} tiles of {self.quantizer.describe()}; set "
                             "its quantizer before the first tile")
        if self.flush % quantizer.tile:
            raise ValueError(f"flush unit {self.flush} is not a multiple of the quantizer tile {quantizer.tile}")
        if type(query_statistics(quantizer)) is not type(query_statistics(self.quantizer)):
            raise ValueError(f"{quantizer.describe()} takes other running query statistics than "
                             f"{self.quantizer.describe()}, which this store keeps; swap in a quantizer of the same "
                             "kind (query-aware rounding, a query-weighted rotation choice, or neither)")
        self.quantizer = quantizer

    def flush_pending(self) -> None:
        """Quantize the complete tiles still waiting in the tail (after `append(..., flush=False)`)."""
        if self.quantizer is None or self.tail is None:
            return
        n = self._ready(self.tail.shape[2])
        if not n:
            return
        pad = self.tail_pad
        self._commit(self._prepare(self.tail[:, :, :n], None if pad is None else pad[:, :n]))
        self._set_tail(self.tail[:, :, n:], None if pad is None else pad[:, n:])

    def _ready(self, t: int) -> int:
        """Tokens of a pending tail of t tokens that go into tiles now."""
        if self.quantizer is None:
            return 0
        if self.window == "block":
            return (t // self.flush) * self.flush
        return max(t - self.flush, 0) // self.quantizer.tile * self.quantizer.tile  # sliding: newest `flush` exact

    def _pending_pad(self, pad: torch.Tensor | None, b: int, t: int) -> torch.Tensor | None:
        """[B, tail + t] bool of the pending tail, or None when it holds no pad."""
        if pad is not None and not pad.any():
            pad = None
        if pad is None and self.tail_pad is None:
            return None
        old = self.tail_pad if self.tail_pad is not None else torch.zeros(
            b, 0 if self.tail is None else self.tail.shape[2], dtype=torch.bool, device=pad.device)
        new = pad if pad is not None else torch.zeros(b, t, dtype=torch.bool, device=old.device)
        return torch.cat([old, new.to(old.device)], dim=1)

    def _set_tail(self, t: torch.Tensor, pad: torch.Tensor | None) -> None:
        if not t.shape[2]:
            self.tail = self.tail_pad = None
            return
        self.tail = _owned(t)
        self.tail_pad = _owned(pad) if pad is not None and pad.any() else None

    def _append_sink(self, head: torch.Tensor) -> None:
        e = self.exact_dtype
        if e is not None and e != head.dtype:
            finite = head[torch.isfinite(head)]
            if finite.numel() and finite.abs().max() > torch.finfo(e).max:
                # out of range: keep this store's sink in the incoming dtype from now on
                self.exact_dtype = None
                old = self._sink.view()
                self._sink.replace(None if old is None else old.to(head.dtype))
            else:
                head = head.to(e)
        self._sink.append(head)

    def _refuse_nonfinite(self, x: torch.Tensor) -> None:
        bad = ~torch.isfinite(x)
        if bad.any():
            b, h, t, d = (int(i) for i in bad.nonzero()[0])
            raise ValueError(f"non-finite K/V value {x[b, h, t, d].item()} at batch {b}, head {h}, position "
                             f"{self.length + t}, channel {d} (nonfinite='error'; 'exact' keeps such tiles exact)")

    # -- quantizing ------------------------------------------------------------------------------------
    def _prepare(self, x: torch.Tensor, pad: torch.Tensor | None) -> _Encoded:
        """Quantize x [B, H, n, D] (n a multiple of G_q) into tiles; nothing is stored yet."""
        b, h, n, d = x.shape
        g = self.quantizer.tile
        m = n // g
        tiles = x.reshape(b, h, m, g, d)
        stats = StoreStats()
        if pad is not None and pad.any():
            tiles, stats.pad_tokens, stats.pad_tiles = neutral_pads(tiles, pad.reshape(b, m, g))
        flat = tiles.flatten(0, 2)  # [B*H*m, G_q, D]
        w = self.weight_source() if self.weight_source is not None else None  # [B, H, D] (or [B, H, D, D])
        if w is None and self.weight_source is not None:
            warnings.warn("kvarn: key tiles stored before any query was observed (attention implementation "
                          "'eager'?); the rotation choice falls back to unweighted squared error", stacklevel=3)
        if w is not None:  # one weight row per tile, in flat's (b, h, tile) order
            w = w.to(flat.device).unsqueeze(2).expand(b, h, m, *w.shape[2:]).reshape(-1, *w.shape[2:])
        packed, finite, scale_ok = self.quantizer.encode_tiles(flat, w)  # non-finite tiles encoded as zeros
        ok = self._fits_dtype(packed, flat, finite & scale_ok, x.dtype)
        if bool(ok.all()):  # the usual case: nothing kept exact, no index arithmetic
            return _Encoded(packed.unflatten((b, h, m)), _NO_INDEX, flat[:0], stats)
        stats.exact_nonfinite = int((~finite).sum())
        stats.exact_scale_overflow = int((finite & ~scale_ok).sum())
        stats.exact_dtype_overflow = int((finite & scale_ok & ~ok).sum())
        exact = ~ok
        idx = exact.nonzero().squeeze(1)
        bi, hi, ti = idx // (h * m), idx // m % h, idx % m
        if len(idx) and self.nonfinite == "error":
            cause = ("non-finite input" if not finite[idx[0]] else "a stored scale overflows" if not scale_ok[idx[0]]
                     else f"the reconstruction overflows {x.dtype}")
            first = self.sink_len + (self.n_tiles + int(ti[0])) * g  # the sink is full once tiles form
            raise ValueError(f"the tile at batch {int(bi[0])}, head {int(hi[0])}, positions [{first}, {first + g}) "
                             f"cannot be quantized: {cause} (nonfinite='error'; 'exact' keeps such tiles exact)")
        if len(idx):  # zero the stored form so no non-finite value is ever read from it
            packed = packed.zeroed(exact)
        return _Encoded(packed.unflatten((b, h, m)), torch.stack([bi, hi, ti], 1), tiles.flatten(0, 2)[idx], stats)

    def _fits_dtype(self, packed: Tiles, flat: torch.Tensor, ok: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return fits_dtype(self.quantizer, packed, flat, ok, dtype)

    def _commit(self, enc: _Encoded) -> None:
        first = self.n_tiles
        m = enc.packed.axes(3)[2]
        if len(enc.exact_index):
            i = enc.exact_index.to(self.exact_index.device)
            i = torch.stack([i[:, 0], i[:, 1], i[:, 2] + first], 1)
            self.exact_index = torch.cat([self.exact_index, i])
            ex = enc.exact_values
            self.exact_values = ex if self.exact_values is None else torch.cat([self.exact_values, ex])
        self._packed.append(enc.packed)
        if enc.stats != _NO_STATS:
            self.stats = self.stats + enc.stats
        if self._decoded is not None:
            self._decoded.append(self._decode_packed(enc.packed, first))
        assert self.n_tiles == first + m

    # -- reading ---------------------------------------------------------------------------------------
    def _decode_packed(self, packed: Tiles, first_tile: int) -> torch.Tensor:
        """packed fields [B, H, m, ...] of tiles [first_tile, first_tile + m) -> [B, H, m * G_q, D], exact tiles
        restored."""
        b, h, m = packed.axes(3)
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
            return self._decoded.view()
        return self._decode_packed(self.packed, 0)

    def full(self) -> torch.Tensor:
        """[B, H, T, D]: sink, dequantized tiles and tail, in order (the reference read path)."""
        parts = [p.to(self.dtype) for p in (self.sink, self.dequantized_tiles(), self.tail)
                 if p is not None and p.shape[2]]
        if not parts:
            raise ValueError("the store holds no tokens yet")
        return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]

    def nbytes(self) -> Bytes:
        n = self.length * self.shape_bhd[0] * self.shape_bhd[1] * self.shape_bhd[2] if self.length else 0
        exact = _nbytes(self.exact_values) + _nbytes(self.exact_index) if self.exact_values is not None else 0
        dec = self._decoded.nbytes + self._decoded.reserved if self._decoded is not None else 0
        return Bytes(packed=self._packed.nbytes, sink=self._sink.nbytes,
                     tail=_nbytes(self.tail) + _nbytes(self.tail_pad), exact_tiles=exact, elements=n,
                     reserved=self._packed.reserved + self._sink.reserved, decoded=dec)

    # -- batch reordering (beam search, batch selection) ----------------------------------------------
    def index_batch(self, index: torch.Tensor) -> None:
        """Row i of the result is row index[i] (rows may repeat or be dropped); tiles kept exact follow."""
        if not self.length:
            return
        index = index.to(self.device)
        self._sink.index(index)
        self._packed.index(index)
        if self._decoded is not None:
            self._decoded.index(index)
        self.tail = None if self.tail is None else self.tail[index]
        self.tail_pad = None if self.tail_pad is None else self.tail_pad[index]
        if len(self.exact_index):
            # new row i holds every exact tile of old row index[i]
            new_row, entry = (self.exact_index[:, 0].unsqueeze(0) == index.to(self.exact_index.device)
                              .unsqueeze(1)).nonzero(as_tuple=True)
            old = self.exact_index[entry]
            self.exact_index = torch.stack([new_row, old[:, 1], old[:, 2]], 1)
            self.exact_values = self.exact_values[entry.to(self.exact_values.device)] if len(entry) else None
        self.shape_bhd = (int(index.numel()), *self.shape_bhd[1:])

    # -- removing the newest tokens (assisted decoding, prompt lookup) --------------------------------
    def crop(self, tokens_to_remove: int) -> None:
        """Remove the newest `tokens_to_remove` tokens (module docstring: exact within the tail; across tiles the
        survivors of a partly removed tile return to the tail dequantized)."""
        n = int(tokens_to_remove)
        if n < 0 or n > self.length:
            raise ValueError(f"cannot remove {tokens_to_remove} tokens from a store of {self.length}")
        if not n:
            return
        keep = self.length - n
        if keep >= self.tail_start:
            t = keep - self.tail_start
            self._set_tail(self.tail[:, :, :t], None if self.tail_pad is None else self.tail_pad[:, :t])
        elif keep >= self.tiles_start:
            g = self.quantizer.tile
            tiles, r = divmod(keep - self.tiles_start, g)
            restored = None
            if r:  # what attention read from the partly removed tile
                part = self.packed.select((slice(None), slice(None), slice(tiles, tiles + 1)))
                restored = self._decode_packed(part, tiles)[:, :, :r]
                self.stats.restored_tokens += r * self.shape_bhd[0]
            self._drop_tiles_from(tiles)
            self.tail, self.tail_pad = (None if restored is None else _owned(restored)), None
        else:
            self._sink.truncate(keep)
            self._drop_tiles_from(0)
            self.tail = self.tail_pad = None
        self.length = keep

    def _drop_tiles_from(self, first: int) -> None:
        self._packed.truncate(first)
        if self._decoded is not None:
            self._decoded.truncate(first * self.quantizer.tile)
        if len(self.exact_index):
            sel = self.exact_index[:, 2] < first
            self.exact_index = self.exact_index[sel]
            self.exact_values = self.exact_values[sel.to(self.exact_values.device)] if sel.any() else None


class MethodSource(Protocol):
    """What `LayerStore.from_preset` reads of a preset (`kvarn.presets.Preset`; this floor does not import it)."""

    @property
    def policy(self) -> CachePolicy: ...

    @property
    def quantized(self) -> bool: ...

    def quantizers(self, head_dim: int) -> tuple[TileQuantizer, TileQuantizer]: ...


class LayerStore:
    """Keys and values of one attention layer: each through its quantizer (None: kept exact), under `policy`.

    `sink` overrides the policy's (None: the policy's). `from_preset` builds one from a resolved preset.
    `allocation` (budget presets): the cache's `KeyAllocation`, which gives this store (its layer `layer`) its key
    quantizer once every layer has scored; until then key tiles wait exact in the tail.
    """

    def __init__(self, key: TileQuantizer | None, value: TileQuantizer | None, policy: CachePolicy, head_dim: int,
                 sink: int | None = None, keep_decoded: bool = False, exact_dtype: torch.dtype | None = None,
                 nonfinite: NonFinite = "exact", allocation: KeyAllocation | None = None,
                 layer: int | None = None) -> None:
        if (key is None) != (value is None):
            raise ValueError("a LayerStore quantizes both keys and values or neither")
        if allocation is not None and (key is None or layer not in allocation.layers):
            raise ValueError(f"layer {layer} is not one of the key allocation's quantized layers")
        self.allocation, self.layer = allocation, layer
        self._recent_q: torch.Tensor | None = None  # [B, Hq, <= OUTPUT_ROWS, D]: the "output" rule's queries
        self.policy = policy
        s = policy.sink if sink is None else sink
        if s < 0:
            raise ValueError(f"sink must be >= 0, got {s}")
        self.keys = TensorStore(key, s, policy.tile, "block", keep_decoded, exact_dtype, nonfinite)
        self.values = TensorStore(value, s, policy.tile, policy.value_window, keep_decoded, exact_dtype, nonfinite)
        self.head_dim = head_dim
        # key rotation chosen per tile from the running query energy (rotate="auto", kvarn.quant.policy); query-aware
        # rounding (-qar presets) takes E[q q^T] instead
        self.queries = query_statistics(key)
        if self.queries is not None:
            self.keys.weight_source = self.queries.key_weight

    @classmethod
    def from_preset(cls, preset: MethodSource, head_dim: int, sink: int | None = None, quantize: bool = True,
                    keep_decoded: bool = False, exact_dtype: torch.dtype | None = None,
                    nonfinite: NonFinite = "exact") -> LayerStore:
        """A store under a resolved preset (`kvarn.get_preset(name)`): its quantizers at `head_dim` (none when
        `quantize` is False or the preset does not quantize) and its policy."""
        kq, vq = preset.quantizers(head_dim) if quantize and preset.quantized else (None, None)
        return cls(kq, vq, preset.policy, head_dim, sink, keep_decoded, exact_dtype, nonfinite)

    @property
    def length(self) -> int:
        return self.keys.length

    def append(self, k: torch.Tensor, v: torch.Tensor, defer_keys: bool = False,
               pad: torch.Tensor | None = None) -> None:
        """k, v [B, H, t, D]; pad [B, t] bool marks positions attention never reads (module docstring)."""
        if k.shape[:3] != v.shape[:3]:
            raise ValueError(f"keys {tuple(k.shape)} and values {tuple(v.shape)} disagree on [B, H, T]")
        if k.shape[-1] != self.head_dim:
            raise ValueError(f"head_dim {k.shape[-1]} does not match the store's {self.head_dim}")
        self.settle()
        # defer_keys: the caller promises `observe_queries` for these tokens, so their key tiles are chosen
        # with the statistics of the queries that arrive with them (a prompt's own queries)
        pk = self.keys._plan(k, not (defer_keys and self.queries is not None) and self._keys_settled(), pad)
        pv = self.values._plan(v, True, pad)  # both checked before either changes
        self.keys._apply(pk)
        self.values._apply(pv)

    def observe_queries(self, q: torch.Tensor) -> None:
        """q [B, Hq, t, D] (after RoPE, as attention sees them): update the running query energy that the key
        rotation policy weighs errors with, then quantize key tiles left pending by `append(defer_keys=True)`."""
        if self.queries is None:
            return
        if not self.keys.length:
            raise ValueError("observe_queries before any key was appended: the number of KV heads is unknown")
        self.queries.update(q, self.keys.shape_bhd[1])
        a = self.allocation
        if a is not None and a.rule == "output" and not a.decided:
            # the newest queries as of the first tile's end, until this layer scores: queries past that end are
            # dropped, so one forward over a whole prompt (generate) scores as prompt chunks (serving) and single
            # tokens (decode) do, and not on the prompt's last queries, far from that tile (docs/TASKS.md, "The
            # generate protocol")
            keep = self._score_end() - (self.keys.length - q.shape[2])
            if keep > 0:
                q = q[:, :, :keep]
                recent = q if self._recent_q is None else torch.cat([self._recent_q, q], dim=2)
                self._recent_q = recent[:, :, -OUTPUT_ROWS:]
        self.settle()

    def _score_end(self) -> int:
        """The position after the first key tile, where the "output" rule's attention ends."""
        return self.keys.sink_len + self.allocation.low.tile

    def settle(self) -> None:
        """Quantize key tiles that completed but wait for their queries or the key allocation (no-op when none)."""
        if self.allocation is not None and not self.allocation.decided:
            self._score()
        if self._keys_settled():
            self.keys.flush_pending()

    def _keys_settled(self) -> bool:
        """Whether key tiles may be stored now: always, except under a budget allocation not yet decided (the
        first tile then sets this layer's key quantizer)."""
        a = self.allocation
        if a is None:
            return True
        if not a.decided:
            return False
        if not self.keys.n_tiles:
            q = a.quantizer(self.layer)
            if self.keys.quantizer is not q:
                self.keys.set_quantizer(q)
        return True

    def _score(self) -> None:
        """Report this layer's promotion gain on its first complete key tile (`kvarn.cache.allocation`), once: the
        "output" rule on the newest queries observed up to the first tile's end (up to OUTPUT_ROWS, kept only until
        then), over the keys and values up to that end; a layer whose attention observes none falls back to the
        "logit" rule."""
        a, ks = self.allocation, self.keys
        if self.layer in a.scores or ks.tail is None or ks.n_tiles or not ks._ready(ks.tail.shape[2]):
            return
        w = self.queries.weight() if self.queries is not None else None
        highs = (a.high, a.mid) if a.scores_mid else (a.high,)
        if a.rule == "output" and self._recent_q is not None:
            end = self._score_end()
            if self._recent_q.shape[2] < min(OUTPUT_ROWS, end - ks.tiles_start):
                return  # fewer queries than keys past the sink: wait for more (decoding one token at a time)
            k, v = ks.full()[:, :, :end], self.values.full()[:, :, :end]  # the queries are the last ones before end
            gains = output_gains(self._recent_q, k, v, ks.tiles_start, w, a.low, highs, OUTPUT_ROWS)
            self._recent_q = None
        else:
            gains = promotion_gains(ks.tail[:, :, :a.low.tile], w, a.low, highs)
        a.report(self.layer, *gains)

    def full(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.settle()
        return self.keys.full(), self.values.full()

    def index_batch(self, index: torch.Tensor) -> None:
        """Reorder/select batch rows (beam search): keys, values and the policy's query statistics."""
        self.keys.index_batch(index)
        self.values.index_batch(index)
        if self.queries is not None:
            self.queries.index_batch(index)
        if self._recent_q is not None:
            self._recent_q = self._recent_q[index.to(self._recent_q.device)]

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the newest tokens of keys and values (`TensorStore.crop`). The rotation policy's running query
        statistics keep the removed steps' queries: they only guide which rotation later key tiles use."""
        if tokens_to_remove < 0 or tokens_to_remove > self.length:
            raise ValueError(f"cannot remove {tokens_to_remove} tokens from a layer of {self.length}")
        self.keys.crop(tokens_to_remove)
        self.values.crop(tokens_to_remove)

    @property
    def stats(self) -> StoreStats:
        return self.keys.stats + self.values.stats

    def nbytes(self) -> Bytes:
        self.settle()
        b = self.keys.nbytes() + self.values.nbytes()
        if self.queries is not None and self.queries.sum is not None:
            b.policy = _nbytes(self.queries.sum) + _nbytes(self._recent_q)
        return b
