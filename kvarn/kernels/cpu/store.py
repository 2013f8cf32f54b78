"""Fused tile store of AffineQuantizer tiles on the CPU (the C++ kernel in store.cpp), one call for all tiles.

Per tile x [G, D] (token-major), float32 statistics, exactly the reference's steps (kvarn.quant.affine):
    w = x H                     rotate="hadamard" (fast Walsh-Hadamard, kvarn.ops.hadamard's power-of-two blocks)
    X = w^T [D, G] (keys, rows = channels) | w [G, D] (values, rows = tokens)
    VarN, L iterations (kvarn.ops.varn): unbiased stds from double sums shifted by the first element of each row or
        column (a constant row gives 0; offsets do not cancel the variance), the clamps, Imb with ties taking the
        newer scales, no early stop; Imb(Y) of iteration i reuses its column stds as iteration i + 1's
    8-bit column scales (col_scale_dtype float8_e4m3fn): relative_col_scales (t = e4m3(s_c / max s_c), s_r' = s_r max)
    RTN per row of B = X / s_c / s_r: lo, hi, delta = max((hi - lo) / (2^b - 1), 1e-10), q = round-half-even
    a = s_r delta, z = s_r lo, t = s_c cast to their storage dtypes; codes packed in planes (kvarn.ops.packing)
rotate="auto" (policy "query" or "mse", kvarn.quant.policy): both bases encoded, each decoded from its stored fields
((q a + z) t, rotated back), sum_{g,d} w_d (x^ - x)^2 in double, the rotation kept where strictly lower.
OpenMP over tiles, no host synchronization.

Served: CPU tensors of float32/bf16/fp16; 1/2/4/8-bit codes; scales in float32/fp16/bf16/float8_e4m3fn (e4m3:
out-of-range values stored as NaN and an fp16 zero, as `store_scale` and `zero_dtype`); VarN column scales in
those, relative when `col_scale_dtype` is 8-bit. `unsupported` names why anything else takes the reference: 3-bit
codes (their 8-code groups are packed differently), other 8-bit formats (e5m2: not needed by any preset), rotation
policies other than query/mse (arbitrary Python callables), head or tile sizes whose columns do not fill whole
bytes (the reference raises the error), negative VarN iterations (the reference raises).
"""

from __future__ import annotations

import torch

from kvarn.kernels.cpu.build import error, load
from kvarn.quant.policy import query_weighted, squared_error

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 3}
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
STORE_BITS = (1, 2, 4, 8)
ROTATE = {"none": 0, "hadamard": 1, "auto": 2}
WEIGHTED = {query_weighted: True, squared_error: False}  # policy -> whether it reads the weight

_EMPTY = torch.empty(0)


def unsupported(quantizer, x: torch.Tensor) -> str | None:
    """Why the kernel cannot encode x [N, G, D] with this AffineQuantizer (None: it can)."""
    c = quantizer.config
    if x.device.type != "cpu" or x.dtype not in INPUT_DTYPES:
        return f"tiles on {x.device.type} in {x.dtype}"
    if c.bits not in STORE_BITS:
        return f"{c.bits}-bit codes"
    if c.scale_dtype not in DTYPE_CODES:
        return f"row scales in {c.scale_dtype}"
    col = c.col_scale_dtype or c.scale_dtype
    if c.varn and col not in DTYPE_CODES:
        return f"column scales in {col}"
    cols = x.shape[1] if c.axis == "channel" else x.shape[2]
    if cols % (8 // c.bits):
        return f"{cols} columns do not fill bytes of {c.bits}-bit codes"
    if c.varn and (min(x.shape[1], x.shape[2]) < 2 or c.varn_iters < 0):
        return "VarN needs tiles of at least 2 x 2 and iters >= 0"
    if c.rotate == "auto" and quantizer.policy not in WEIGHTED:
        return f"rotation policy {getattr(quantizer.policy, '__name__', quantizer.policy)!r} (kernel: query, mse)"
    if load() is None:
        return f"the extension is unavailable ({error()})"
    return None


def store_tiles(quantizer, x: torch.Tensor, weight: torch.Tensor | None = None
                ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """The fields of `AffineQuantizer.encode` for x [N, G, D] (shapes checked by the caller; `unsupported` is None):
    codes [N, R, C*b/8] uint8, row_scale, row_zero [N, R], col_scale [N, C] (VarN), rotated [N] uint8 (auto); and
    [N] bool: input_finite (a tile holding NaN/Inf is encoded as zeros) and fields_finite (`Packed.finite_tiles`)."""
    c = quantizer.config
    col = c.col_scale_dtype or c.scale_dtype
    relative = c.varn and c.col_scale_dtype is not None and col.itemsize == 1
    w = _EMPTY
    if c.rotate == "auto" and weight is not None and WEIGHTED[quantizer.policy]:
        w = weight if weight.dtype == torch.float32 and weight.is_contiguous() else weight.float().contiguous()
    codes, a, z, t, rot, finite_in, finite_out = load().store_tiles(
        x, w, c.bits, c.axis == "channel", ROTATE[c.rotate], c.varn, c.varn_iters,
        DTYPE_CODES[c.scale_dtype], DTYPE_CODES.get(col, 0), relative)
    out = {"codes": codes, "row_scale": a, "row_zero": z}
    if t is not None:
        out["col_scale"] = t
    if rot is not None:
        out["rotated"] = rot
    return out, finite_in, finite_out
