from kvarn.quant.affine import AffineConfig, AffineQuantizer
from kvarn.quant.base import Identity, TileQuantizer, check_tiles
from kvarn.quant.tiles import AffineFormat, AffineTiles, DenseTiles, FieldSpec, Tiles

__all__ = ["AffineConfig", "AffineFormat", "AffineQuantizer", "AffineTiles", "DenseTiles", "FieldSpec", "Identity",
           "TileQuantizer", "Tiles", "check_tiles"]
