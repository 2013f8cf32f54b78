"""One interface for the method, its ablations and every baseline.

A `TileQuantizer` turns a batch of token-major tiles x [N, G, D] (N = batch * heads * tiles, G tokens,
D = head_dim) into a typed tile container (`kvarn.quant.tiles.Tiles`: a frozen dataclass of tensors whose leading
axis is the tile) and back, so the cache can append, index and count bytes of any method the same way, and
`Tiles.nbytes` is exactly what is stored. Each quantizer reads its own fields back, by attribute.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping

import torch

from kvarn.quant.tiles import DenseTiles, Tiles


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
    tiles_type: type[Tiles] = Tiles  # the container `encode` returns

    @abstractmethod
    def encode(self, x: torch.Tensor) -> Tiles: ...

    @abstractmethod
    def decode(self, packed: Tiles, dtype: torch.dtype = torch.float32) -> torch.Tensor: ...

    def template(self, head_dim: int) -> Tiles:
        """The empty container of this quantizer's tiles of head_dim D (save/load refills it by field name)."""
        return self.tiles_type.empty_of()

    def encode_tiles(self, x: torch.Tensor, weight: torch.Tensor | None = None
                     ) -> tuple[Tiles, torch.Tensor, torch.Tensor]:
        """What the cache stores: x [N, G, D] that may hold NaN/Inf -> (packed, input_finite [N] bool,
        fields_finite [N] bool = `Tiles.finite_tiles`), a tile with a non-finite input encoded as zeros.
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
    tiles_type = DenseTiles

    def __init__(self, tile: int = 128, dtype: torch.dtype = torch.float16) -> None:
        self.tile, self.dtype = tile, dtype

    def encode(self, x: torch.Tensor) -> DenseTiles:
        check_tiles(x, self.tile)
        return DenseTiles(x.to(self.dtype))

    def decode(self, packed: DenseTiles, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return packed.values.to(dtype)
