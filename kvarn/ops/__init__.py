"""Reference ops of the method, pure PyTorch. Each module states its arithmetic in its docstring."""

from kvarn.ops.codes import DTYPE_CODES, Rotation
from kvarn.ops.hadamard import hadamard_blocks, hadamard_dense, hadamard_matrix, hadamard_transform
from kvarn.ops.packing import pack_codes, unpack_codes
from kvarn.ops.rtn import rtn_dequantize, rtn_quantize
from kvarn.ops.varn import imbalance, varn

__all__ = [
    "DTYPE_CODES",
    "Rotation",
    "hadamard_blocks",
    "hadamard_dense",
    "hadamard_matrix",
    "hadamard_transform",
    "imbalance",
    "pack_codes",
    "rtn_dequantize",
    "rtn_quantize",
    "unpack_codes",
    "varn",
]
