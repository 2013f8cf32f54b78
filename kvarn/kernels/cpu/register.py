"""The C++ kernels behind the op seats for CPU tensors (`kvarn.ops.seats`), the extension built on first call.

Each implementation calls exactly the entry point the wrappers called before the seats existed, with the same
arguments (`kvarn.kernels.cpu.store.store_tiles`, the extension's `decode_attention`; `tile_decode`, the store's
inverse, is the extension's own); an absent output (None from C++) becomes an empty tensor, as a custom op cannot
return None.
"""

from __future__ import annotations

import torch

from kvarn.kernels.cpu import store
from kvarn.kernels.cpu.build import error, load
from kvarn.ops import seats


def _tile_store(x, weight, bits, channel, rotate, varn, varn_iters, scale_dtype, col_dtype, relative, coef=None,
                clip=1.0, widths=0):
    out = store.store_tiles(x, weight, bits, channel, rotate, varn, varn_iters, scale_dtype, col_dtype, relative,
                            coef, clip, widths)
    return tuple(x.new_empty(0) if t is None else t for t in out)


def _packed_decode(*args):
    out_p, out_r = load().decode_attention(*args)
    return out_p, (out_p.new_empty(0) if out_r is None else out_r)


def _coefficients(sigma, rotate, damp):
    return load().query_aware_coefficients(sigma.float().contiguous(), rotate, damp)


def _tile_decode(codes, row_scale, row_zero, col_scale, rotated, bits, channel, rotate, tile, out_dtype):
    return load().tile_decode(codes, row_scale, row_zero, col_scale, rotated, bits, channel, rotate, tile, out_dtype)


def _decode_support(tiles) -> str | None:
    """Why the C++ tile decode cannot serve these `AffineTiles` (None: it can): CPU fields of one code width, the
    extension built."""
    if tiles.codes.device.type != "cpu":
        return f"tiles on {tiles.codes.device.type}"
    if tiles.refine_rows is not None:
        return "refined rows"
    if tiles.row_widths is not None:
        return "rows at their own widths"
    return _extension_support()


def _extension_support() -> str | None:
    return None if load() is not None else error() or "the extension is unavailable"


# Library.impl, not torch.library.register_kernel: the latter wraps each call in a dynamo-disabled frame (~10 us on
# every decode step of every layer)
_LIB = torch.library.Library("kvarn", "IMPL")
seats.register_kernel(_LIB, "tile_store", "cpu", _tile_store, store.unsupported)
seats.register_kernel(_LIB, "packed_decode", "cpu", _packed_decode, _extension_support)
seats.register_kernel(_LIB, "query_aware_coefficients", "cpu", _coefficients, _extension_support)
seats.register_kernel(_LIB, "tile_decode", "cpu", _tile_decode, _decode_support)
