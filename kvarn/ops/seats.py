"""Op seats: the tile store, its inverse and packed decode attention declared once as `torch.library` custom ops
(namespace kvarn).

Each seat takes tensors and plain ints/floats/bools only (absent optional outputs are empty tensors), has a fake
implementation (shapes and dtypes, for torch.compile and opcheck) and a default implementation, the PyTorch
reference; kernels register device implementations behind the same name (`kvarn.kernels.cpu.register`: the C++
kernels for CPU). Which path a call takes is `kvarn.ops.dispatch` (KVARN_KERNEL): callers reach a seat only when a
kernel serves the call; `supported(seat, device)` gives the registered kernel's reason why not (None: it serves it).
kvarn's own callers hold a `Seat`, which calls the kernel registered for the device (`register_kernel`) without the
dispatcher.

    kvarn::tile_store(x [N, G, D], weight [N, D]?, bits, channel, rotate, varn, varn_iters, scale_dtype, col_dtype,
                      relative, coef [N, B, D, D]?, clip, widths) -> (codes, row_scale, row_zero, col_scale | [0],
                      rotated | [0], input_finite [N], fields_finite [N], row_widths | [0])
        AffineQuantizer tiles (kvarn.quant.affine; codes `kvarn.ops.codes`; coef: query-aware rounding of keys,
        `kvarn.ops.rtn`; clip: `AffineConfig.clip`; widths: key rows at their own widths, `AffineFormat.widths`,
        codes [N, widths C / 8]); default: the quantizer's reference, registered by kvarn.quant.affine.
    kvarn::tile_decode(codes [N, R, C b / 8], row_scale, row_zero [N, R], col_scale [N, C] | [0], rotated [N] | [0],
                       bits, channel, rotate, tile, out_dtype) -> x [N, G, D]
        the store's inverse: AffineQuantizer tiles decoded token-major in out_dtype (`DTYPE_CODES`); default:
        `kvarn.quant.affine.decode_tiles` (dense=False: the reference's butterfly), registered by kvarn.quant.affine;
        the C++ kernel equals it bit for bit.
    kvarn::query_aware_coefficients(sigma [N, D, D], rotate, damp) -> coef [N, B, D, D]
        query-aware rounding's coefficients of each basis (`kvarn.ops.rtn.query_aware_bases`, the default); the C++
        kernel agrees to float64 rounding (its factorisation sums in another order), not bit for bit.
    kvarn::packed_decode(q, qh, hadamard, scale, key fields + strides, bits, rotate, value fields + strides, bits,
                         rotate, block_table, n_blocks, tile, exact map/keys/values, dense keys/values/positions,
                         tiles_pos, bias, length, softcap, splits, paged rows/index/position) -> (out_plain,
                         out_rotated | [0])
        the arguments of `kvarn.attention.launch.decode_partial`'s kernel call; default: `kvarn.ops.decode`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvarn.ops.codes import CODE_DTYPES, Rotation
from kvarn.ops.decode import packed_decode_reference
from kvarn.ops.packing import packed_size
from kvarn.ops.rtn import query_aware_bases

STORE_SCHEMA = ("(Tensor x, Tensor? weight, int bits, bool channel, int rotate, bool varn, int varn_iters, "
                "int scale_dtype, int col_dtype, bool relative, Tensor? coef=None, float clip=1.0, int widths=0) -> "
                "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
DECODE_SCHEMA = ("(Tensor q, Tensor qh, Tensor hadamard, float scale, Tensor[] key_fields, int[] key_strides, "
                 "int key_bits, int key_rotate, Tensor[] value_fields, int[] value_strides, int value_bits, "
                 "int value_rotate, Tensor block_table, Tensor n_blocks, int tile, Tensor exact_map, Tensor exact_k, "
                 "Tensor exact_v, Tensor[] dense_k, Tensor[] dense_v, int[] dense_pos, int tiles_pos, Tensor bias, "
                 "int length, float softcap, int splits, Tensor paged_rows, Tensor paged_index, int paged_pos) "
                 "-> (Tensor, Tensor)")

torch.library.define("kvarn::tile_store", STORE_SCHEMA)
torch.library.define("kvarn::packed_decode", DECODE_SCHEMA)
torch.library.define("kvarn::query_aware_coefficients", "(Tensor sigma, int rotate, float damp) -> Tensor")
torch.library.define("kvarn::tile_decode", "(Tensor codes, Tensor row_scale, Tensor row_zero, Tensor col_scale, "
                     "Tensor rotated, int bits, bool channel, int rotate, int tile, int out_dtype) -> Tensor")

_SUPPORT: dict[tuple[str, str], Callable[..., str | None]] = {}
_KERNELS: dict[tuple[str, str], Callable] = {}


def register_support(seat: str, device: str, why: Callable[..., str | None]) -> None:
    """A kernel registered for `device` names, per call, why it cannot serve it (None: it can)."""
    _SUPPORT[seat, device] = why


def register_kernel(lib: torch.library.Library, seat: str, device: str, kernel: Callable,
                    why: Callable[..., str | None]) -> None:
    """`kernel` behind `seat` for `device` ("cpu", "cuda"): registered with the op (`lib.impl`), kept for `Seat`'s
    direct calls, and `why` as its `register_support`."""
    lib.impl(seat, kernel, device.upper())
    _KERNELS[seat, device] = kernel
    register_support(seat, device, why)


class Seat:
    """A seat as Python callers call it: the kernel registered for the first argument's device, called directly with
    the op's arguments, else the op (its default: the reference). The direct call is the function the dispatcher
    would run for that device; it skips the boxing of every argument (~25 us a call for packed_decode's 29, paid
    per layer and decode step). Under torch.compile the op itself is called, so that dynamo sees it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.op = getattr(torch.ops.kvarn, name).default

    def __call__(self, *args):
        kernel = _KERNELS.get((self.name, args[0].device.type))
        if kernel is None or torch.compiler.is_compiling():
            return self.op(*args)
        return kernel(*args)


def supported(seat: str, device: torch.device, *args) -> str | None:
    """Why no kernel serves this call of `seat` on `device` (None: the registered kernel does)."""
    why = _SUPPORT.get((seat, device.type))
    return "no kernel registered" if why is None else why(*args)


@torch.library.register_fake("kvarn::tile_store")
def _store_fake(x, weight, bits, channel, rotate, varn, varn_iters, scale_dtype, col_dtype, relative, coef=None,
                clip=1.0, widths=0):
    n, g, d = x.shape
    r, c = (d, g) if channel else (g, d)
    sd = CODE_DTYPES[scale_dtype]
    zd = torch.float16 if sd.itemsize == 1 else sd
    codes = x.new_empty(n, widths * c // 8, dtype=torch.uint8) if widths else \
        x.new_empty(n, r, packed_size(c, bits), dtype=torch.uint8)
    return (codes, x.new_empty(n, r, dtype=sd),
            x.new_empty(n, r, dtype=zd), x.new_empty(n, c, dtype=CODE_DTYPES[col_dtype]) if varn else x.new_empty(0),
            x.new_empty(n, dtype=torch.uint8) if rotate == 2 else x.new_empty(0), x.new_empty(n, dtype=torch.bool),
            x.new_empty(n, dtype=torch.bool),
            x.new_empty(n, packed_size(r, 3), dtype=torch.uint8) if widths else x.new_empty(0))


@torch.library.register_fake("kvarn::packed_decode")
def _decode_fake(q, qh, hadamard, *args):
    out = torch.empty_like(q, dtype=torch.float32, memory_format=torch.contiguous_format)
    return out, (q.new_empty(0, dtype=torch.float32) if hadamard.numel() else torch.empty_like(out))


@torch.library.register_fake("kvarn::tile_decode")
def _tile_decode_fake(codes, row_scale, row_zero, col_scale, rotated, bits, channel, rotate, tile, out_dtype):
    n, r, m = codes.shape
    d = r if channel else m * 8 // bits
    return codes.new_empty(n, tile, d, dtype=CODE_DTYPES[out_dtype])


@torch.library.register_fake("kvarn::query_aware_coefficients")
def _coefficients_fake(sigma, rotate, damp):
    n, d, _ = sigma.shape
    return sigma.new_empty(n, 2 if rotate == Rotation.AUTO else 1, d, d, dtype=torch.float32)


torch.library.impl("kvarn::packed_decode", "CompositeExplicitAutograd")(packed_decode_reference)
torch.library.impl("kvarn::query_aware_coefficients", "CompositeExplicitAutograd")(query_aware_bases)
