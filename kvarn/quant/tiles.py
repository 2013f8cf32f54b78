"""Typed tile containers: what a `TileQuantizer` stores for N tiles, one frozen dataclass per packed format.

Every tensor field has the leading tile axis N (or several leading axes, e.g. [B, H, n] in the cache, after
`unflatten`); a field that a format does not use is None. Fields marked `param()` are format parameters, carried
unchanged by every generic method. A field holding a `Tiles` (a wrapper's inner tiles) is mapped recursively and
named "<field>.<name>" by `items`. The cache, save/load and the byte counts go through the generic methods only:
`items` (name, tensor) in declaration order, `nbytes` (exactly what is stored), `select`, `to`, `cat`,
`flatten`/`unflatten`, `finite_tiles`, `template` + `with_tensors` (rebuild from named tensors).

`AffineTiles` is the packed form of the KVarN family (kvarn.quant.affine); its `AffineFormat` computes each field's
per-tile shape, dtype and bytes (no encode), which the reference, the C++ and Triton kernels, vLLM's page layout
and save/load all read.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from kvarn.ops.codes import Rotation
from kvarn.ops.packing import packed_size
from kvarn.ops.widths import MAX_WIDTH, WIDTH_BITS

T = TypeVar("T", bound="Tiles")
REFINE_BITS = 2  # the bits a refined row of an AffineFormat adds to its codes


_SLOTS: dict[type, tuple[dataclasses.Field, ...]] = {}


def param(**kwargs: Any) -> Any:
    """A format parameter of a tile container (not a tensor; keyword-only)."""
    return dataclasses.field(metadata={"param": True}, kw_only=True, **kwargs)


@dataclass(frozen=True)
class Tiles:
    """N tiles of some packed format. The base class with no fields is the empty container (len 0, falsy)."""

    @classmethod
    def _slots(cls) -> tuple[dataclasses.Field, ...]:
        slots = _SLOTS.get(cls)
        if slots is None:
            slots = _SLOTS[cls] = tuple(f for f in dataclasses.fields(cls) if not f.metadata.get("param"))
        return slots

    def map(self: T, fn: Callable[[torch.Tensor], torch.Tensor | None]) -> T:
        new = {}
        for f in self._slots():
            v = getattr(self, f.name)
            new[f.name] = v.map(fn) if isinstance(v, Tiles) else None if v is None else fn(v)
        return dataclasses.replace(self, **new)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of every present field, in declaration order (nested tiles as "<field>.<name>")."""
        for f in self._slots():
            v = getattr(self, f.name)
            if isinstance(v, Tiles):
                yield from ((f"{f.name}.{k}", t) for k, t in v.items())
            elif v is not None:
                yield f.name, v

    def tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.items())

    def names(self) -> tuple[str, ...]:
        return tuple(k for k, _ in self.items())

    def __len__(self) -> int:
        return next((t.shape[0] for _, t in self.items()), 0)

    def __bool__(self) -> bool:
        return next(self.items(), None) is not None

    def axes(self, n: int) -> tuple[int, ...]:
        """The first n axes of the fields (e.g. (B, H, n_tiles) of the cache layout)."""
        return next((tuple(t.shape[:n]) for _, t in self.items()), (0,) * n)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.items())

    def select(self: T, index: torch.Tensor | slice | tuple) -> T:
        return self.map(lambda t: t[index])

    def to(self: T, device: torch.device | str) -> T:
        return self.map(lambda t: t.to(device))

    def zeroed(self: T, drop: torch.Tensor) -> T:
        """Fields of tiles where drop [N] is True set to zero (the stored form of a tile kept exact)."""
        return self.map(lambda t: torch.where(drop.view(-1, *[1] * (t.dim() - 1)), torch.zeros_like(t), t))

    def unflatten(self: T, shape: tuple[int, ...]) -> T:
        """Split the leading tile axis into `shape` (e.g. [B, H, n]). (reshape: Tensor.unflatten is Python, slower.)"""
        return self.map(lambda t: t.reshape(*shape, *t.shape[1:]))

    def flatten(self: T, n_lead: int) -> T:
        """Merge the first `n_lead` axes into one tile axis."""
        return self.map(lambda t: t.flatten(0, n_lead - 1))

    def template(self: T) -> T:
        """The same format with no tensors (what `with_tensors` fills)."""
        return self.map(lambda t: None)

    @classmethod
    def empty_of(cls: type[T]) -> T:
        """The template of a container without format parameters."""
        return cls(**{f.name: None for f in cls._slots()})

    def with_tensors(self: T, tensors: Mapping[str, torch.Tensor], prefix: str = "") -> T:
        """This format holding `tensors` (names as `items` gives them; absent optional fields None)."""
        new = {}
        for f in self._slots():
            v = getattr(self, f.name)
            key = prefix + f.name
            new[f.name] = v.with_tensors(tensors, key + ".") if isinstance(v, Tiles) else tensors.get(key)
        return dataclasses.replace(self, **new)

    @staticmethod
    def cat(parts: Iterable[Tiles], dim: int = 0) -> Tiles:
        parts = [p for p in parts if p]
        if not parts:
            return Tiles()
        names = parts[0].names()
        return parts[0].with_tensors({k: torch.cat([p.tensors()[k] for p in parts], dim=dim) for k in names})

    def finite_tiles(self) -> torch.Tensor:
        """[N] bool: every floating field of the tile is finite (fp16 scales can overflow)."""
        ok = None
        for _, t in self.items():
            if t.is_floating_point():
                t = t.float() if t.element_size() == 1 else t  # isfinite has no 8-bit float kernels
                f = torch.isfinite(t).reshape(t.shape[0], -1).all(dim=1)
                ok = f if ok is None else ok & f
        if ok is None:
            return torch.ones(len(self), dtype=torch.bool)
        return ok


@dataclass(frozen=True)
class DenseTiles(Tiles):
    """Tiles stored as they are (`Identity`): values [N, G, D]."""

    values: torch.Tensor | None


# -- the KVarN family --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FieldSpec:
    """One field of one tile: name, shape per tile, dtype, bytes (numel * itemsize)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class AffineFormat:
    """The packed layout of one AffineQuantizer tile [G, D] (token-major), computed from its parameters.

    rows x cols: axis "channel" (keys) R = D, C = G; axis "token" (values) R = G, C = D. Fields, in this order:
        codes     [R, packed_size(C, bits)] uint8
        row_scale [R] scale_dtype          row_zero [R] zero_dtype
        col_scale [C] col_dtype            (VarN only: col_dtype is not None)
        rotated   []  uint8                (rotate="auto" only)
        refine_rows  [k] uint8             (refine = k > 0, keys only: the rows whose codes carry 2 more bits)
        refine_codes [k, packed_size(C, 2)] uint8   those rows' 2 low bits; `codes` holds their high bits
        row_widths   [3 R / 8] uint8       (widths = W > 0, keys only: each row's width in 0..bits, 3 bits a row)
    A refined row r of codes q (high) and e (low) decodes as ((4 q + e) a_r / 4 + z_r) t_c: its row scale is 4x its
    step, so the `codes` plane alone reads it at `bits` bits (`kvarn.quant.affine.merge_refined`).
    With row widths (W bits of codes a column, spread over the rows), `codes` is [W C / 8]: blocks of 4-, 2- and 1-bit
    codes, a 3-bit row split over the last two (`kvarn.ops.widths.pack_rows`); a width-0 row decodes as z_r t_c.
    """

    bits: int
    axis: str
    rotate: str
    tile: int  # G
    head_dim: int  # D
    scale_dtype: torch.dtype
    zero_dtype: torch.dtype
    col_dtype: torch.dtype | None  # None: no column scales (VarN off)
    refine: int = 0  # rows per tile whose codes carry REFINE_BITS more bits (keys only)
    widths: int = 0  # row widths: the bits of codes a column holds, spread over the rows at 0..bits each (keys only)

    def __post_init__(self) -> None:
        if self.refine and (self.axis != "channel" or not 0 < self.refine <= min(self.head_dim, 256)):
            raise ValueError(f"refined rows are key channels (axis 'channel'), at most min(head_dim, 256) of them; "
                             f"got {self.refine} rows, axis {self.axis!r}, head_dim {self.head_dim}")
        if self.widths and (self.axis != "channel" or self.refine or self.bits != MAX_WIDTH or self.head_dim % 8
                            or self.tile % 8 or not 0 < self.widths <= MAX_WIDTH * self.head_dim):
            raise ValueError(f"row widths are for key channels (axis 'channel', head_dim and tile multiples of 8, "
                             f"bits {MAX_WIDTH}, no refined rows), 1..{MAX_WIDTH} x head_dim bits of them; got "
                             f"{self.widths} bits, axis {self.axis!r}, bits {self.bits}, head_dim {self.head_dim}, "
                             f"tile {self.tile}, refine {self.refine}")

    @property
    def rows(self) -> int:
        return self.head_dim if self.axis == "channel" else self.tile

    @property
    def cols(self) -> int:
        return self.tile if self.axis == "channel" else self.head_dim

    @functools.cached_property
    def rotation(self) -> Rotation:  # cached: read on every decode step
        return Rotation.of(self.rotate)

    @property
    def fields(self) -> tuple[FieldSpec, ...]:
        r, c = self.rows, self.cols
        codes = (self.widths * c // 8,) if self.widths else (r, packed_size(c, self.bits))
        out = [FieldSpec("codes", codes, torch.uint8),
               FieldSpec("row_scale", (r,), self.scale_dtype), FieldSpec("row_zero", (r,), self.zero_dtype)]
        if self.col_dtype is not None:
            out.append(FieldSpec("col_scale", (c,), self.col_dtype))
        if self.rotate == "auto":
            out.append(FieldSpec("rotated", (), torch.uint8))
        if self.refine:
            out += [FieldSpec("refine_rows", (self.refine,), torch.uint8),
                    FieldSpec("refine_codes", (self.refine, packed_size(c, REFINE_BITS)), torch.uint8)]
        if self.widths:
            out.append(FieldSpec("row_widths", (packed_size(r, WIDTH_BITS),), torch.uint8))
        return tuple(out)

    @property
    def nbytes(self) -> int:
        """Bytes of one tile: the sum over `fields` (no padding)."""
        return sum(f.nbytes for f in self.fields)

    def offsets(self, start: int = 0) -> list[tuple[FieldSpec, int]]:
        """(field, byte offset) laid out from `start` in `fields` order, each offset a multiple of its itemsize;
        the end is the last offset + its bytes."""
        out, at = [], start
        for f in self.fields:
            size = f.dtype.itemsize
            at = -(-at // size) * size
            out.append((f, at))
            at += f.nbytes
        return out

    def empty(self, lead: tuple[int, ...], device: torch.device | str = "cpu") -> AffineTiles:
        """Uninitialized tiles with leading axes `lead`."""
        t = {f.name: torch.empty(*lead, *f.shape, dtype=f.dtype, device=device) for f in self.fields}
        return AffineTiles.template_of(self).with_tensors(t)


@dataclass(frozen=True)
class AffineTiles(Tiles):
    """Tiles of an AffineQuantizer (`AffineFormat` gives each field's per-tile shape and dtype)."""

    codes: torch.Tensor | None
    row_scale: torch.Tensor | None
    row_zero: torch.Tensor | None
    col_scale: torch.Tensor | None = None
    rotated: torch.Tensor | None = None
    refine_rows: torch.Tensor | None = None
    refine_codes: torch.Tensor | None = None
    row_widths: torch.Tensor | None = None
    fmt: AffineFormat = param()  # noqa: RUF009 (a dataclasses.field with metadata)

    @classmethod
    def template_of(cls, fmt: AffineFormat) -> AffineTiles:
        return cls(None, None, None, fmt=fmt)

    def rotated_mask(self) -> torch.Tensor | None:
        """[...] bool of rotated tiles, or None when all tiles share the configured rotation."""
        return None if self.rotated is None else self.rotated.bool()
