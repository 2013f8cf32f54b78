"""Fused tile store of AffineQuantizer tiles on the CPU (the C++ kernel in store.cpp), one call for all tiles.

Per tile x [G, D] (token-major), float32 statistics, exactly the reference's steps (kvarn.quant.affine):
    w = x H                     rotate="hadamard" (fast Walsh-Hadamard, kvarn.ops.hadamard's power-of-two blocks)
    X = w^T [D, G] (keys, rows = channels) | w [G, D] (values, rows = tokens)
    VarN, L iterations (kvarn.ops.varn): unbiased stds from double sums shifted by the first element of each row or
        column (a constant row gives 0; offsets do not cancel the variance), the clamps, Imb with ties taking the
        newer scales, no early stop; Imb(Y) of iteration i reuses its column stds as iteration i + 1's
    8-bit column scales (col_scale_dtype float8_e4m3fn): relative_col_scales (t = e4m3(s_c / max s_c), s_r' = s_r max)
    RTN per row of B = X / s_c / s_r: lo, hi (clipped about their midpoint, kvarn.ops.rtn.row_range),
    delta = max((hi - lo) / (2^b - 1), 1e-10), q = round-half-even (keys
    with coefficients: query-aware rounding of u = (B - lo) / delta instead, kvarn.ops.rtn.query_aware_round)
    a = s_r delta, z = s_r lo, t = s_c cast to their storage dtypes; codes packed as kvarn.ops.packing packs them
rotate="auto" (policy "query" or "mse", kvarn.quant.policy): both bases encoded, each decoded from its stored fields
((q a + z) t, rotated back), sum_{g,d} w_d (x^ - x)^2 in double, the rotation kept where strictly lower.
OpenMP over tiles, no host synchronization.

Served: CPU tensors of float32/bf16/fp16; 1/2/3/4/8-bit codes (3-bit: groups of 8 codes in 3 bytes, not planes);
scales in float32/fp16/bf16/float8_e4m3fn (e4m3: out-of-range values stored as NaN and an fp16 zero, as
`store_scale` and `zero_dtype`); VarN column scales in those, relative when `col_scale_dtype` is 8-bit.
`unsupported` names why anything else takes the reference: other 8-bit formats (e5m2: not needed by any preset),
rotation policies other than query/mse (arbitrary Python callables), head or tile sizes whose columns do not fill
whole bytes (the reference raises the error), negative VarN iterations (the reference raises).
"""

from __future__ import annotations

import torch

from kvarn.kernels.cpu.build import error, load
from kvarn.ops.codes import DTYPE_CODES
from kvarn.ops.packing import group_codes

INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
STORE_BITS = (1, 2, 3, 4, 8)

_EMPTY = torch.empty(0)


def unsupported(x: torch.Tensor, bits: int, channel: bool, varn: bool, varn_iters: int, scale_dtype: torch.dtype,
                col_dtype: torch.dtype | None, policy_known: bool, policy_name: object = None) -> str | None:
    """Why the kernel cannot encode x [N, G, D] in this format (None: it can). col_dtype: VarN column scales (None
    without VarN); policy_known: rotate is not "auto", or its policy is one the kernel computes (query, mse)."""
    if x.device.type != "cpu" or x.dtype not in INPUT_DTYPES:
        return f"tiles on {x.device.type} in {x.dtype}"
    if bits not in STORE_BITS:
        return f"{bits}-bit codes"
    if scale_dtype not in DTYPE_CODES:
        return f"row scales in {scale_dtype}"
    if varn and col_dtype not in DTYPE_CODES:
        return f"column scales in {col_dtype}"
    cols = x.shape[1] if channel else x.shape[2]
    if cols % group_codes(bits):
        return f"{cols} columns do not fill bytes of {bits}-bit codes"
    if varn and (min(x.shape[1], x.shape[2]) < 2 or varn_iters < 0):
        return "VarN needs tiles of at least 2 x 2 and iters >= 0"
    if not policy_known:
        return f"rotation policy {policy_name!r} (kernel: query, mse)"
    if load() is None:
        return f"the extension is unavailable ({error()})"
    return None


def store_tiles(x: torch.Tensor, weight: torch.Tensor | None, bits: int, channel: bool, rotate: int, varn: bool,
                varn_iters: int, scale_code: int, col_code: int, relative: bool,
                coef: torch.Tensor | None = None, clip: float = 1.0, widths: int = 0) -> tuple[torch.Tensor, ...]:
    """The fields of `AffineQuantizer.encode` for x [N, G, D] (shapes checked by the caller; `unsupported` is None):
    codes [N, R, C*b/8] uint8, row_scale, row_zero [N, R], col_scale [N, C] (VarN, else None), rotated [N] uint8
    (auto, else None); and [N] bool: input_finite (a tile holding NaN/Inf is encoded as zeros) and fields_finite
    (`Tiles.finite_tiles`). weight [N, D]: the policy's channel weights (None: unweighted squared error); rotate:
    `kvarn.ops.codes.Rotation`; scale_code, col_code: `DTYPE_CODES`; relative: `relative_col_scales`. coef
    [N, B, D, D] (keys): query-aware rounding's coefficients per tile and basis (B = 2 under rotate="auto", the rotated
    basis first; the seat `kvarn::query_aware_coefficients`), None: nearest rounding. clip: the share of each row's
    range its grid spans (`kvarn.ops.rtn.row_range`). widths > 0: keys at row widths (`kvarn.ops.widths`; bits 4),
    codes [N, widths*C/8] and, last, the widths [N, 3R/8]; weight is then also the allocation's row weights in the
    plain basis (rotate none, or auto's plain encoding)."""
    w = _EMPTY
    if weight is not None:
        w = weight if weight.dtype == torch.float32 and weight.is_contiguous() else weight.float().contiguous()
    c = _EMPTY if coef is None else coef.float().contiguous()
    return tuple(load().store_tiles(x, w, bits, channel, rotate, varn, varn_iters, scale_code, col_code, relative, c,
                                       clip, widths))
