"""Typed launch wrappers of kvarn's Triton kernels (the `@triton.jit` code lives in `kernels/`).

Packed fields of one tensor kind (keys or values) of `AffineQuantizer` tiles are addressed per (batch row b, block
j, KV head h) as  field + block_table[b, j] * stride_block + h * stride_head + b * stride_batch  (`TileFields`):
    the transformers cache, fields [B, H, n, ...]:  `TileFields.from_cache`, block_table[b, j] = j
    a vLLM pool, fields [num_blocks, H, ...]:       `TileFields.from_pool`, stride_batch = 0
Keys must be stored per channel (rows = D channels, C = G tokens) and values per token (rows = G, C = D), 2 or 4
bits, D and G powers of two >= 16. Tensors must be on CUDA, or on the CPU under TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import triton

from kvarn.kernels.triton.kernels.codes import pack_kernel, unpack_kernel
from kvarn.kernels.triton.kernels.decode import decode_planes_kernel, decode_split_kernel
from kvarn.kernels.triton.kernels.store import store_tiles_kernel
from kvarn.ops.codes import Rotation
from kvarn.ops.hadamard import hadamard_dense
from kvarn.ops.packing import pack_codes
from kvarn.quant.affine import decode_tiles
from kvarn.quant.policy import query_weighted, squared_error
from kvarn.quant.tiles import AffineFormat, AffineTiles

Layout = Literal["cache", "pool", "strided"]
Precision = Literal["auto", "ieee", "tf32", "bf16x3"]
PRECISIONS = {"ieee": 0, "tf32": 1, "bf16x3": 2}  # the kernels' PREC
# "auto": the planes kernel multiplies codes by three bf16 parts of the float32 operand on tensor cores (H200: within
# the float32 bound of gpu_check step 1), the tile kernel in float32 ("ieee"); "tf32" is measured, never used
AUTO_PRECISION = {"planes": "bf16x3", "stacked": "bf16x3", "tile": "ieee"}
SUPPORTED_BITS = (2, 4)
NUM_WARPS = 8  # a program holds [D, G] float32 code tiles (64 KiB at D = G = 128): 8 warps keep them in registers
DECODE_STAGES = 3  # Triton's default software pipelining depth for the decode loop (H200, 2026-12-04: 107 KiB of
# shared memory and 97 registers per 256-thread program, 2 programs per SM; gpu_check step 4 sweeps it)
# (warps, pipeline stages, unroll of the sub-chunk loop) of each decode kernel version; gpu_check step 4 sweeps them.
# planes on the H200 (2026-12-04, evening; batch 8, 32k): 2 warps 0.50 ms, 4 warps 0.64, 8 warps 1.49
# (docs/gpu/h200-2026-12-04b.md); stacked: never timed
DECODE_LAUNCH = {"tile": (NUM_WARPS, DECODE_STAGES, 1), "planes": (2, 2, 1), "stacked": (4, 2, 1)}
DECODE_KERNEL: Literal["auto", "tile", "planes", "stacked"] = "auto"  # auto: planes (version 2) where
# `planes_unsupported` says it can run, else tile (version 1, `decode_split_kernel`); stacked: the version 3
# candidate (opt-in until timed on a GPU, kernels/decode.py)

# A partial softmax state over some keys, for M query rows: running max m [B, H, k, M], sum l [B, H, k, M],
# unnormalized outputs acc_rot / acc_plain [B, H, k, M, D] (acc_rot None: nothing rotated).
State = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]


@functools.cache
def code_layout() -> bool:
    """True when `kvarn.ops.packing` writes the planes layout, False for consecutive codes (kernels/codes.py)."""
    probe = torch.arange(16, dtype=torch.uint8).view(1, 16) % 4
    packed = pack_codes(probe, 2)[0].tolist()
    consecutive = [sum(int(probe[0, 4 * k + j]) << (2 * j) for j in range(4)) for k in range(4)]
    planes = [sum(int(probe[0, k + 4 * j]) << (2 * j) for j in range(4)) for k in range(4)]
    if packed == consecutive:
        return False
    if packed == planes:
        return True
    raise RuntimeError(f"kvarn.ops.packing writes a code layout the Triton kernels do not know: {packed}")


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _check_device(*tensors: torch.Tensor) -> None:
    interpret = _interpreted()
    std = getattr(triton.language.standard, "_sum_combine", None)  # @jit-decorated when triton was imported
    if interpret and std is not None and type(std).__name__ == "JITFunction":
        raise RuntimeError("TRITON_INTERPRET=1 was set after triton was imported (by torch, transformers or another "
                           "module): triton's own library is then compiled-only. Set it before anything imports triton")
    for t in tensors:
        if t.device.type != "cuda" and not interpret:
            raise ValueError(f"Triton kernels need CUDA tensors (got {t.device}); on the CPU set TRITON_INTERPRET=1 "
                             "(slow, for tests)")


def _pow2(n: int, what: str) -> int:
    if n < 16 or n & (n - 1):
        raise ValueError(f"the Triton kernels need {what} to be a power of two >= 16, got {n}")
    return n


@dataclass(frozen=True)
class TileFields:
    """Packed fields of one tensor kind, as the kernels address them (module docstring)."""

    codes: torch.Tensor  # [..., R, C*bits/8] uint8
    row_scale: torch.Tensor  # [..., R]
    row_zero: torch.Tensor  # [..., R]
    col_scale: torch.Tensor | None  # [..., C] (VarN only)
    rotated: torch.Tensor | None  # [...] uint8 (rotate="auto" only)
    bits: int
    rotate: str
    axis: str  # the quantizer's rows: "channel" (keys) or "token" (values)
    layout: Layout
    fmt: AffineFormat | None = None  # the tiles' format (scale dtypes, tile, head_dim); the store needs it
    strides: tuple[int, ...] = ()  # layout "strided": (batch, head, block) element strides of the 5 fields

    @classmethod
    def strided(cls, fields: Sequence[torch.Tensor], strides: Sequence[int], bits: int, rotate: int,
                axis: str) -> TileFields:
        """The decode seat's arguments (`kvarn.ops.seats`): fields codes, row_scale, row_zero, col_scale, rotated
        (empty: absent) with (batch, head, block) element strides each."""
        opt = [t if t.numel() else None for t in fields]
        return cls(opt[0], opt[1], opt[2], opt[3], opt[4], bits, Rotation(rotate).name.lower(), axis, "strided",
                   strides=tuple(strides))

    @classmethod
    def of(cls, tiles: AffineTiles, layout: Layout) -> TileFields:
        if not isinstance(tiles, AffineTiles):
            raise TypeError(f"the Triton kernels read AffineTiles, not {type(tiles).__name__}")
        c = tiles.fmt
        if c.bits not in SUPPORTED_BITS:
            raise ValueError(f"the Triton kernels support {SUPPORTED_BITS}-bit codes, not {c.bits}")
        lead = 3 if layout == "cache" else 2
        codes = tiles.codes
        if codes.dtype != torch.uint8 or codes.dim() != lead + 2:
            raise ValueError(f"codes must be uint8 with {lead} leading axes ({layout} layout), got "
                             f"{codes.dtype} {tuple(codes.shape)}")
        for name, t in tiles.items():
            inner = t.stride()[lead:]
            want = [math.prod(t.shape[lead + i + 1:]) for i in range(len(inner))]
            if list(inner) != want:
                raise ValueError(f"field {name!r} must be contiguous past its {lead} leading axes, strides "
                                 f"{t.stride()} for shape {tuple(t.shape)}")
        return cls(codes, tiles.row_scale, tiles.row_zero, tiles.col_scale, tiles.rotated, c.bits, c.rotate, c.axis,
                   layout, c)

    @classmethod
    def from_cache(cls, tiles: AffineTiles) -> TileFields:
        """Fields [B, H, n, ...] of the transformers cache (block_table[b, j] = j)."""
        return cls.of(tiles, "cache")

    @classmethod
    def from_pool(cls, tiles: AffineTiles) -> TileFields:
        """Fields [num_blocks, H, ...] of a paged pool (block_table[b, j] = pool block)."""
        return cls.of(tiles, "pool")

    def args(self, t: torch.Tensor | None) -> tuple:
        """(tensor, stride_batch, stride_block, stride_head) of one field; an absent field passes the codes with
        zero strides (the kernel never reads it: its constexpr flag is off)."""
        if t is None:
            return self.codes, 0, 0, 0
        if self.layout == "strided":
            i = next(i for i, f in enumerate((self.codes, self.row_scale, self.row_zero, self.col_scale,
                                                self.rotated)) if f is t)
            sb, sh, sn = self.strides[3 * i:3 * i + 3]
            return t, sb, sn, sh
        if self.layout == "cache":
            return t, t.stride(0), t.stride(2), t.stride(1)
        return t, 0, t.stride(0), t.stride(1)

    def all_args(self) -> tuple:
        return sum((self.args(t) for t in (self.codes, self.row_scale, self.row_zero, self.col_scale,
                                           self.rotated)), ())

    @property
    def heads(self) -> int:
        return self.codes.shape[1]

    @property
    def rows(self) -> int:
        return self.codes.shape[-2]

    @property
    def cols(self) -> int:
        return self.codes.shape[-1] * 8 // self.bits


# -- codes (tests, debugging) --------------------------------------------------------------------------------------
def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """packed [N, R, C*bits/8] uint8 -> codes [N, R, C] float32 with the kernels' unpacking."""
    _check_device(packed)
    n, r, nb = packed.shape
    out = torch.empty(n, r, nb * 8 // bits, dtype=torch.float32, device=packed.device)
    unpack_kernel[(n,)](packed.contiguous(), out, R=r, C=nb * 8 // bits, BITS=bits, PLANES=code_layout())
    return out


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [N, R, C] (integers in [0, 2^bits)) -> packed [N, R, C*bits/8] uint8 with the kernels' packing."""
    _check_device(codes)
    n, r, c = codes.shape
    out = torch.empty(n, r, c * bits // 8, dtype=torch.uint8, device=codes.device)
    pack_kernel[(n,)](codes.to(torch.int32).contiguous(), out, R=r, C=c, BITS=bits, PLANES=code_layout())
    return out


# -- decode attention ----------------------------------------------------------------------------------------------
MAX_BLOCKS_PER_SPLIT = 8  # H200, 2026-12-04 (gpu_check step 4): batch 8 x 8 KV heads at 32k, 1.22 ms with the
# ~52 blocks per split that two programs per SM give (320 programs, 1.2 waves) vs 1.00 ms at 8; batch 1: equal


def _splits(batch_heads: int, max_blocks: int, device: torch.device) -> int:
    """Blocks per split: enough programs to fill the GPU twice over, and at most `MAX_BLOCKS_PER_SPLIT` blocks each
    (one program per row-head on the CPU)."""
    if device.type != "cuda" or max_blocks == 0:
        return max(1, max_blocks)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    splits = max(1, min(max_blocks, -(-2 * sms // batch_heads)))
    return min(MAX_BLOCKS_PER_SPLIT, -(-max_blocks // splits))


def planes_unsupported(d: int, g: int, kbits: int, vbits: int) -> str | None:
    """Why the planes kernel (version 2) cannot take these tiles (None: it can): its dots need >= 16 tokens per key
    plane and >= 16 channels per value plane, and the planes code layout."""
    if not code_layout():
        return "kvarn.ops.packing writes consecutive codes, not planes"
    if g * kbits // 8 < 16 or d * vbits // 8 < 16:
        return f"G = {g} with {kbits}-bit keys or D = {d} with {vbits}-bit values gives planes of < 16 rows"
    return None


def decode_partials(q: torch.Tensor, q_rot: torch.Tensor | None, keys: TileFields, values: TileFields,
                    block_table: torch.Tensor, n_blocks: torch.Tensor, blocks_per_split: int | None = None,
                    precision: Precision = "auto", splits: int | None = None) -> State:
    """Split-K partial states of the packed tiles (kernels/decode.py). q, q_rot [B, H, M, D] float32, already
    scaled (q_rot = q H, needed when either kind is rotated); block_table [B, max_blocks] int32, n_blocks [B]
    int32 (n_blocks[b] <= max_blocks, not checked on the device: no host sync). splits: a fixed split count S (grid
    (B*H, S) whatever the blocks, ceil(max_blocks / S) blocks each, trailing splits empty: a launch whose shape
    depends on B only, for CUDA graphs); else `blocks_per_split` or enough splits to fill the GPU."""
    b, h, m, d = q.shape
    g = keys.cols
    if keys.axis != "channel" or values.axis != "token" or keys.rows != d or values.cols != d or values.rows != g:
        raise ValueError(f"keys must be per channel [D={d}, G] and values per token [G, D={d}]: got key tiles "
                         f"[{keys.rows}, {keys.cols}], value tiles [{values.rows}, {values.cols}]")
    _pow2(d, "head_dim")
    _pow2(g, "the tile size G")
    if keys.heads != h or values.heads != h:
        raise ValueError(f"query has {h} KV heads, fields have {keys.heads} / {values.heads}")
    if block_table.dtype != torch.int32 or n_blocks.dtype != torch.int32 or block_table.dim() != 2 \
            or block_table.shape[0] != b or n_blocks.shape != (b,):
        raise ValueError(f"block_table must be int32 [B={b}, max_blocks] and n_blocks int32 [B]: got "
                         f"{block_table.dtype} {tuple(block_table.shape)}, {n_blocks.dtype} {tuple(n_blocks.shape)}")
    if precision != "auto" and precision not in PRECISIONS:
        raise ValueError(f"precision must be 'auto' or one of {', '.join(PRECISIONS)}, got {precision!r}")
    rotated = keys.rotate != "none" or values.rotate != "none"
    if rotated and q_rot is None:
        raise ValueError("rotated tiles need the rotated query q_rot = q H")
    _check_device(q, keys.codes, values.codes, block_table)
    why = planes_unsupported(d, g, keys.bits, values.bits)
    kind = DECODE_KERNEL if DECODE_KERNEL != "auto" else "tile" if why else "planes"
    if kind != "tile" and why:
        raise ValueError(f"the {kind} decode kernel cannot read these tiles: {why}")
    if kind == "tile" and precision == "bf16x3":
        raise ValueError("precision 'bf16x3' needs the planes or stacked decode kernel")
    if kind == "stacked" and precision not in ("auto", "bf16x3"):
        raise ValueError(f"the stacked decode kernel runs bf16x3 only, not {precision!r}")
    precision = AUTO_PRECISION[kind] if precision == "auto" else precision
    # query rows (MP): >= 16, a dot's minimum, or >= 4 stacked (the dots take three bf16 parts and a zero part of
    # every row)
    mp = max(4, triton.next_power_of_2(m)) if kind == "stacked" else max(16, triton.next_power_of_2(m))
    qp = q.new_zeros(b, h, mp, d, dtype=torch.float32)
    qp[:, :, :m] = q
    if rotated:
        qrp = qp.new_zeros(b, h, mp, d)
        qrp[:, :, :m] = q_rot
    else:
        qrp = qp
    max_blocks = block_table.shape[1]
    if splits is not None:
        if splits < 1:
            raise ValueError(f"splits must be >= 1, got {splits}")
        s, bps = splits, max(1, -(-max_blocks // splits))
    else:
        bps = blocks_per_split or _splits(b * h, max_blocks, q.device)
        s = max(1, -(-max_blocks // bps))
    m_part = qp.new_empty(b, h, s, mp)
    l_part = torch.empty_like(m_part)
    acc_r = qp.new_empty(b, h, s, mp, d)
    acc_p = torch.empty_like(acc_r)
    bt = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    prec = PRECISIONS[precision] + int(precision == "bf16x3" and _interpreted())  # 3: bf16x3 emulated (kernels)
    consts = dict(MP=mp, D=d, G=g, KBITS=keys.bits, VBITS=values.bits,
                  KROT=int(Rotation.of(keys.rotate)), VROT=int(Rotation.of(values.rotate)),
                  KCOL=keys.col_scale is not None, VCOL=values.col_scale is not None, PREC=prec)
    warps, stages, unroll = DECODE_LAUNCH[kind]
    kernel = decode_split_kernel if kind == "tile" else decode_planes_kernel
    if kind == "tile":
        consts["PLANES"] = code_layout()
    else:
        consts.update(UNROLL=unroll, STACK=kind == "stacked")
    kernel[(b * h, s)](
        qp, qrp, qp.stride(0), qp.stride(1), bt, bt.stride(0), n_blocks.contiguous(),
        *keys.all_args(), *values.all_args(),
        m_part, l_part, acc_r, acc_p, h, s, bps, **consts, num_warps=warps, num_stages=stages,
    )
    return m_part[..., :m], l_part[..., :m], acc_r[..., :m, :], acc_p[..., :m, :]


def exact_state(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor | None = None) -> State:
    """Partial state of exact (plain-basis) keys/values k, v [B, H, t, D] for q [B, H, M, D] (scaled); rows
    t >= lengths[b] of batch row b are ignored (lengths [B] or None = all t)."""
    s = q @ k.to(q.dtype).transpose(-1, -2)  # [B, H, M, t]
    if lengths is not None:
        pad = torch.arange(k.shape[2], device=q.device).view(1, 1, 1, -1) >= lengths.view(-1, 1, 1, 1)
        s = s.masked_fill(pad, float("-inf"))
    m = s.amax(-1)
    p = torch.where(torch.isinf(m)[..., None], 0.0, torch.exp(s - m[..., None]))
    return m.unsqueeze(2), p.sum(-1).unsqueeze(2), None, (p @ v.to(q.dtype)).unsqueeze(2)


def merge_states(states: Sequence[State]) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine partial states (log-sum-exp) -> normalized (out_rot, out_plain) [B, H, M, D]; rows that saw no key
    give 0. Caller: o = out_rot @ H + out_plain."""
    m = torch.cat([st[0] for st in states], dim=2)
    mx = m.amax(2, keepdim=True)
    w = torch.where(torch.isinf(m), 0.0, torch.exp(m - mx))  # [B, H, k, M]
    ws = w.split([st[0].shape[2] for st in states], dim=2)
    den = sum((wi * st[1]).sum(2) for wi, st in zip(ws, states))
    inv = torch.where(den > 0, 1.0 / den, 0.0).unsqueeze(-1)
    out_p = sum((wi.unsqueeze(-1) * st[3]).sum(2) for wi, st in zip(ws, states)) * inv
    rot = [(wi.unsqueeze(-1) * st[2]).sum(2) for wi, st in zip(ws, states) if st[2] is not None]
    out_r = sum(rot) * inv if rot else torch.zeros_like(out_p)
    return out_r, out_p


def decode_attention(q: torch.Tensor, q_rot: torch.Tensor | None, keys: TileFields, values: TileFields,
                     block_table: torch.Tensor, n_blocks: torch.Tensor,
                     exact: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = (),
                     blocks_per_split: int | None = None, precision: Precision = "auto",
                     splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax attention of q [B, H, M, D] (scaled, float32) over packed tiles + exact regions (k, v [B, H, t, D],
    lengths [B] or None) in one softmax -> (out_rot, out_plain) [B, H, M, D]; o = out_rot @ H + out_plain."""
    states = [decode_partials(q, q_rot, keys, values, block_table, n_blocks, blocks_per_split, precision, splits)]
    states += [exact_state(q, k, v, n) for k, v, n in exact]
    return merge_states(states)


# -- tile store ----------------------------------------------------------------------------------------------------
def hadamard_f32(d: int, device: torch.device) -> torch.Tensor:
    """The orthonormal Hadamard matrix of `ops.hadamard` [D, D] float32 (`hadamard_dense`)."""
    return hadamard_dense(d, torch.float32, device)


def store_unsupported(c: AffineFormat) -> str | None:
    """Why the store kernel cannot write tiles of format c (None: it can); sizes are checked per call."""
    if c.bits not in SUPPORTED_BITS:
        return f"{c.bits}-bit codes (the store kernel writes {SUPPORTED_BITS})"
    if c.scale_dtype.itemsize == 1 or (c.col_dtype is not None and c.col_dtype.itemsize == 1):
        return ("the Triton store kernel writes 16/32-bit scales; 8-bit scales (fp8 presets, kvarn-auto's relative "
                "column scales) are not supported yet")
    return None


def _check_store(c: AffineFormat, x: torch.Tensor) -> None:
    why = store_unsupported(c)
    if why is not None:
        raise ValueError(f"{why}: store with AffineQuantizer.encode")
    if x.dim() != 4 or x.shape[2] != c.tile or not x.is_floating_point():
        raise ValueError(f"x must be floating tiles [N, H, G={c.tile}, D], got {x.dtype} {tuple(x.shape)}")
    _pow2(x.shape[3], "head_dim")
    _pow2(c.tile, "the tile size G")


def _launch_store(x: torch.Tensor, out: TileFields, varn: bool, varn_iters: int, dst: torch.Tensor, rot: int,
                  flag: torch.Tensor | None) -> None:
    c = out.fmt
    n, h, g, d = x.shape
    channel = c.axis == "channel"
    hm = hadamard_f32(d, x.device) if rot else x
    fl = flag if flag is not None else dst
    store_tiles_kernel[(n * h,)](
        x, x.stride(0), x.stride(1), x.stride(2), dst, fl, hm, *out.all_args(), h,
        D=d, G=g, R=d if channel else g, C=g if channel else d, BITS=c.bits, AXIS_CHANNEL=channel, ROT=rot,
        VARN=varn, ITERS=varn_iters, WRITE_FLAG=out.rotated is not None, PLANES=code_layout(),
        num_warps=NUM_WARPS,
    )


def store_tiles(x: torch.Tensor, out: TileFields, dst: torch.Tensor, varn: bool, varn_iters: int,
                weight: torch.Tensor | None = None, weighted: bool = True) -> None:
    """Quantize tiles x [N, H, G, D] (token-major) in `out`'s format and write them into `out` at block dst[n]
    (int32 [N]) for tile n (cache layout: batch row n, tile index dst[n]; pool layout: pool block dst[n]); varn,
    varn_iters: VarN and its iterations (AffineConfig). rotate="auto": both candidates are encoded, decoded in torch
    (`decode_tiles`) and the policy picks per tile (weighted: query, weight [N, H, D] the running query energy or
    None; else mse), then the chosen one is written with its flag: three launches, no host sync."""
    _check_store(out.fmt, x)
    if dst.dtype != torch.int32 or dst.shape != (x.shape[0],):
        raise ValueError(f"dst must be int32 [N={x.shape[0]}], got {dst.dtype} {tuple(dst.shape)}")
    if out.heads != x.shape[1]:
        raise ValueError(f"x has {x.shape[1]} heads, the fields {out.heads}")
    _check_device(x, out.codes, dst)
    x = x if x.stride(3) == 1 else x.contiguous()
    if out.rotate != "auto":
        _launch_store(x, out, varn, varn_iters, dst, int(out.fmt.rotation), None)
        return
    n, h, g, d = x.shape
    zero = torch.zeros(n, dtype=torch.int32, device=x.device)
    cand = []
    for rot in (1, 0):
        f = out.fmt.empty((n, h, 1), x.device)  # one candidate encoding, cache layout
        scratch = TileFields(f.codes, f.row_scale, f.row_zero, f.col_scale, None, f.fmt.bits, "none", f.fmt.axis,
                             "cache", f.fmt)
        _launch_store(x, scratch, varn, varn_iters, zero, rot, None)
        flags = torch.full((n * h,), rot, dtype=torch.uint8, device=x.device)
        cand.append(decode_tiles(dataclasses.replace(f.flatten(3), rotated=flags)))
    w = weight.reshape(n * h, d) if weight is not None and weighted else None
    policy = query_weighted if weighted else squared_error
    keep = policy(x.reshape(n * h, g, d).float(), cand[0], cand[1], w)
    _launch_store(x, out, varn, varn_iters, dst, 2, keep.to(torch.uint8).contiguous())

