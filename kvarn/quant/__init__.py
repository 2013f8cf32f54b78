from kvarn.quant.affine import AffineConfig, AffineQuantizer
from kvarn.quant.base import Identity, Packed, TileQuantizer, check_tiles

__all__ = ["AffineConfig", "AffineQuantizer", "Identity", "Packed", "TileQuantizer", "check_tiles"]
