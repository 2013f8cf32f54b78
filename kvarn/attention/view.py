"""A read-only view of what one `TensorStore` held at one moment, for attention over the stored form.

Positions [0, T) of one tensor kind (keys or values), every batch row and KV head:

    [0, s)                 sink, exact                                   sink   [B, H, s, D]
    [s, s + n*G)           n packed tiles of G tokens                    packed fields [B, H, n, ...]
    [s + n*G, T)           tail, exact                                   tail   [B, H, t, D]

A view is made of slices of the store's buffers: later appends write only beyond the view's end (the sink and packed
buffers grow in place after their used part, the tail is replaced by a new tensor), and crop or batch reordering
allocate fresh tensors, so a view stays valid after them: the cache layer takes one before appending the current
tokens and hands it to the attention (`kvarn.cache.store`, `kvarn.cache.buffer`).

`post` maps stored rows to what attention needs (RoPE for keys stored before RoPE): post(x [B, H, t, D], first) with
`first` the position of x's first row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvarn.cache.store import TensorStore
from kvarn.quant.affine import AffineQuantizer
from kvarn.quant.affine import decode_tiles as affine_decode
from kvarn.quant.base import TileQuantizer
from kvarn.quant.tiles import Tiles

Post = Callable[[torch.Tensor, int], torch.Tensor]


@dataclass(frozen=True)
class StoredKV:
    sink: torch.Tensor | None
    packed: Tiles  # fields [B, H, n, ...]
    n_tiles: int
    tail: torch.Tensor | None
    exact_index: torch.Tensor  # [n_exact, 3] (batch, head, tile) of tiles kept exact
    exact_values: torch.Tensor | None  # [n_exact, G, D]
    quantizer: TileQuantizer | None
    shape_bhd: tuple[int, int, int]
    dtype: torch.dtype
    post: Post | None = None

    @classmethod
    def of(cls, store: TensorStore, post: Post | None = None) -> StoredKV | None:
        """The store's current content, or None when it is empty."""
        if not store.length:
            return None
        return cls(store.sink, store.packed, store.n_tiles, store.tail, store.exact_index, store.exact_values,
                   store.quantizer, store.shape_bhd, store.dtype, post)

    @property
    def sink_len(self) -> int:
        return 0 if self.sink is None else self.sink.shape[2]

    @property
    def tile(self) -> int:
        return self.quantizer.tile if self.quantizer is not None else 0

    @property
    def tail_len(self) -> int:
        return 0 if self.tail is None else self.tail.shape[2]

    @property
    def length(self) -> int:
        return self.sink_len + self.n_tiles * self.tile + self.tail_len

    def _post(self, x: torch.Tensor, first: int) -> torch.Tensor:
        return x if self.post is None else self.post(x, first)

    def sink_rows(self, dtype: torch.dtype) -> torch.Tensor | None:
        """[B, H, s, D] as attention sees them."""
        if not self.sink_len:
            return None
        return self._post(self.sink, 0).to(dtype)

    def tail_rows(self, dtype: torch.dtype) -> torch.Tensor | None:
        """[B, H, t, D] as attention sees them."""
        if not self.tail_len:
            return None
        return self._post(self.tail, self.sink_len + self.n_tiles * self.tile).to(dtype)

    def exact_in(self, first: int, last: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(index [k, 3] with tile numbers relative to `first`, values [k, G, D]) of exact tiles in [first, last)."""
        if not len(self.exact_index):
            return None
        t = self.exact_index[:, 2]
        sel = (t >= first) & (t < last)
        if not sel.any():
            return None
        idx = self.exact_index[sel].clone()
        idx[:, 2] -= first
        return idx, self.exact_values[sel]

    def decode_tiles(self, first: int, last: int, dtype: torch.dtype, dense: bool = False) -> torch.Tensor:
        """Tiles [first, last) decoded, exact tiles restored, `post` applied: [B, H, (last - first) * G, D].
        dense=True (packed attention's many-row read): affine tiles by `affine.decode_tiles(dense=True)`, the tile
        decode kernel where one serves them (the reference's bits), else rotated back by one matmul with H; the
        default is the quantizer's own decode, the reference."""
        b, h, d = self.shape_bhd
        m, g = last - first, self.tile
        part = self.packed.select((slice(None), slice(None), slice(first, last))).flatten(3)
        x = (affine_decode(part, dtype, dense=True) if dense and isinstance(self.quantizer, AffineQuantizer)
             else self.quantizer.decode(part, dtype)).reshape(b, h, m, g, d)
        ex = self.exact_in(first, last)
        if ex is not None:
            i, v = ex
            x[i[:, 0], i[:, 1], i[:, 2]] = v.to(dtype)
        return self._post(x.reshape(b, h, m * g, d), self.sink_len + first * g)

    def dequantized(self, dtype: torch.dtype, dense: bool = False) -> torch.Tensor:
        """[B, H, T, D]: the whole stored content as attention sees it (the reference read path; `dense` as in
        `decode_tiles`)."""
        parts = [self.sink_rows(dtype), self.decode_tiles(0, self.n_tiles, dtype, dense) if self.n_tiles else None,
                 self.tail_rows(dtype)]
        return torch.cat([p for p in parts if p is not None], dim=2)


@dataclass(frozen=True)
class KVarNPast:
    """What one layer held before the current tokens were appended."""

    keys: StoredKV | None
    values: StoredKV | None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.length
