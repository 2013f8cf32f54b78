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
    pid = tl.program_id(0)
    s = tl.program_id(1)
    b = (pid // H).to(tl.int64)  # 64-bit offsets: a cache-layout field can pass 2^31 bytes
    h = (pid % H).to(tl.int64)
    nb = tl.load(nb_ptr + b)
    j0 = s * BPS
    j1 = tl.minimum(j0 + BPS, nb)
    rm = tl.arange(0, MP)
    rd = tl.arange(0, D)
    rg = tl.arange(0, G)
    qoff = b * sq_b + h * sq_h + rm[:, None] * D + rd[None, :]
    q = tl.load(q_ptr + qoff)
    qr = tl.load(qr_ptr + qoff)
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
        if KROT == 0:
            qk = q
        elif KROT == 1:
            qk = qr
        else:
            flag = tl.load(kf_ptr + blk * kf_n + h * kf_h + b * kf_b)
            qk = tl.where(flag != 0, qr, q)
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
    so = (pid * S + s) * MP
    tl.store(m_ptr + so + rm, m_i)
    tl.store(l_ptr + so + rm, l_i)
    ao = so * D + rm[:, None] * D + rd[None, :]
    tl.store(or_ptr + ao, acc_r)
    tl.store(op_ptr + ao, acc_p)
