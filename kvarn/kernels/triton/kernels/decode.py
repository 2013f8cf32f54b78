"""Split-K decode attention over packed KVarN tiles read through a block table (flash-decoding, first pass).

Program (pid0 = b * H + h, pid1 = split s) handles blocks j in [s * BPS, min((s + 1) * BPS, n_blocks[b])) of batch
row b, KV head h, for all MP (padded) query rows of that head (GQA: the g query heads x L positions). A field's
tile sits at  ptr + block_table[b, j] * stride_block + h * stride_head + b * stride_batch  (one kernel for the
transformers cache [B, H, n, ...] and a vLLM pool [num_blocks, H, ...]). Per block (queries pre-scaled):

    keys (rows = D channels, codes [D, G]):   s[m, g] = t_g * ((q a) @ codes + q . z)[m, g]
    online softmax:                           m' = max(m, max_g s),  p = exp(s - m'),  l = l e^(m - m') + sum_g p
    values (rows = G tokens, codes [G, D]):   o[m, d] = c_d * ((p a) @ codes + p . z)[m, d]
    acc_rot, acc_plain scaled by e^(m - m'); o added to acc_rot on rotated value tiles, to acc_plain otherwise

q is the plain query or q H per key tile (ROT: 0 none, 1 hadamard, 2 per-tile flag). Writes the partial state
(m, l, acc_rot, acc_plain) of the split; `ops.merge_states` combines splits and exact regions.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvarn.kernels.triton.kernels.codes import load_codes


@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    if PREC == 1:
        return tl.dot(a, b, input_precision="tf32")
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _program(q_ptr, qr_ptr, sq_b, sq_h, nb_ptr, H, BPS, MP: tl.constexpr, D: tl.constexpr):
    """This program's batch row b, KV head h, blocks [j0, j1) of its split, and its queries q, q~ [MP, D]."""
    pid = tl.program_id(0)
    b = (pid // H).to(tl.int64)  # 64-bit offsets: a cache-layout field can pass 2^31 bytes
    h = (pid % H).to(tl.int64)
    j0 = tl.program_id(1) * BPS
    j1 = tl.minimum(j0 + BPS, tl.load(nb_ptr + b))
    qoff = b * sq_b + h * sq_h + tl.arange(0, MP)[:, None] * D + tl.arange(0, D)[None, :]
    return b, h, j0, j1, tl.load(q_ptr + qoff), tl.load(qr_ptr + qoff)


@triton.jit
def _key_query(q, qr, flag_ptr, KROT: tl.constexpr):
    """The query a key tile is scored with: plain (KROT 0), rotated (1), or as the tile's flag says (2)."""
    if KROT == 0:
        qk = q
    elif KROT == 1:
        qk = qr
    else:
        qk = tl.where(tl.load(flag_ptr) != 0, qr, q)
    return qk


@triton.jit
def _store_state(m_ptr, l_ptr, or_ptr, op_ptr, S, m_i, l_i, acc_r, acc_p, MP: tl.constexpr, D: tl.constexpr):
    """This program's partial state (m, l [MP], acc_rot, acc_plain [MP, D]) at its (row x head, split) slot."""
    rm = tl.arange(0, MP)
    so = (tl.program_id(0) * S + tl.program_id(1)) * MP
    tl.store(m_ptr + so + rm, m_i)
    tl.store(l_ptr + so + rm, l_i)
    ao = so * D + rm[:, None] * D + tl.arange(0, D)[None, :]
    tl.store(or_ptr + ao, acc_r)
    tl.store(op_ptr + ao, acc_p)


@triton.jit
def decode_split_kernel(
    q_ptr, qr_ptr, sq_b, sq_h,  # queries [B, H, MP, D] contiguous rows (plain and rotated)
    bt_ptr, sbt, nb_ptr,  # block_table [B, max_blocks] int32, n_blocks [B] int32
    kc_ptr, kc_b, kc_n, kc_h, ka_ptr, ka_b, ka_n, ka_h, kz_ptr, kz_b, kz_n, kz_h,
    kt_ptr, kt_b, kt_n, kt_h, kf_ptr, kf_b, kf_n, kf_h,
    vc_ptr, vc_b, vc_n, vc_h, va_ptr, va_b, va_n, va_h, vz_ptr, vz_b, vz_n, vz_h,
    vt_ptr, vt_b, vt_n, vt_h, vf_ptr, vf_b, vf_n, vf_h,
    m_ptr, l_ptr, or_ptr, op_ptr,  # partial states: m, l [B, H, S, MP]; acc_rot, acc_plain [B, H, S, MP, D]
    H, S, BPS,  # KV heads, splits, blocks per split
    MP: tl.constexpr, D: tl.constexpr, G: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
    KROT: tl.constexpr, VROT: tl.constexpr, KCOL: tl.constexpr, VCOL: tl.constexpr,
    PLANES: tl.constexpr, PREC: tl.constexpr,
):
    b, h, j0, j1, q, qr = _program(q_ptr, qr_ptr, sq_b, sq_h, nb_ptr, H, BPS, MP, D)
    rd = tl.arange(0, D)
    rg = tl.arange(0, G)
    m_i = tl.full([MP], float("-inf"), tl.float32)
    l_i = tl.zeros([MP], tl.float32)
    acc_r = tl.zeros([MP, D], tl.float32)
    acc_p = tl.zeros([MP, D], tl.float32)
    for j in range(j0, j1):
        blk = tl.load(bt_ptr + b * sbt + j).to(tl.int64)
        # -- keys: logits [MP, G]
        ko = blk * kc_n + h * kc_h + b * kc_b
        codes = load_codes(kc_ptr + ko, D, G, KBITS, PLANES)  # [D, G]
        ka = tl.load(ka_ptr + blk * ka_n + h * ka_h + b * ka_b + rd).to(tl.float32)
        kz = tl.load(kz_ptr + blk * kz_n + h * kz_h + b * kz_b + rd).to(tl.float32)
        qk = _key_query(q, qr, kf_ptr + blk * kf_n + h * kf_h + b * kf_b, KROT)
        sc = _dot(qk * ka[None, :], codes, PREC) + tl.sum(qk * kz[None, :], axis=1)[:, None]
        if KCOL:
            sc = sc * tl.load(kt_ptr + blk * kt_n + h * kt_h + b * kt_b + rg).to(tl.float32)[None, :]
        # -- online softmax
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
        # -- values: output [MP, D]
        codes = load_codes(vc_ptr + blk * vc_n + h * vc_h + b * vc_b, G, D, VBITS, PLANES)  # [G, D]
        va = tl.load(va_ptr + blk * va_n + h * va_h + b * va_b + rg).to(tl.float32)
        vz = tl.load(vz_ptr + blk * vz_n + h * vz_h + b * vz_b + rg).to(tl.float32)
        o = _dot(p * va[None, :], codes, PREC) + tl.sum(p * vz[None, :], axis=1)[:, None]
        if VCOL:
            o = o * tl.load(vt_ptr + blk * vt_n + h * vt_h + b * vt_b + rd).to(tl.float32)[None, :]
        acc_r = acc_r * alpha[:, None]
        acc_p = acc_p * alpha[:, None]
        if VROT == 0:
            acc_p += o
        elif VROT == 1:
            acc_r += o
        else:
            vflag = tl.load(vf_ptr + blk * vf_n + h * vf_h + b * vf_b)
            acc_r += tl.where(vflag != 0, o, 0.0)
            acc_p += tl.where(vflag != 0, 0.0, o)
    _store_state(m_ptr, l_ptr, or_ptr, op_ptr, S, m_i, l_i, acc_r, acc_p, MP, D)


# -- version 2: code planes unpacked in registers ------------------------------------------------------------------
# The kernel above reads each code byte once per code it holds and turns a whole [128, 128] float32 tile through
# shared memory per `tl.dot` (H200: L1-bound, 107 KB of shared memory a program; docs/gpu). In the planes layout
# (kernels/codes.py) bit plane p of a key row holds the G / PER consecutive tokens [p G/PER, (p+1) G/PER), and bit
# plane p of a value row the channels [p D/PER, (p+1) D/PER). So one vectorized load of a key tile's bytes [D, G/PER]
# gives PER sub-chunks of G/PER tokens, each scored by one small dot, updated into the online softmax, and multiplied
# with the bytes [G/PER, D/PER] of its value rows, one dot per value plane: every byte is read once and no float tile
# is built. Codes are small integers, exact in bf16: PREC 2 ("bf16x3") splits the float32 operand into three bf16
# parts (8 + 8 + 8 significant bits) for tensor-core dots accumulated in float32.


@triton.jit
def _parts(a, PREC: tl.constexpr):
    """a (float32) as the dot operands of `_mm`: (hi, mid, lo) bf16 with a ~= hi + mid + lo for PREC >= 2, else a."""
    if PREC >= 2:
        hi = a.to(tl.bfloat16)
        r = a - hi.to(tl.float32)  # exact: hi holds a's leading 8 bits
        mid = r.to(tl.bfloat16)
        lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
    else:  # one return: Triton wants a single return type across a jit function's returns
        hi = a
        mid = a
        lo = a
    return hi, mid, lo


@triton.jit
def _mm(hi, mid, lo, c, PREC: tl.constexpr):
    """(hi + mid + lo) [M, K] @ c [K, N] (integer codes) in float32; the small parts first. PREC 3: PREC 2's parts
    multiplied as float32 (Triton's interpreter multiplies bf16 dot operands wrongly: tests run this)."""
    if PREC == 2:
        cb = c.to(tl.bfloat16)
        acc = tl.dot(lo, cb)
        acc = tl.dot(mid, cb, acc)
        acc = tl.dot(hi, cb, acc)
    elif PREC == 3:
        cf = c.to(tl.float32)
        acc = tl.dot(lo.to(tl.float32), cf, input_precision="ieee")
        acc = tl.dot(mid.to(tl.float32), cf, acc, input_precision="ieee")
        acc = tl.dot(hi.to(tl.float32), cf, acc, input_precision="ieee")
    else:
        acc = _dot(hi, c.to(tl.float32), PREC)
    return acc


@triton.jit
def _planes(o0, o1, o2, o3, PER: tl.constexpr, M: tl.constexpr, D: tl.constexpr):
    """Value planes' outputs [M, D/PER] (plane p = channels [p D/PER, (p+1) D/PER)) -> [M, D]."""
    if PER == 2:
        return tl.reshape(tl.permute(tl.join(o0, o1), (0, 2, 1)), (M, D))
    x = tl.join(tl.join(o0, o2), tl.join(o1, o3))  # [M, D/4, i, j] holds plane 2 i + j
    return tl.reshape(tl.permute(x, (0, 2, 3, 1)), (M, D))


@triton.jit
def decode_planes_kernel(
    q_ptr, qr_ptr, sq_b, sq_h,
    bt_ptr, sbt, nb_ptr,
    kc_ptr, kc_b, kc_n, kc_h, ka_ptr, ka_b, ka_n, ka_h, kz_ptr, kz_b, kz_n, kz_h,
    kt_ptr, kt_b, kt_n, kt_h, kf_ptr, kf_b, kf_n, kf_h,
    vc_ptr, vc_b, vc_n, vc_h, va_ptr, va_b, va_n, va_h, vz_ptr, vz_b, vz_n, vz_h,
    vt_ptr, vt_b, vt_n, vt_h, vf_ptr, vf_b, vf_n, vf_h,
    m_ptr, l_ptr, or_ptr, op_ptr,
    H, S, BPS,
    MP: tl.constexpr, D: tl.constexpr, G: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
    KROT: tl.constexpr, VROT: tl.constexpr, KCOL: tl.constexpr, VCOL: tl.constexpr, PREC: tl.constexpr,
    UNROLL: tl.constexpr, STACK: tl.constexpr,
):
    """`decode_split_kernel`'s arguments, outputs and arithmetic (planes layout only): per sub-chunk of GB tokens,
    s = t * ((q a) @ codes + q . z), the online softmax, o = c * ((p a) @ codes + p . z) per value plane.

    STACK (bf16x3 only; the version 3 candidate, not yet timed on a GPU): the three bf16 parts of each float32
    operand are stacked as rows of one dot, [4 MP, K] (`_stack`), instead of three dots of [MP, K]; MP may then be
    4 (>= 16 otherwise). sm_90 cubin, kvarn-k2v2 at 2 / 4 warps: 242 / 148 registers, no spills, against 255 with
    spills / 220 without (docs/gpu/h200-2026-12-04b.md)."""
    KPER: tl.constexpr = 8 // KBITS
    VPER: tl.constexpr = 8 // VBITS
    GB: tl.constexpr = G // KPER  # tokens per key plane = bytes per key row
    DB: tl.constexpr = D // VPER  # channels per value plane = bytes per value row
    KM: tl.constexpr = (1 << KBITS) - 1
    VM: tl.constexpr = (1 << VBITS) - 1
    b, h, j0, j1, q, qr = _program(q_ptr, qr_ptr, sq_b, sq_h, nb_ptr, H, BPS, MP, D)
    rd = tl.arange(0, D)
    rt = tl.arange(0, GB)
    rc = tl.arange(0, DB)
    m_i = tl.full([MP], float("-inf"), tl.float32)
    l_i = tl.zeros([MP], tl.float32)
    acc_r = tl.zeros([MP, D], tl.float32)
    acc_p = tl.zeros([MP, D], tl.float32)
    for j in range(j0, j1):
        blk = tl.load(bt_ptr + b * sbt + j).to(tl.int64)
        kbytes = tl.load(kc_ptr + blk * kc_n + h * kc_h + b * kc_b + rd[:, None] * GB + rt[None, :])
        ka = tl.load(ka_ptr + blk * ka_n + h * ka_h + b * ka_b + rd).to(tl.float32)
        kz = tl.load(kz_ptr + blk * kz_n + h * kz_h + b * kz_b + rd).to(tl.float32)
        qk = _key_query(q, qr, kf_ptr + blk * kf_n + h * kf_h + b * kf_b, KROT)
        qh, qm, ql = _operand(qk * ka[None, :], PREC, STACK, MP, D)
        qz = tl.sum(qk * kz[None, :], axis=1)
        vo = blk * vc_n + h * vc_h + b * vc_b
        if VROT == 2:
            vflag = tl.load(vf_ptr + blk * vf_n + h * vf_h + b * vf_b)
        for p in tl.range(0, KPER, loop_unroll_factor=UNROLL):  # UNROLL 1: a loop (fewer live registers)
            # -- keys: logits [MP, GB] of tokens p GB + rt
            sc = _times_codes(qh, qm, ql, (kbytes >> (p * KBITS)) & KM, PREC, STACK, MP, GB) + qz[:, None]
            if KCOL:
                sc = sc * tl.load(kt_ptr + blk * kt_n + h * kt_h + b * kt_b + p * GB + rt).to(tl.float32)[None, :]
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            alpha = tl.exp(m_i - m_new)
            pr = tl.exp(sc - m_new[:, None])
            l_i = l_i * alpha + tl.sum(pr, axis=1)
            m_i = m_new
            # -- values: rows p GB + rt, one dot per value plane
            tok = p * GB + rt
            vbytes = tl.load(vc_ptr + vo + tok[:, None] * DB + rc[None, :])
            va = tl.load(va_ptr + blk * va_n + h * va_h + b * va_b + tok).to(tl.float32)
            vz = tl.load(vz_ptr + blk * vz_n + h * vz_h + b * vz_b + tok).to(tl.float32)
            ph, pm, pl = _operand(pr * va[None, :], PREC, STACK, MP, GB)
            o0 = _times_codes(ph, pm, pl, vbytes & VM, PREC, STACK, MP, DB)
            o1 = _times_codes(ph, pm, pl, (vbytes >> VBITS) & VM, PREC, STACK, MP, DB)
            if VPER == 4:
                o2 = _times_codes(ph, pm, pl, (vbytes >> (2 * VBITS)) & VM, PREC, STACK, MP, DB)
                o3 = _times_codes(ph, pm, pl, (vbytes >> (3 * VBITS)) & VM, PREC, STACK, MP, DB)
                o = _planes(o0, o1, o2, o3, VPER, MP, D)
            else:
                o = _planes(o0, o1, o0, o1, VPER, MP, D)
            o = o + tl.sum(pr * vz[None, :], axis=1)[:, None]
            if VCOL:
                o = o * tl.load(vt_ptr + blk * vt_n + h * vt_h + b * vt_b + rd).to(tl.float32)[None, :]
            if VROT == 0:  # the accumulator a rotation never feeds stays 0
                acc_p = acc_p * alpha[:, None] + o
            elif VROT == 1:
                acc_r = acc_r * alpha[:, None] + o
            else:
                acc_r = acc_r * alpha[:, None] + tl.where(vflag != 0, o, 0.0)
                acc_p = acc_p * alpha[:, None] + tl.where(vflag != 0, 0.0, o)
    _store_state(m_ptr, l_ptr, or_ptr, op_ptr, S, m_i, l_i, acc_r, acc_p, MP, D)


# -- the bf16 parts stacked as rows of one dot (decode_planes_kernel's STACK) -----------------------------------

@triton.jit
def _stack(a, QP: tl.constexpr, K: tl.constexpr):
    """a [QP, K] float32 -> [4 QP, K] bf16: rows part * QP + m hold part (hi, mid, lo, 0) of a's row m."""
    hi, mid, lo = _parts(a, 2)
    x = tl.join(tl.join(hi, lo), tl.join(mid, tl.zeros_like(hi)))  # [QP, K, i, j]: part 2 j + i
    return tl.reshape(tl.permute(x, (3, 2, 0, 1)), (4 * QP, K))


@triton.jit
def _stacked_mm(a, c, PREC: tl.constexpr):
    """a [4 QP, K] (`_stack`) @ c [K, N] (integer codes): a bf16 tensor-core dot (PREC 2), or float32 (PREC 3: the
    interpreter, see `_mm`)."""
    if PREC == 2:
        out = tl.dot(a, c.to(tl.bfloat16))
    else:
        out = tl.dot(a.to(tl.float32), c.to(tl.float32), input_precision="ieee")
    return out


@triton.jit
def _unstack(s, QP: tl.constexpr, N: tl.constexpr):
    """[4 QP, N] -> [QP, N]: the parts' products summed."""
    return tl.sum(tl.reshape(s, (4, QP, N)), axis=0)


@triton.jit
def _operand(a, PREC: tl.constexpr, STACK: tl.constexpr, R: tl.constexpr, K: tl.constexpr):
    """a [R, K] float32 as the left operand of `_times_codes`: three parts, or (STACK) the parts stacked as rows."""
    if STACK:
        x = _stack(a, R, K)
        y = x
        z = x
    else:
        x, y, z = _parts(a, PREC)
    return x, y, z


@triton.jit
def _times_codes(x, y, z, c, PREC: tl.constexpr, STACK: tl.constexpr, R: tl.constexpr, N: tl.constexpr):
    """`_operand`'s a [R, K] @ codes c [K, N] -> float32 [R, N]."""
    if STACK:
        out = _unstack(_stacked_mm(x, c, PREC), R, N)
    else:
        out = _mm(x, y, z, c, PREC)
    return out
