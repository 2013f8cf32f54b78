"""One interface for the method, its ablations and every baseline.

A `TileQuantizer` turns a batch of token-major tiles x [N, G, D] (N = batch * heads * tiles, G tokens,
D = head_dim) into a `Packed` container and back. The container is a flat dict of tensors whose leading
axis is the tile, so the cache can append, index and count bytes of any method the same way, and
`Packed.nbytes` is exactly what is stored. Each quantizer reads its own fields back.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch


@dataclass
class Packed:
    """N quantized tiles: named tensors, each with leading axis N."""

    fields: dict[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return next(iter(self.fields.values())).shape[0] if self.fields else 0

    def __bool__(self) -> bool:
        return bool(self.fields)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.fields[name]

    def get(self, name: str) -> torch.Tensor | None:
        return self.fields.get(name)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.fields.values())

    def select(self, index: torch.Tensor | slice) -> Packed:
        return Packed({k: v[index] for k, v in self.fields.items()})

    def to(self, device: torch.device | str) -> Packed:
        return Packed({k: v.to(device) for k, v in self.fields.items()})

    def finite_tiles(self) -> torch.Tensor:
        """[N] bool: every floating field of the tile is finite (fp16 scales can overflow)."""
        ok = None
        for t in self.fields.values():
            if t.is_floating_point():
                t = t.float() if t.element_size() == 1 else t  # isfinite has no 8-bit float kernels
                f = torch.isfinite(t).reshape(t.shape[0], -1).all(dim=1)
                ok = f if ok is None else ok & f
        if ok is None:
            return torch.ones(len(self), dtype=torch.bool)
        return ok

    def unflatten(self, shape: tuple[int, ...]) -> Packed:
        """Split the leading tile axis into `shape` (e.g. [B, H, n]). (reshape: Tensor.unflatten is Python, slower.)"""
        return Packed({k: v.reshape(*shape, *v.shape[1:]) for k, v in self.fields.items()})

    def flatten(self, n_lead: int) -> Packed:
        """Merge the first `n_lead` axes into one tile axis."""
        return Packed({k: v.flatten(0, n_lead - 1) for k, v in self.fields.items()})

    @staticmethod
    def cat(parts: Iterable[Packed], dim: int = 0) -> Packed:
        parts = [p for p in parts if p.fields]
        if not parts:
            return Packed()
        return Packed({k: torch.cat([p.fields[k] for p in parts], dim=dim) for k in parts[0].fields})


def check_tiles(x: torch.Tensor, tile: int, head_dim: int | None = None, finite: bool = True) -> None:
    """Raise ValueError naming what is wrong with a batch of tiles [N, G, D] (finite=False: NaN/Inf allowed)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"expected a tensor of tiles [N, G, D], got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"expected tiles of rank 3 [N, G, D], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"expected a floating tensor, got {x.dtype}")
    if x.shape[1] != tile:
        raise ValueError(f"tile has {x.shape[1]} tokens but the quantizer is configured for G={tile}")
    if head_dim is not None and x.shape[2] != head_dim:
        raise ValueError(f"tile has head_dim {x.shape[2]}, quantizer expects {head_dim}")
    if finite and x.numel() and not torch.isfinite(x).all():
        raise ValueError(
            "tiles contain NaN or Inf; the cache keeps such tiles exact, quantizers refuse them"
        )


class TileQuantizer(ABC):
    """Quantizes token-major tiles [N, G, D]; `G` is `tile` tokens."""

    name: str = "base"
    tile: int = 128

    @abstractmethod
    def encode(self, x: torch.Tensor) -> Packed: ...

    @abstractmethod
    def decode(self, packed: Packed, dtype: torch.dtype = torch.float32) -> torch.Tensor: ...

    def encode_tiles(self, x: torch.Tensor, weight: torch.Tensor | None = None
                     ) -> tuple[Packed, torch.Tensor, torch.Tensor]:
        """What the cache stores: x [N, G, D] that may hold NaN/Inf -> (packed, input_finite [N] bool,
        fields_finite [N] bool = `Packed.finite_tiles`), a tile with a non-finite input encoded as zeros.
        weight [N, D] goes to quantizers that take one (`takes_weight`)."""
        finite = torch.isfinite(x).flatten(1).all(dim=1)
        if not finite.all():
            x = torch.where(finite.view(-1, 1, 1), x, torch.zeros_like(x))
        packed = self.encode(x) if weight is None else self.encode(x, weight=weight)
        return packed, finite, packed.finite_tiles().to(finite.device)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(x), x.dtype)

    def bits_per_element(self, head_dim: int) -> float:
        """Measured from stored bytes of one tile (every field counted)."""
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1, self.tile, head_dim, generator=g)
        return self.encode(x).nbytes * 8 / (self.tile * head_dim)

    def describe(self) -> Mapping[str, object]:
        return {"name": self.name, "tile": self.tile}


class Identity(TileQuantizer):
    """No quantization: stores the tile as is (fp16 by default)."""

    name = "fp16"

    def __init__(self, tile: int = 128, dtype: torch.dtype = torch.float16) -> None:
        self.tile, self.dtype = tile, dtype

    def encode(self, x: torch.Tensor) -> Packed:
        check_tiles(x, self.tile)
        return Packed({"values": x.to(self.dtype)})

    def decode(self, packed: Packed, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return packed["values"].to(dtype)
