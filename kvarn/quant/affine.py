"""The KVarN family: optional Hadamard rotation, optional VarN, asymmetric RTN per row, folded scales.

Per tile x [G, D] (token-major), in float32:
    w = x @ H                      if the tile is rotated (H orthonormal, `ops.hadamard`)
    X = w^T  [D, G] for keys (rows = channels)  |  X = w [G, D] for values (rows = tokens)
    B, s_c, s_r = varn(X)          if VarN, else B = X, s_c = s_r = 1
    q, delta, lo = rtn(B) per row
Stored (scales in `scale_dtype`, fp16 by default):
    codes     [R, C*b/8] uint8   q packed along the columns
    row_scale [R]  a = s_r * delta
    row_zero  [R]  z = s_r * lo
    col_scale [C]  t = s_c          (only with VarN)
    rotated   []   uint8 flag       (only with rotate="auto": chosen per tile, `kvarn.quant.policy`)
Reconstruction: X^[r, c] = (q[r, c] * a_r + z_r) * t_c, transposed back, then @ H where rotated.

Refined channels (keys, `AffineConfig.refine` > 0; issue 20): in each tile the k rows (channels) whose error the
queries weigh most, w_r a_r^2 (w the running query energy E[q_r^2] in the plain basis, 1 in the rotated one, a_r
the row's step at `bits`; `refined_rows`), are rounded at bits + 2 on their own grid (step a'_r = range / (2^(b+2) -
1)); the code c = 4 q + e is stored as q in `codes` and e in `refine_codes`, with a_r = 4 a'_r, so
X^[r, c] = ((4 q + e) a_r / 4 + z_r) t_c (`merge_refined`). Query-aware rounding rounds the refined rows on their
finer grid within the same error feedback.

Row widths (keys, `AffineConfig.widths` = m > 0; issue 20): each channel of a tile at 0..4 bits, round(m D) bits a
column in all, the widths that minimise the tile's query-weighted error (`kvarn.ops.widths`: w_r = E[q_r^2] in the plain
basis, 1 in the rotated one), every row on the grid of its own width (`bits` = 4 is the widest); a width-0 row keeps
its mean. Query-aware rounding rounds every row on its own grid.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from kvarn.ops.codes import CODE_DTYPES, DTYPE_CODES, Rotation
from kvarn.ops.dispatch import use_kernel
from kvarn.ops.hadamard import hadamard_dense, hadamard_transform
from kvarn.ops.packing import pack_codes, packed_size, unpack_codes
from kvarn.ops.rtn import check_bits, check_clip, query_aware_bases, query_aware_round, rtn_quantize, rtn_targets
from kvarn.ops.seats import Seat, supported
from kvarn.ops.varn import DEFAULT_ITERS, varn
from kvarn.ops.widths import MAX_WIDTH, pack_rows, pack_widths, unpack_rows, unpack_widths, width_targets
from kvarn.quant.base import TileQuantizer, check_tiles
from kvarn.quant.policy import DEFAULT_POLICY, RotationPolicy, get_policy, kernel_weighted
from kvarn.quant.tiles import REFINE_BITS, AffineFormat, AffineTiles

STORE_SEAT = Seat("tile_store")  # the op seat (kvarn.ops.seats); the C++ kernel serves CPU tiles
DECODE_SEAT = Seat("tile_decode")  # its inverse
COEF_SEAT = Seat("query_aware_coefficients")
Axis = Literal["channel", "token"]
Rotate = Literal["none", "hadamard", "auto"]


def zero_dtype(scale_dtype: torch.dtype) -> torch.dtype:
    """The zero point keeps 16 bits when the scales are 8-bit floats (the paper's fp8 accounting):
    it is an offset of the size of the values themselves, which e4m3's 3 mantissa bits cannot carry."""
    return torch.float16 if scale_dtype.itemsize == 1 else scale_dtype


def store_scale(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast a scale vector to its storage dtype. fp16 overflows to inf, but 8-bit floats (e4m3fn has no
    inf) saturate silently on the cast, so out-of-range values become NaN first: either way the tile is
    reported by `Tiles.finite_tiles` and the cache keeps it exact."""
    if dtype.itemsize == 1 and dtype.is_floating_point:
        v = torch.where(v.abs() <= torch.finfo(dtype).max, v, torch.full_like(v, float("nan")))
    return v.to(dtype)


def relative_col_scales(x: torch.Tensor, s_col: torch.Tensor, s_row: torch.Tensor,
                        dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """8-bit VarN column scales without their range and rounding problems, for X [..., R, C]:

        m = max_c s_col,   t = round_dtype(max(s_col / m, tiny))  in (0, 1]    (stored in `dtype`)
        s_row' = s_row * m                                                     (folded into a, z: 16-bit)
        B = X / t[cols] / s_row'[rows]                                         (recomputed with the stored t)

    The reconstruction (q a + z) t then uses exactly the scales that normalized B, so rounding t to 3 mantissa
    bits only changes how well B is balanced, never the magnitude of a token. Returns (B, t as float, s_row')."""
    m = s_col.amax(-1, keepdim=True)  # [..., 1]
    t = (s_col / m).clamp_min(torch.finfo(dtype).tiny).to(dtype).float()
    s_row = s_row * m
    return x / t.unsqueeze(-2) / s_row.unsqueeze(-1), t, s_row


def merge_refined(q: torch.Tensor, a: torch.Tensor, p: AffineTiles) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpacked codes q [..., R, C] and row scales a [..., R] (floating) of tiles p with their refined rows' low bits
    merged: q_r <- 2^REFINE_BITS q_r + e_r, a_r <- a_r / 2^REFINE_BITS (exact: a power of two). Unchanged without
    refined rows."""
    if p.refine_rows is None:
        return q, a
    idx = p.refine_rows.long()  # [..., k]
    e = unpack_codes(p.refine_codes, REFINE_BITS).to(q.dtype)  # [..., k, C]
    rows = idx.unsqueeze(-1).expand_as(e)
    scale = 1 << REFINE_BITS
    return (q.scatter(-2, rows, q.gather(-2, rows) * scale + e),
            a.scatter(-1, idx, a.gather(-1, idx) / scale))


def row_codes(p: AffineTiles, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes q [..., R, C] and row steps a [..., R] of tiles p in `dtype`, whatever the codes' layout: one width,
    refined rows merged (`merge_refined`) or rows at their own widths (`kvarn.ops.widths.unpack_rows`)."""
    f = p.fmt
    if f.widths:
        return unpack_rows(p.codes, unpack_widths(p.row_widths), f.cols, dtype), p.row_scale.to(dtype)
    return merge_refined(unpack_codes(p.codes, f.bits, dtype=dtype), p.row_scale.to(dtype), p)


def refined_rows(step: torch.Tensor, weight: torch.Tensor | None, k: int) -> torch.Tensor:
    """The k rows [N, k] (ascending) of each tile to refine: the largest w_r a_r^2 (a [N, R] the rows' steps, w [N, R]
    the query energy in the rows' basis, None: 1), ties to the lower row; non-finite scores count as 0."""
    score = step.float().square() if weight is None else step.float().square() * weight.float()
    order = torch.sort(torch.nan_to_num(score, nan=0.0, posinf=0.0, neginf=0.0), dim=-1, descending=True,
                       stable=True).indices
    return order[:, :k].sort(dim=-1).values


def decode_rows(p: AffineTiles, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """X^[r, c] = (q[r, c] a_r + z_r) t_c in float32 (or `dtype`), rows x cols of each tile (module docstring)."""
    q, a = row_codes(p, dtype)
    x = q * a.unsqueeze(-1) + p.row_zero.to(dtype).unsqueeze(-1)
    col = p.col_scale
    return x * col.to(dtype).unsqueeze(-2) if col is not None else x


def decode_tiles(p: AffineTiles, dtype: torch.dtype = torch.float32, dense: bool = False) -> torch.Tensor:
    """Token-major tiles [N, G, D] from their fields and format alone (`AffineQuantizer.decode`): `decode_rows`,
    transposed back for axis "channel", then @ H where the tile is rotated. The default is the reference: the
    butterfly, in float32. dense=True is the fast path for many tiles: the tile decode seat's kernel where one serves
    them (`decode_kernel`: the reference, bit for bit, in one pass), else a multiplication by the dense H
    (`hadamard_dense`, one matmul: the same product in another order), only the rotated tiles, in float64 when
    `dtype` is."""
    if dense and dtype != torch.float64 and (x := decode_kernel(p, dtype)) is not None:
        return x
    x = decode_rows(p, torch.float64 if dense and dtype == torch.float64 else torch.float32)
    x = x.transpose(-1, -2) if p.fmt.axis == "channel" else x
    if dense:
        h = hadamard_dense(x.shape[-1], x.dtype, x.device)
        if p.fmt.rotate == "hadamard":
            x = x @ h
        elif p.fmt.rotate == "auto" and p.rotated.bool().any():
            rot = p.rotated.bool().view(-1)
            x = x.contiguous()
            x[rot] = x[rot] @ h
    elif p.fmt.rotate == "hadamard":
        x = hadamard_transform(x)
    elif p.fmt.rotate == "auto":
        rot = p.rotated.bool()
        if rot.any():
            x = torch.where(rot.view(-1, 1, 1), hadamard_transform(x), x)
    return x.to(dtype)


def decode_kernel(p: AffineTiles, dtype: torch.dtype) -> torch.Tensor | None:
    """`decode_tiles(p, dtype)` of tiles p [...] through the tile decode seat (`torch.ops.kvarn.tile_decode`) where a
    kernel registered for the fields' device serves them (`kvarn.ops.dispatch`, KVARN_KERNEL; the C++ kernel equals
    the reference bit for bit): [..., G, D]; None where none does (and for float64, the dense path's own precision)."""
    f = p.fmt
    if dtype not in (torch.float32, torch.bfloat16, torch.float16) or not use_kernel(
            lambda: supported("tile_decode", p.codes.device, p), f"the tile decode kernel cannot decode {f}"):
        return None
    r, c = f.rows, f.cols
    empty = p.codes.new_empty(0)
    x = DECODE_SEAT(p.codes.reshape(-1, r, packed_size(c, f.bits)).contiguous(),
                    p.row_scale.reshape(-1, r).contiguous(), p.row_zero.reshape(-1, r).contiguous(),
                    empty if p.col_scale is None else p.col_scale.reshape(-1, c).contiguous(),
                    empty if p.rotated is None else p.rotated.reshape(-1).contiguous(), f.bits, f.axis == "channel",
                    f.rotation, f.tile, DTYPE_CODES[dtype])
    return x.view(*p.codes.shape[:-2], f.tile, f.head_dim)


def tile_decode_reference(codes: torch.Tensor, row_scale: torch.Tensor, row_zero: torch.Tensor,
                          col_scale: torch.Tensor, rotated: torch.Tensor, bits: int, channel: bool, rotate: int,
                          tile: int, out_dtype: int) -> torch.Tensor:
    """The default of the tile decode seat: `decode_tiles` (the reference) of the tiles these fields describe."""
    d = codes.shape[1] if channel else codes.shape[2] * 8 // bits
    fmt = AffineFormat(bits, "channel" if channel else "token", Rotation(rotate).name.lower(), tile, d,
                       row_scale.dtype, row_zero.dtype, col_scale.dtype if col_scale.numel() else None)
    p = AffineTiles(codes, row_scale, row_zero, col_scale if col_scale.numel() else None,
                    rotated if rotate == Rotation.AUTO else None, fmt=fmt)
    return decode_tiles(p, CODE_DTYPES[out_dtype])


torch.library.impl("kvarn::tile_decode", "CompositeExplicitAutograd", tile_decode_reference)


@dataclass(frozen=True)
class AffineConfig:
    bits: int = 2
    axis: Axis = "channel"
    rotate: Rotate = "hadamard"
    varn: bool = True
    varn_iters: int = DEFAULT_ITERS
    tile: int = 128
    scale_dtype: torch.dtype = torch.float16
    col_scale_dtype: torch.dtype | None = None  # VarN column scales; None: scale_dtype (see relative_col_scales)
    refine: float = 0.0  # keys: the share of a tile's channels at bits + 2 (floor(refine * D) rows; module docstring)
    clip: float = 1.0  # the share of each row's range its grid spans (`kvarn.ops.rtn`); encode only, same fields
    widths: float = 0.0  # keys: the mean bits of a tile's channels at 0..bits each (module docstring); 0: one width


class AffineQuantizer(TileQuantizer):
    """RTN per row with optional rotation and VarN; `axis` picks the rows (keys: channel, values: token)."""

    tiles_type = AffineTiles

    def __init__(self, config: AffineConfig, policy: str | RotationPolicy = DEFAULT_POLICY) -> None:
        check_bits(config.bits)
        if config.axis not in ("channel", "token"):
            raise ValueError(f"axis must be 'channel' or 'token', got {config.axis!r}")
        if config.rotate not in ("none", "hadamard", "auto"):
            raise ValueError(f"rotate must be 'none', 'hadamard' or 'auto', got {config.rotate!r}")
        if not 0.0 <= config.refine < 1.0 or (config.refine and config.axis != "channel"):
            raise ValueError(f"refine is a share in [0, 1) of a key tile's channels (axis 'channel'), got "
                             f"{config.refine!r} on axis {config.axis!r}")
        if config.refine:
            check_bits(config.bits + REFINE_BITS)  # the refined rows' width must be one the packing supports
        if config.widths and (config.axis != "channel" or config.bits != MAX_WIDTH or config.refine
                              or not config.varn or not 0 < config.widths <= MAX_WIDTH):
            raise ValueError(f"row widths are a key tile's mean channel bits in (0, {MAX_WIDTH}] with bits="
                             f"{MAX_WIDTH} (the widest row), axis 'channel', VarN and no refined rows; got widths "
                             f"{config.widths!r}, bits {config.bits}, axis {config.axis!r}, varn {config.varn}, "
                             f"refine {config.refine!r}")
        check_clip(config.clip)
        self.config = config
        self.tile = config.tile
        self.policy = get_policy(policy)  # rotate="auto" only: kvarn.quant.policy
        parts = ["rot" if config.rotate == "hadamard" else config.rotate if config.rotate == "auto" else "",
                 "varn" if config.varn else "", f"rtn{config.bits}",
                 f"r{config.refine:g}" if config.refine else "", f"w{config.widths:g}" if config.widths else "",
                 f"clip{config.clip:g}" if config.clip < 1 else "",
                 config.axis]
        self.name = "-".join(p for p in parts if p)
        self._formats: dict[int, AffineFormat] = {}

    def format(self, head_dim: int) -> AffineFormat:
        """The packed layout of this quantizer's tiles of head_dim D (`kvarn.quant.tiles.AffineFormat`)."""
        f = self._formats.get(head_dim)
        if f is None:
            c = self.config
            f = self._formats[head_dim] = AffineFormat(
                c.bits, c.axis, c.rotate, c.tile, head_dim, c.scale_dtype, zero_dtype(c.scale_dtype),
                (c.col_scale_dtype or c.scale_dtype) if c.varn else None, self.refine_count(head_dim),
                round(c.widths * head_dim))
        return f

    def refine_count(self, head_dim: int) -> int:
        """Refined channels per tile at head_dim D: floor(refine * D)."""
        return int(self.config.refine * head_dim + 1e-9)

    def template(self, head_dim: int) -> AffineTiles:
        return AffineTiles.template_of(self.format(head_dim))

    def bits_per_element(self, head_dim: int) -> float:
        """Stored bits per element of one tile, from the computed layout (no encode: equal to the measured
        `TileQuantizer.bits_per_element`, which tests check)."""
        return self.format(head_dim).nbytes * 8 / (self.tile * head_dim)

    # layout helpers: token-major [N, G, D] <-> rows x cols
    def _to_rows(self, w: torch.Tensor) -> torch.Tensor:
        return w.transpose(-1, -2) if self.config.axis == "channel" else w

    def _from_rows(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(-1, -2) if self.config.axis == "channel" else x

    def _normalized(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Rows x as RTN quantizes them: (VarN-balanced rows, column scales, row scales), or (x, None, None)."""
        c = self.config
        if not c.varn:
            return x, None, None
        b, s_col, s_row = varn(x, c.varn_iters)
        if self._relative:
            b, s_col, s_row = relative_col_scales(x.float(), s_col, s_row, c.col_scale_dtype)
        return b, s_col, s_row

    @staticmethod
    def _row_steps(delta: torch.Tensor, lo: torch.Tensor,
                   s_row: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """RTN's step and zero [..., 1] of the balanced rows -> those of the rows themselves [...] (VarN folded in)."""
        delta, lo = delta.squeeze(-1), lo.squeeze(-1)
        return (delta, lo) if s_row is None else (delta * s_row, lo * s_row)

    def _tiles(self, q: torch.Tensor, delta: torch.Tensor, lo: torch.Tensor, s_col: torch.Tensor | None,
               fmt: AffineFormat, refined: torch.Tensor | None = None) -> AffineTiles:
        """The stored fields; refined [N, k]: rows whose codes q hold bits + REFINE_BITS (split into the two planes,
        their row scale delta times 2^REFINE_BITS); with row widths (fmt.widths), refined [N, R] is the widths."""
        c = self.config
        extra = {}
        if fmt.widths:
            return AffineTiles(pack_rows(q, refined, fmt.widths), store_scale(delta, c.scale_dtype),
                               store_scale(lo, zero_dtype(c.scale_dtype)),
                               store_scale(s_col, c.col_scale_dtype or c.scale_dtype) if s_col is not None else None,
                               fmt=fmt, row_widths=pack_widths(refined))
        if refined is not None:
            rows = refined.unsqueeze(-1).expand(-1, -1, q.shape[-1])
            fine = q.gather(1, rows)
            q = q.scatter(1, rows, fine >> REFINE_BITS)
            delta = delta.scatter(1, refined, delta.gather(1, refined) * (1 << REFINE_BITS))
            extra = {"refine_rows": refined.to(torch.uint8),
                     "refine_codes": pack_codes(fine & ((1 << REFINE_BITS) - 1), REFINE_BITS)}
        return AffineTiles(pack_codes(q, c.bits), store_scale(delta, c.scale_dtype),
                           store_scale(lo, zero_dtype(c.scale_dtype)),
                           store_scale(s_col, c.col_scale_dtype or c.scale_dtype) if s_col is not None else None,
                           fmt=fmt, **extra)

    def _targets(self, b: torch.Tensor, s_col: torch.Tensor | None, s_row: torch.Tensor | None, fmt: AffineFormat,
                 weight: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """RTN's unrounded codes u [N, R, C], delta and lo [N, R, 1] of the balanced rows b, the largest code per
        row levels [N, R, 1], and the refined rows [N, k] (None without): those rows on the grid of bits +
        REFINE_BITS; with row widths, each row on the grid of its width and the widths [N, R] last (module
        docstring)."""
        if fmt.widths:  # VarN is on (AffineQuantizer's check)
            u, delta, lo, levels, widths = width_targets(b, s_col, s_row, None if weight is None else weight.float(),
                                                         fmt.widths)
            return u, delta, lo, levels[..., None], widths
        bits, clip = self.config.bits, self.config.clip
        u, delta, lo = rtn_targets(b, bits, clip)
        levels = torch.full_like(delta, (1 << bits) - 1)
        if not fmt.refine:
            return u, delta, lo, levels, None
        step = delta.squeeze(-1) if s_row is None else delta.squeeze(-1) * s_row
        rows = refined_rows(step, weight, fmt.refine)  # [N, k]
        idx = rows.unsqueeze(-1)
        u_f, delta_f, _ = rtn_targets(b.gather(1, idx.expand(-1, -1, b.shape[-1])), bits + REFINE_BITS, clip)
        u = u.scatter(1, idx.expand_as(u_f), u_f)
        delta = delta.scatter(1, idx, delta_f)
        levels = levels.scatter(1, idx, torch.full_like(delta_f, (1 << bits + REFINE_BITS) - 1))
        return u, delta, lo, levels, rows

    def _encode_rows(self, x: torch.Tensor, fmt: AffineFormat, weight: torch.Tensor | None = None) -> AffineTiles:
        """Rows x [N, R, C] encoded; weight [N, R]: the query energy of refined-row selection (None: 1)."""
        b, s_col, s_row = self._normalized(x)
        if not fmt.refine and not fmt.widths:
            q, delta, lo = rtn_quantize(b, self.config.bits, self.config.clip)
            return self._tiles(q, *self._row_steps(delta, lo, s_row), s_col, fmt)
        u, delta, lo, levels, rows = self._targets(b, s_col, s_row, fmt, weight)
        q = torch.minimum(torch.round(u).clamp_(min=0), levels).to(torch.uint8)
        return self._tiles(q, *self._row_steps(delta, lo, s_row), s_col, fmt, rows)

    def _decode_rows(self, p: AffineTiles) -> torch.Tensor:
        return decode_rows(p)

    @property
    def takes_weight(self) -> bool:
        """encode() uses a per-channel weight (running query energy) to choose the rotation."""
        return self.config.rotate == "auto"

    def encode(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> AffineTiles:
        """x [N, G, D] -> AffineTiles. weight [N, D] (rotate="auto" only): per-channel weight of the policy's error,
        the running query energy E[q_d^2] of the tile's KV head (`kvarn.quant.policy`); None = all ones.

        The fused CPU kernel (`kvarn.kernels.cpu.store`) serves what it supports; everything else, and every call
        when KVARN_KERNEL=torch, takes `encode_reference`. KVARN_KERNEL=cpu refuses to fall back (an error says why)."""
        self._check(x, weight, True)
        if self._kernel(x):
            return self.encode_kernel(x, weight)[0]
        return self.encode_reference(x, weight)

    def encode_tiles(self, x: torch.Tensor, weight: torch.Tensor | None = None
                     ) -> tuple[AffineTiles, torch.Tensor, torch.Tensor]:
        """`TileQuantizer.encode_tiles`; the kernel checks finiteness itself (no extra passes over x)."""
        self._check(x, weight, False)
        if self._kernel(x):
            return self.encode_kernel(x, weight)
        return super().encode_tiles(x, weight)

    def encode_kernel(self, x: torch.Tensor, weight: torch.Tensor | None = None
                      ) -> tuple[AffineTiles, torch.Tensor, torch.Tensor]:
        """The tile store seat (`torch.ops.kvarn.tile_store`: the fused kernel registered for x's device) on checked
        tiles x [N, G, D], given tensors and plain parameters only -> (tiles, input_finite, fields_finite) as
        `encode_tiles`. For tests and benches; `encode` takes it where it applies (`_kernel`)."""
        return self._store_seat(x, weight)

    def _store_seat(self, x: torch.Tensor, weight: torch.Tensor | None, coef: torch.Tensor | None = None
                    ) -> tuple[AffineTiles, torch.Tensor, torch.Tensor]:
        """The seat call of `encode_kernel`; coef: query-aware rounding's coefficients (`QueryAwareQuantizer`)."""
        c, fmt = self.config, self.format(x.shape[2])
        # the policy's weight (auto, query); row widths read it as the rows' weights of the plain basis too
        w = weight if (c.rotate == "auto" and kernel_weighted(self.policy)) or fmt.widths else None
        codes, a, z, t, rot, finite_in, finite_out, widths = STORE_SEAT(
            x, w, c.bits, c.axis == "channel", fmt.rotation, c.varn, c.varn_iters,
            DTYPE_CODES[c.scale_dtype], DTYPE_CODES.get(fmt.col_dtype, 0), self._relative, coef, c.clip, fmt.widths)
        return AffineTiles(codes, a, z, t if c.varn else None, rot if c.rotate == "auto" else None,
                           row_widths=widths if fmt.widths else None, fmt=fmt), finite_in, finite_out

    @property
    def _relative(self) -> bool:
        """VarN column scales stored relative to their maximum (`relative_col_scales`)."""
        c = self.config
        return c.varn and c.col_scale_dtype is not None and c.col_scale_dtype.itemsize == 1

    def _check(self, x: torch.Tensor, weight: torch.Tensor | None, finite: bool) -> None:
        check_tiles(x, self.tile, finite=finite)
        if weight is not None and weight.shape != (x.shape[0], x.shape[2]):
            raise ValueError(f"weight must be [N, D] = {(x.shape[0], x.shape[2])}, got {tuple(weight.shape)}")

    def _kernel(self, x: torch.Tensor) -> bool:
        """Whether the fused store kernel encodes x (`kvarn.ops.dispatch`, KVARN_KERNEL: torch never, cpu always or an
        error says why); the kernel registered for x's device names why it cannot (`kvarn.ops.seats.supported`)."""
        c = self.config

        def why() -> str | None:
            if c.refine:
                return "refined channels (refine > 0) have no store kernel yet"
            if c.widths and c.rotate == "auto" and not kernel_weighted(self.policy):
                return "row widths with a rotation policy that does not read the query energy"
            return supported("tile_store", x.device, x, c.bits, c.axis == "channel", c.varn, c.varn_iters,
                             c.scale_dtype, self.format(x.shape[2]).col_dtype,
                             c.rotate != "auto" or kernel_weighted(self.policy) is not None,
                             getattr(self.policy, "__name__", self.policy))

        return use_kernel(why, f"the fused store kernel cannot encode {self.name}")

    def encode_reference(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> AffineTiles:
        """The PyTorch path of `encode` (the oracle of the kernel), for checked tiles x [N, G, D]. Refined rows are
        chosen with the weight in the plain basis, 1 in the rotated one (the rotation spreads the query energy)."""
        return self._encode_bases(x, weight, lambda rows, fmt, rotated: self._encode_rows(
            rows, fmt, None if rotated else weight))

    def _encode_bases(self, x: torch.Tensor, weight: torch.Tensor | None,
                      encode_rows: Callable[[torch.Tensor, AffineFormat, bool], AffineTiles]) -> AffineTiles:
        """`encode_reference` with the rows of each basis encoded by encode_rows(rows, fmt, rotated)."""
        w, fmt = x.float(), self.format(x.shape[2])
        if self.config.rotate == "none":
            return encode_rows(self._to_rows(w), fmt, False)
        rot = encode_rows(self._to_rows(hadamard_transform(w)), fmt, True)
        if self.config.rotate == "hadamard":
            return rot
        plain = encode_rows(self._to_rows(w), fmt, False)
        x_rot = hadamard_transform(self._from_rows(self._decode_rows(rot)))
        x_plain = self._from_rows(self._decode_rows(plain))
        keep = self.policy(w, x_rot, x_plain, weight).to(x.device)
        other = plain.tensors()
        chosen = rot.with_tensors({k: torch.where(keep.view(-1, *[1] * (v.dim() - 1)), v, other[k])
                                   for k, v in rot.items()})
        return dataclasses.replace(chosen, rotated=keep.to(torch.uint8))

    def rotated_mask(self, packed: AffineTiles) -> torch.Tensor | None:
        """[N] bool of rotated tiles, or None when all tiles share the configured rotation."""
        return packed.rotated_mask()

    def decode(self, packed: AffineTiles, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return decode_tiles(packed, dtype)

    def describe(self) -> Mapping[str, object]:
        c = self.config
        return {"name": self.name, "tile": c.tile, "bits": c.bits, "axis": c.axis, "rotate": c.rotate,
                "varn": c.varn, "varn_iters": c.varn_iters, "scale_dtype": str(c.scale_dtype).removeprefix("torch."),
                **({"col_scale_dtype": str(c.col_scale_dtype).removeprefix("torch.")} if c.col_scale_dtype else {}),
                **({"refine": c.refine, "refine_bits": c.bits + REFINE_BITS} if c.refine else {}),
                **({"widths": c.widths} if c.widths else {})}


class QueryAwareQuantizer(AffineQuantizer):
    """Query-aware rounding (issue 20; the `-qar` presets of `kvarn.presets.family`): an `AffineQuantizer` for keys
    (axis "channel") whose codes are rounded per token to minimise the logit error as the queries see it,
    e^T Sigma e, instead of sum_d e_d^2 (`kvarn.ops.rtn.query_aware_round`). Same format, scales and bytes: only
    the codes differ. Sigma = E[q q^T], the running second moment of the queries of the tile's KV head
    (`kvarn.quant.policy.QueryCovariance`), [N, D, D] per tile, in the plain basis; the rotated encoding uses
    H Sigma H (q . k = (q H) . (k H)). With VarN the error of channel d, token g is a_d t_g (q - u): the token factor
    t_g does not move the argmin, the channel steps a_d enter the coefficients (`query_aware_round`).
    A weight [N, D] (query energy alone) or none is a diagonal Sigma: nearest rounding, as `AffineQuantizer`.
    The rotation choice (rotate="auto") keeps the policy's diagonal weight, diag(Sigma).

    The fused CPU store kernel rounds the same way, given the coefficients (`kvarn.kernels.cpu.store`); on CPU the
    coefficients come from the C++ kernel behind the op seat `kvarn::query_aware_coefficients`."""

    takes_covariance = True  # the cache feeds the full [N, D, D] second moment (kvarn.cache.store.LayerStore)

    def __init__(self, config: AffineConfig, policy: str | RotationPolicy = DEFAULT_POLICY,
                 damp: float = 0.01) -> None:
        if config.axis != "channel":
            raise ValueError("query-aware rounding is for keys (axis 'channel')")
        super().__init__(config, policy)
        self.damp = damp
        self.name += "-qar"

    @property
    def takes_weight(self) -> bool:
        return True

    def _check(self, x: torch.Tensor, weight: torch.Tensor | None, finite: bool) -> None:
        check_tiles(x, self.tile, finite=finite)
        n, _, d = x.shape
        if weight is not None and weight.shape not in ((n, d), (n, d, d)):
            raise ValueError(f"weight must be [N, D] = {(n, d)} or [N, D, D], got {tuple(weight.shape)}")

    def coefficients(self, sigma: torch.Tensor) -> torch.Tensor:
        """Sigma [N, D, D] (plain basis) -> the rounding coefficients [N, B, D, D] of each basis the configuration
        encodes (`kvarn.ops.rtn.query_aware_bases`): B = 2 under rotate="auto" (rotated, then plain), else 1. Through
        the op seat where a kernel serves the device (KVARN_KERNEL), else the PyTorch reference."""
        rotate = Rotation.of(self.config.rotate)
        if use_kernel(lambda: supported("query_aware_coefficients", sigma.device),
                      "no kernel computes query-aware coefficients"):
            return COEF_SEAT(sigma, int(rotate), self.damp)
        return query_aware_bases(sigma, rotate, self.damp)

    @staticmethod
    def _split(weight: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """weight -> (the policy's diagonal weight, Sigma or None)."""
        if weight is None or weight.dim() == 2:
            return weight, None
        return weight.diagonal(dim1=-2, dim2=-1), weight

    def encode_kernel(self, x: torch.Tensor, weight: torch.Tensor | None = None
                      ) -> tuple[AffineTiles, torch.Tensor, torch.Tensor]:
        diag, sigma = self._split(weight)
        return self._store_seat(x, diag, None if sigma is None else self.coefficients(sigma.to(x.device)))

    def _encode_rows_qa(self, x: torch.Tensor, fmt: AffineFormat, coef: torch.Tensor,
                        weight: torch.Tensor | None = None) -> AffineTiles:
        """`_encode_rows` with the codes rounded with coefficients coef [N, D, D]; weight: as `_encode_rows`."""
        b, s_col, s_row = self._normalized(x)
        u, delta, lo, levels, rows = self._targets(b, s_col, s_row, fmt, weight)
        delta, lo = self._row_steps(delta, lo, s_row)
        codes = query_aware_round(u, coef, delta, self.config.bits, None if rows is None else levels.squeeze(-1))
        return self._tiles(codes, delta, lo, s_col, fmt, rows)

    def encode_reference(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> AffineTiles:
        """`AffineQuantizer.encode_reference` with query-aware codes where weight is [N, D, D] (class docstring)."""
        diag, sigma = self._split(weight)
        if sigma is None:
            return super().encode_reference(x, diag)
        return self.encode_rounded(x, diag, self.coefficients(sigma.to(x.device)))

    def encode_rounded(self, x: torch.Tensor, diag: torch.Tensor | None, coef: torch.Tensor) -> AffineTiles:
        """The reference given the coefficients [N, B, D, D] (`coefficients`: the rotated basis first) and the
        policy's weight diag [N, D]."""
        plain = 1 if self.config.rotate == "auto" else 0
        return self._encode_bases(x, diag, lambda rows, fmt, rotated: self._encode_rows_qa(
            rows, fmt, coef[:, 0 if rotated else plain], None if rotated else diag))

    def describe(self) -> Mapping[str, object]:
        return {**super().describe(), "rounding": "query-aware", "damp": self.damp}


def tile_store_reference(x: torch.Tensor, weight: torch.Tensor | None, bits: int, channel: bool, rotate: int,
                         varn: bool, varn_iters: int, scale_dtype: int, col_dtype: int, relative: bool,
                         coef: torch.Tensor | None = None, clip: float = 1.0, widths: int = 0
                         ) -> tuple[torch.Tensor, ...]:
    """The default of the tile store seat: `encode_reference` of the quantizer these parameters describe (policy
    query with a weight, mse without), non-finite tiles encoded as zeros (`TileQuantizer.encode_tiles`); absent
    outputs (no VarN: col_scale; rotate != auto: rotated; no row widths: row_widths) are empty tensors of x's dtype,
    as the kernel's."""
    sd, cd = CODE_DTYPES[scale_dtype], CODE_DTYPES[col_dtype]
    cfg = AffineConfig(bits, "channel" if channel else "token", Rotation(rotate).name.lower(), varn, varn_iters,
                       x.shape[1], sd, cd if varn and (relative or cd != sd) else None, clip=clip,
                       widths=widths / x.shape[2])
    policy = "query" if weight is not None else "mse"
    finite = torch.isfinite(x).flatten(1).all(dim=1)
    x = torch.where(finite.view(-1, 1, 1), x, torch.zeros_like(x))
    if coef is None:
        p = AffineQuantizer(cfg, policy).encode_reference(x, weight)
    else:  # query-aware rounding with the caller's coefficients
        p = QueryAwareQuantizer(cfg, policy).encode_rounded(x, weight, coef)
    return (p.codes, p.row_scale, p.row_zero, x.new_empty(0) if p.col_scale is None else p.col_scale,
            x.new_empty(0) if p.rotated is None else p.rotated, finite, p.finite_tiles().to(finite.device),
            x.new_empty(0) if p.row_widths is None else p.row_widths)


torch.library.impl("kvarn::tile_store", "CompositeExplicitAutograd", tile_store_reference)
