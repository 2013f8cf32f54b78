"""Growable storage along the sequence axis, with bounded spare capacity.

A `Buffer` holds one tensor [B, H, cap, ...] of which the first `n` entries along axis 2 are in use. Appending
writes in place after `n`; when the capacity runs out the used part is copied once into a new tensor of
`capacity_for(needed)` entries:

    capacity_for(n) = n + floor(n * SPARE),   SPARE = 0.04

so the spare part never exceeds 4% of the used part (exact fit while n < 25), and the number of entries
copied over a history of n entries stays O(n) (each regrowth adds >= 4%: at most ~26 n copies in all).

Views (`view()`) are slices [:, :, :n]. Later appends only write beyond n, so a view taken before an append stays
valid; shrinking (`truncate`) and batch reordering (`index`) allocate a fresh tensor instead of writing over
entries a view may still reference.
"""

from __future__ import annotations

import torch

from kvarn.quant.tiles import Tiles

SPARE = 0.04


def capacity_for(n: int, limit: int | None = None) -> int:
    """Entries to allocate for n used ones (at most `limit`, when one is given and n <= limit)."""
    cap = n + int(n * SPARE)
    return min(cap, max(limit, n)) if limit is not None else cap


def _compact(x: torch.Tensor) -> torch.Tensor:
    return x.clone(memory_format=torch.contiguous_format)


class Buffer:
    """[B, H, n, ...] in use out of [B, H, cap, ...] allocated; `limit` caps the capacity (a sink never
    grows beyond its length)."""

    def __init__(self, limit: int | None = None) -> None:
        self.data: torch.Tensor | None = None
        self.n = 0
        self.limit = limit

    @property
    def cap(self) -> int:
        return 0 if self.data is None else self.data.shape[2]

    def view(self) -> torch.Tensor | None:
        return None if self.data is None or not self.n else self.data[:, :, : self.n]

    @property
    def nbytes(self) -> int:
        """Bytes of the used part."""
        return 0 if self.data is None else self.n * self.data[:, :, :1].numel() * self.data.element_size()

    @property
    def reserved(self) -> int:
        """Bytes allocated beyond the used part."""
        return 0 if self.data is None else self.data.numel() * self.data.element_size() - self.nbytes

    def append(self, x: torch.Tensor) -> None:
        """x [B, H, m, ...]: copied after the used part (the caller's tensor is never kept)."""
        need = self.n + x.shape[2]
        d = self.data
        if d is not None and (d.shape[:2] != x.shape[:2] or d.shape[3:] != x.shape[3:] or d.dtype != x.dtype
                              or d.device != x.device):
            raise ValueError(f"cannot append {tuple(x.shape)} {x.dtype} to a buffer of {tuple(d.shape)} {d.dtype}")
        if d is None or need > d.shape[2]:
            cap = capacity_for(need, self.limit)
            if cap == need:  # an exact fit (n < 25): one op allocates and copies both parts
                self.data = torch.cat([d[:, :, : self.n], x], dim=2) if self.n else _compact(x)
                self.n = need
                return
            new = x.new_empty((*x.shape[:2], cap, *x.shape[3:]))
            if self.n:
                new[:, :, : self.n] = d[:, :, : self.n]
            self.data = new
        self.data[:, :, self.n:need] = x
        self.n = need

    def replace(self, x: torch.Tensor | None) -> None:
        """Hold a compact copy of x (or nothing)."""
        self.data, self.n = (None, 0) if x is None or not x.shape[2] else (_compact(x), x.shape[2])

    def truncate(self, n: int) -> None:
        """Keep the first n entries (a fresh tensor: a live view may still read the dropped ones)."""
        if n < self.n:
            self.replace(self.data[:, :, :n])

    def index(self, index: torch.Tensor) -> None:
        """Reorder/select along the batch axis: a fresh, exactly sized tensor."""
        if self.data is not None:
            self.replace(self.data[:, :, : self.n][index])


class PackedBuffer:
    """The packed tiles of a store, one `Buffer` per field: [B, H, n_tiles, ...] in use; `kind` the tiles'
    template (their format without tensors), from which `view` rebuilds the typed container."""

    def __init__(self) -> None:
        self.fields: dict[str, Buffer] = {}
        self.kind: Tiles = Tiles()
        self.n = 0

    def view(self) -> Tiles:
        """The n tiles in use: slices [B, H, n, ...] (the empty `Tiles()` when n == 0)."""
        return self.kind.with_tensors({k: b.view() for k, b in self.fields.items()}) if self.n else Tiles()

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.fields.values())

    @property
    def reserved(self) -> int:
        return sum(b.reserved for b in self.fields.values())

    def append(self, p: Tiles) -> None:
        """p: fields [B, H, m, ...] of m new tiles."""
        names = p.names()
        if self.fields and set(names) != set(self.fields):
            raise ValueError(f"packed fields {sorted(names)} differ from the stored {sorted(self.fields)}")
        if not self.fields:
            self.kind = p.template()
        for k, v in p.items():
            self.fields.setdefault(k, Buffer()).append(v)
        self.n += p.axes(3)[2] if names else 0

    def replace(self, p: Tiles) -> None:
        """Hold compact copies of p's fields [B, H, n, ...]."""
        self.fields = {k: Buffer() for k in p.names()}
        self.kind = p.template()
        for k, v in p.items():
            self.fields[k].replace(v)
        self.n = p.axes(3)[2] if self.fields else 0

    def truncate(self, n: int) -> None:
        if n < self.n:
            for b in self.fields.values():
                b.truncate(n)
            self.n = n
            if not n:
                self.fields = {}

    def index(self, index: torch.Tensor) -> None:
        for b in self.fields.values():
            b.index(index)
