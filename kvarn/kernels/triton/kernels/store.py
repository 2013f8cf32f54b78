"""Tile store: Hadamard rotation + VarN + asymmetric RTN + pack, one tile (n, h) per program, written into the
packed fields through a block mapping (as vLLM's reshape_and_cache writes a paged pool).

Input x [N, H, G, D] (token-major tiles). Tile (n, h) lands at  ptr + dst[n] * stride_block + h * stride_head
+ n * stride_batch. In float32, with the arithmetic of `kvarn.quant.affine` / `ops.varn` / `ops.rtn`:

    w = x @ H (dense orthonormal Hadamard matrix, ieee dot)  if ROT == 1, or ROT == 2 and flag[n, h]
    X = w^T [D, G] (keys, AXIS_CHANNEL) or w [G, D] (values);  R x C
    VarN, ITERS rounds, best-imbalance tracking (ties take the newer), unbiased std, the clamps of ops.varn
    RTN per row: lo = min, delta = max((max - lo) / (2^b - 1), 1e-10), q = clamp(rint((X - lo) / delta))
    row_scale = delta * s_row, row_zero = lo * s_row, col_scale = s_col, codes packed (`codes.pack_codes`)

Scales are cast to their field's dtype on store (fp16 overflow -> inf, as `affine.store_scale`). Divisions and
square roots are the correctly rounded ones (`tl.div_rn`, `tl.sqrt_rn`) as PyTorch's: on CUDA Triton's `/` is an
approximate division, which put 1.5e-4 of RTN codes one step off on the first GPU run (the interpreter divides exactly).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvarn.kernels.triton.kernels.codes import pack_codes

STD_LO = tl.constexpr(1e-3)
STD_HI = tl.constexpr(1e3)
LOG_LO = tl.constexpr(-0.3)
LOG_HI = tl.constexpr(10.0)
IMB_FLOOR = tl.constexpr(1e-8)
RANGE_GUARD = tl.constexpr(1e-10)  # globals read by @jit code must be tl.constexpr instances (ops.varn, ops.rtn)


@triton.jit
def _std(y, AXIS: tl.constexpr, N: tl.constexpr):
    """Unbiased standard deviation along AXIS (N entries), two-pass."""
    mean = tl.div_rn(tl.sum(y, axis=AXIS), tl.full([1], N, tl.float32))
    if AXIS == 0:
        dev = y - mean[None, :]
    else:
        dev = y - mean[:, None]
    return tl.sqrt_rn(tl.div_rn(tl.sum(dev * dev, axis=AXIS), tl.full([1], N - 1, tl.float32)))


@triton.jit
def _imbalance(y, R: tl.constexpr, C: tl.constexpr):
    sc = _std(y, 0, R)
    sr = _std(y, 1, C)
    return (tl.div_rn(tl.max(sc, axis=0), tl.maximum(tl.min(sc, axis=0), IMB_FLOOR))
            + tl.div_rn(tl.max(sr, axis=0), tl.maximum(tl.min(sr, axis=0), IMB_FLOOR)))


@triton.jit
def _rint(x):
    """Round half to even (torch.round), exact for |x| < 2^23."""
    f = tl.floor(x)
    d = x - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    up = (d > 0.5) | ((d == 0.5) & odd)
    return tl.where(up, f + 1.0, f)


@triton.jit
def store_tiles_kernel(
    x_ptr, sx_n, sx_h, sx_g,  # x [N, H, G, D], last axis contiguous
    dst_ptr, flag_ptr,  # dst [N] int32 block ids; flag [N, H] uint8 rotate-or-not (ROT == 2)
    hm_ptr,  # Hadamard matrix [D, D] float32, row-major
    c_ptr, c_b, c_n, c_h, a_ptr, a_b, a_n, a_h, z_ptr, z_b, z_n, z_h, t_ptr, t_b, t_n, t_h, f_ptr, f_b, f_n, f_h,
    H,
    D: tl.constexpr, G: tl.constexpr, R: tl.constexpr, C: tl.constexpr, BITS: tl.constexpr,
    AXIS_CHANNEL: tl.constexpr, ROT: tl.constexpr, VARN: tl.constexpr, ITERS: tl.constexpr,
    WRITE_FLAG: tl.constexpr, PLANES: tl.constexpr,
):
    pid = tl.program_id(0)
    n = (pid // H).to(tl.int64)
    h = (pid % H).to(tl.int64)
    rg = tl.arange(0, G)
    rd = tl.arange(0, D)
    x = tl.load(x_ptr + n * sx_n + h * sx_h + rg[:, None] * sx_g + rd[None, :]).to(tl.float32)  # [G, D]
    if ROT != 0:
        hm = tl.load(hm_ptr + rd[:, None] * D + rd[None, :])
        xh = tl.dot(x, hm, input_precision="ieee")
        if ROT == 1:
            x = xh
        else:
            rot = tl.load(flag_ptr + pid)
            x = tl.where(rot != 0, xh, x)
    if AXIS_CHANNEL:
        X = tl.trans(x)  # [D, G]
    else:
        X = x  # [G, D]
    if VARN:
        lc = tl.zeros([C], tl.float32)
        lr = tl.zeros([R], tl.float32)
        best_c = tl.full([C], 1.0, tl.float32)
        best_r = tl.full([R], 1.0, tl.float32)
        best_imb = _imbalance(X, R, C)
        for _ in range(ITERS):
            y = tl.div_rn(tl.div_rn(X, tl.exp(lc)[None, :]), tl.exp(lr)[:, None])
            sc = tl.minimum(tl.maximum(_std(y, 0, R), STD_LO), STD_HI)
            lc = tl.minimum(tl.maximum(lc + tl.log(sc), LOG_LO), LOG_HI)
            y = tl.div_rn(tl.div_rn(X, tl.exp(lc)[None, :]), tl.exp(lr)[:, None])
            sr = tl.minimum(tl.maximum(_std(y, 1, C), STD_LO), STD_HI)
            lr = tl.minimum(tl.maximum(lr + tl.log(sr), LOG_LO), LOG_HI)
            y = tl.div_rn(tl.div_rn(X, tl.exp(lc)[None, :]), tl.exp(lr)[:, None])
            imb = _imbalance(y, R, C)
            better = imb <= best_imb
            best_imb = tl.where(better, imb, best_imb)
            best_c = tl.where(better, tl.exp(lc), best_c)
            best_r = tl.where(better, tl.exp(lr), best_r)
        X = tl.div_rn(tl.div_rn(X, best_c[None, :]), best_r[:, None])
    LEVELS: tl.constexpr = (1 << BITS) - 1
    lo = tl.min(X, axis=1)
    delta = tl.maximum(tl.div_rn(tl.max(X, axis=1) - lo, tl.full([R], LEVELS, tl.float32)), RANGE_GUARD)
    q = _rint(tl.div_rn(X - lo[:, None], delta[:, None]))
    q = tl.minimum(tl.maximum(q, 0.0), LEVELS).to(tl.int32)
    if VARN:
        delta = delta * best_r
        lo = lo * best_r
    blk = tl.load(dst_ptr + n).to(tl.int64)
    rr = tl.arange(0, R)
    NB: tl.constexpr = C * BITS // 8
    co = blk * c_n + h * c_h + n * c_b
    tl.store(c_ptr + co + rr[:, None] * NB + tl.arange(0, NB)[None, :], pack_codes(q, R, C, BITS, PLANES))
    tl.store(a_ptr + blk * a_n + h * a_h + n * a_b + rr, delta.to(a_ptr.dtype.element_ty))
    tl.store(z_ptr + blk * z_n + h * z_h + n * z_b + rr, lo.to(z_ptr.dtype.element_ty))
    if VARN:
        tl.store(t_ptr + blk * t_n + h * t_h + n * t_b + tl.arange(0, C), best_c.to(t_ptr.dtype.element_ty))
    if WRITE_FLAG:
        tl.store(f_ptr + blk * f_n + h * f_h + n * f_b, tl.load(flag_ptr + pid))
