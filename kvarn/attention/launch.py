"""The typed launch wrapper of the packed-decode op seat (`kvarn::packed_decode`, kvarn.ops.seats): fields, strides
and block table of AffineTiles handed to whichever kernel serves the device (CPU: kernels/cpu/decode.cpp).

For each batch row b and KV head h, the M = groups * L query rows (query head h*groups + j at position l is row
j*L + l, scaled by `scaling`) attend to, in one softmax,

    dense segments (sink, tail, fresh tokens: float rows [B, Hkv, t, D])   plain basis
    packed tiles j < n_blocks[b], block = block_table[b, j]                 each tile in its own basis

with logits and outputs computed straight from the codes (shared design, see kvarn/attention/packed.py):
    keys per channel  (codes [D, G]):  logit_g = t_g (sum_d (q~_d a_d) code[d, g] + sum_d q~_d z_d)
    values per token  (codes [G, D]):  o~_d   += c_d (sum_g (p_g a_g) code[g, d] + sum_g p_g z_g)
q~ = q H for key tiles stored rotated, and the value accumulator of tiles stored rotated is kept apart and multiplied by
H once at the end: out = acc_plain / l + (acc_rot / l) H. Softmax is online (running max, sum, accumulators), split
over the context into `splits` parts per (b, h) for parallelism; the parts are combined exactly in the kernel.
Everything accumulates in float32: a logit is a sum of D products of float32-rounded terms, an output a sum over T
keys, so errors are those of float32 dot products (order eps32 * sum |terms|), like the PyTorch path.

Tiles kept exact (non-finite input; their packed fields are zeros) are read from `exact` instead: (map [B, Hkv,
max_blocks] int32, index into keys/values [n, G, D] float32 or -1). Masks: `bias` float32 [B or 1, 1 or Hq, L, T]
(T = all positions; -inf = masked, else added to the logit after the soft cap), None = everything allowed.

Fields are read through a block table: field address (b, h, j) = base + block_table[b, j] * stride_block +
h * stride_head + b * stride_batch (`PackedTiles.cache` for the [B, H, n, ...] fields of the transformers cache,
`PackedTiles.pool` for a paged pool [num_blocks, H, ...] shared by all rows).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from kvarn.ops.hadamard import hadamard_dense
from kvarn.ops.packing import packed_size
from kvarn.ops.seats import Seat, supported
from kvarn.ops.widths import WIDTH_BITS
from kvarn.quant.tiles import AffineTiles

KERNEL_BITS = (1, 2, 3, 4, 8)
SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn)
DENSE_DTYPES = (torch.float16, torch.bfloat16)  # dense rows read in these dtypes as they are (others: float32)
MIN_TILES_PER_SPLIT = 8
SEAT = Seat("packed_decode")  # the op seat (kvarn.ops.seats); kernels register behind it

_EMPTY = torch.empty(0)
_EMPTY_LONG = torch.empty(0, dtype=torch.long)
_EMPTY_INT = torch.empty(0, dtype=torch.int32)


@dataclass(frozen=True)
class PackedTiles:
    """The packed tiles of one tensor kind (keys per channel or values per token) and how to address them.

    tiles: `AffineTiles` with fields codes [.., R, C*bits/8] uint8, row_scale [.., R], row_zero [.., R], col_scale
    [.., C] (VarN only), rotated [..] uint8 (rotate="auto" only), and for key rows at their own widths codes
    [.., W*C/8] with row_widths [.., 3R/8] uint8 (`kvarn.ops.widths`); strides[i] = (batch, head, block) strides in
    elements of the i-th field (absent fields: zeros)."""

    tiles: AffineTiles
    strides: tuple[tuple[int, int, int], ...]
    capacity: int = 0  # blocks addressable (block_table entries must be below it)

    @property
    def bits(self) -> int:
        return self.tiles.fmt.bits

    @property
    def rotate(self) -> str:
        return self.tiles.fmt.rotate

    @classmethod
    def cache(cls, tiles: AffineTiles) -> PackedTiles:
        """Fields [B, H, n, ...] (block_table[b, j] = j)."""
        return cls(tiles, _strides(tiles, lambda st: st[:3]), tiles.codes.shape[2])

    @classmethod
    def pool(cls, tiles: AffineTiles) -> PackedTiles:
        """Fields [num_blocks, H, ...] shared by every batch row (stride_batch = 0)."""
        return cls(tiles, _strides(tiles, lambda st: (0, st[1], st[0])), tiles.codes.shape[0])

    def check(self, what: str, rows: int, cols: int) -> None:
        if self.bits not in KERNEL_BITS:
            raise ValueError(f"{what}: {self.bits}-bit codes are not supported by the fused kernel ({KERNEL_BITS})")
        present = set(self.tiles.names())
        need = ["codes", "row_scale", "row_zero"] + (["rotated"] if self.rotate == "auto" else [])
        for name in need:
            if name not in present:
                raise ValueError(f"{what}: missing packed field {name!r}")
        widths = self.tiles.fmt.widths
        inner = {"codes": (widths * cols // 8,) if widths else (rows, cols * self.bits // 8), "row_scale": (rows,),
                 "row_zero": (rows,), "col_scale": (cols,), "rotated": (),
                 "row_widths": (packed_size(rows, WIDTH_BITS),)}
        for name, t in self.tiles.items():
            shape = inner[name]
            k = len(shape)
            if k and (tuple(t.shape[-k:]) != shape or tuple(t.stride()[-k:]) != _contiguous_strides(shape)):
                raise ValueError(f"{what}: field {name} must end in {shape}, contiguous within a tile; got shape "
                                 f"{tuple(t.shape)}, strides {t.stride()}")
            if (t.dtype == torch.uint8) != (name in ("codes", "rotated", "row_widths")) or t.dtype not in (torch.uint8,
                                                                                           *SCALE_DTYPES):
                raise ValueError(f"{what}: field {name} has dtype {t.dtype} (codes and flags: uint8; scales: "
                                 f"{SCALE_DTYPES})")

    @cached_property
    def seat_args(self) -> tuple[list[torch.Tensor], list[int], int, int]:
        """The seat's arguments for these fields: tensors, strides, bits, rotation code (once per object: a page
        pool keeps its own, `LayerPool.tiles`)."""
        tensors = [_EMPTY if v is None else v for v in _seat_fields(self.tiles)]
        return tensors, [s for st in self.strides for s in st], self.bits, self.tiles.fmt.rotation


def _seat_fields(tiles: AffineTiles) -> tuple[torch.Tensor | None, ...]:
    """The seat's fields in its order: codes, row scale, row zero, col scale, rotated[, row widths]."""
    fields = (tiles.codes, tiles.row_scale, tiles.row_zero, tiles.col_scale, tiles.rotated)
    return (*fields, tiles.row_widths) if tiles.row_widths is not None else fields


def _strides(tiles: AffineTiles, of) -> tuple[tuple[int, int, int], ...]:
    return tuple((0, 0, 0) if v is None else of(v.stride()) for v in _seat_fields(tiles))


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (shape[1], 1) if len(shape) == 2 else (1,)


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 else t.to(torch.int32)


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


def check_table(block_table: torch.Tensor, n_blocks: torch.Tensor, capacity: int) -> None:
    """Every block the kernel will read exists: n_blocks[b] <= max_blocks and block_table[b, :n_blocks[b]] in
    [0, capacity) (the kernel does not bounds-check its reads)."""
    if block_table.dim() != 2 or n_blocks.dim() != 1 or n_blocks.shape[0] != block_table.shape[0]:
        return  # reported with the shapes below
    if n_blocks.numel() and (int(n_blocks.min()) < 0 or int(n_blocks.max()) > block_table.shape[1]):
        raise ValueError(f"n_blocks must be in [0, {block_table.shape[1]}], got {n_blocks.tolist()}")
    used = torch.arange(block_table.shape[1]).unsqueeze(0) < n_blocks.unsqueeze(1)
    ids = block_table[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= capacity):
        raise ValueError(f"block_table holds blocks outside [0, {capacity}): {int(ids.min())}..{int(ids.max())}")


def check_paged(rows: torch.Tensor, index: torch.Tensor, position: int, batch: int) -> None:
    """Indexed rows the kernel can read (it does not bounds-check them): rows [N, H, R, D] with unit stride on D,
    index [batch, 2, t] int64 contiguous with every id in [0, N * R)."""
    if rows.dim() != 4 or rows.stride(-1) != 1 or rows.dtype not in (torch.float32, *DENSE_DTYPES):
        raise ValueError(f"paged rows must be [N, H, R, D] float32/float16/bfloat16 with unit stride on D, got "
                         f"{tuple(rows.shape)} {rows.dtype} strides {rows.stride()}")
    if index.dtype != torch.int64 or index.dim() != 3 or index.shape[:2] != (batch, 2) or not index.is_contiguous():
        raise ValueError(f"paged index must be contiguous int64 [B={batch}, 2, t], got {tuple(index.shape)} "
                         f"{index.dtype}")
    n = rows.shape[0] * rows.shape[2]
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= n):
        raise ValueError(f"paged index holds rows outside [0, {n}): {int(index.min())}..{int(index.max())}")


def available(device: str = "cpu") -> bool:
    """Whether a kernel serves the packed-decode seat on `device` (CPU: builds the extension on first call)."""
    return supported("packed_decode", torch.device(device)) is None


def auto_splits(batch: int, heads: int, max_blocks: int) -> int:
    """Context splits per (row, head): enough work items for 4 per thread, each of at least 8 tiles."""
    want = math.ceil(4 * torch.get_num_threads() / max(1, batch * heads))
    return max(1, min(want, math.ceil(max_blocks / MIN_TILES_PER_SPLIT)))


def decode_partial(qs: torch.Tensor, qh: torch.Tensor | None, keys: PackedTiles, values: PackedTiles,
                   block_table: torch.Tensor, n_blocks: torch.Tensor, tile: int, length: int = 1,
                   dense: Sequence[tuple[torch.Tensor, torch.Tensor, int]] = (), tiles_pos: int = 0,
                   bias: torch.Tensor | None = None, softcap: float | None = None,
                   exact: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                   splits: int | None = None, hadamard: torch.Tensor | None = None, scale: float = 1.0,
                   validate: bool = True, paged: tuple[torch.Tensor, torch.Tensor, int] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The kernel itself: qs (plain) and qh = qs H, float32 [B, Hkv, M, D] (row j*L + l = query head h*groups + j at
    position l), multiplied by `scale` in the kernel; dense = (k, v, position) [B, Hkv, t, D] (float32; fp16 / bf16
    rows are read as they are). Returns the value outputs of the plain and of the rotated basis, float32
    [B, Hkv, M, D] each, already divided by the softmax sum. With `hadamard` (H float32 [D, D]) the kernel computes
    q~ = q H itself (qh unused) and returns (plain + rotated H, None): the rotation back, once per row.
    paged = (rows [N, Hkv, R, D], index [B, 2, t] int64, position): rows read in place through row ids n * R + r
    (keys, values), after the dense segments (`kvarn.ops.decode`). validate=False skips the field, table and index
    checks (callers that pass a store's own fields and checked their tables)."""
    if qs.device.type == "cpu" and (why := supported("packed_decode", qs.device)) is not None:
        raise RuntimeError(f"the fused CPU decode kernel is unavailable ({why})")
    b, h, _, d = qs.shape
    if keys.rotate != "none" and qh is None and hadamard is None:
        raise ValueError("keys stored rotated need the rotated queries qh or the matrix `hadamard`")
    if validate:
        keys.check("keys", d, tile)
        values.check("values", tile, d)
        check_table(block_table, n_blocks, min(keys.capacity, values.capacity))
        if paged is not None:
            check_paged(*paged, b)
    if block_table.dim() != 2 or block_table.shape[0] != b or n_blocks.shape != (b,):
        raise ValueError(f"block_table must be [B={b}, max_blocks] and n_blocks [B], got "
                         f"{tuple(block_table.shape)} and {tuple(n_blocks.shape)}")
    qs = _f32(qs).contiguous()
    qh = qs if qh is None else _f32(qh).contiguous()
    em, ek, ev = exact if exact is not None else (_EMPTY_INT, _EMPTY, _EMPTY)
    keep = [DENSE_DTYPES if k.dtype == v.dtype else () for k, v, _ in dense]  # 16-bit rows as they are, in pairs
    dk = [_rows(k, kp) for (k, _, _), kp in zip(dense, keep)]
    dv = [_rows(v, kp) for (_, v, _), kp in zip(dense, keep)]
    if bias is not None:
        bias = _rows(bias).expand(b, *bias.shape[1:])
    s = splits or auto_splits(b, h, block_table.shape[1])
    h_arg = _EMPTY if hadamard is None else _f32(hadamard).contiguous()
    out_p, out_r = _launch(qs, qh, h_arg, scale, keys, values, _int32(block_table), _int32(n_blocks), tile,
                           (_int32(em).contiguous(), _f32(ek).contiguous(), _f32(ev).contiguous()), dk, dv,
                           [p for _, _, p in dense], tiles_pos, _EMPTY if bias is None else bias, length, softcap, s,
                           paged or (_EMPTY, _EMPTY_LONG, 0))
    return out_p, (out_r if out_r.numel() else None)


def _launch(qs: torch.Tensor, qh: torch.Tensor, hadamard: torch.Tensor, scale: float, keys: PackedTiles,
            values: PackedTiles, block_table: torch.Tensor, n_blocks: torch.Tensor, tile: int,
            exact: tuple[torch.Tensor, torch.Tensor, torch.Tensor], dense_k: list[torch.Tensor],
            dense_v: list[torch.Tensor], dense_pos: list[int], tiles_pos: int, bias: torch.Tensor, length: int,
            softcap: float | None, splits: int, paged: tuple[torch.Tensor, torch.Tensor, int]
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The seat call, every argument in the kernel's types already (the one place that orders them)."""
    return SEAT(qs, qh, hadamard, float(scale), *keys.seat_args, *values.seat_args, block_table, n_blocks, tile,
                *exact, dense_k, dense_v, dense_pos, tiles_pos, bias, length, float(softcap or 0.0), splits, *paged)


def decode_rows(q: torch.Tensor, keys: PackedTiles, values: PackedTiles, block_table: torch.Tensor,
                n_blocks: torch.Tensor, tile: int, paged: tuple[torch.Tensor, torch.Tensor, int], bias: torch.Tensor,
                scale: float, softcap: float | None = None) -> torch.Tensor:
    """`decode_attention` of one position per row as a serving step holds it: q float32 [B, Hkv, groups, D]
    contiguous (row j = query head h*groups + j), the tables int32, the indexed rows and their bias float32
    [B, 1, 1, T] built and checked once per step (`kvarn.integrations.vllm.paged.DecodeBatch`); nothing is
    converted or checked per call, since every torch call costs microseconds in each layer of each step ->
    float32 [B, Hkv, groups, D]."""
    rotated = keys.rotate != "none" or values.rotate != "none"
    h = hadamard_dense(q.shape[-1], device=q.device) if rotated else _EMPTY
    out, _ = _launch(q, q, h, scale, keys, values, block_table, n_blocks, tile, (_EMPTY_INT, _EMPTY, _EMPTY), [], [],
                     [], 0, bias, 1, softcap, auto_splits(q.shape[0], q.shape[1], block_table.shape[1]), paged)
    return out


def decode_attention(query: torch.Tensor, keys: PackedTiles, values: PackedTiles, block_table: torch.Tensor,
                     n_blocks: torch.Tensor, tile: int, *, scaling: float | None = None,
                     dense: Sequence[tuple[torch.Tensor, torch.Tensor, int]] = (), tiles_pos: int = 0,
                     bias: torch.Tensor | None = None, softcap: float | None = None,
                     exact: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                     splits: int | None = None, validate: bool = True,
                     paged: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> torch.Tensor:
    """softmax(q K^T * scaling [softcapped] + bias) V over packed tiles and dense segments (module docstring).

    query [B, Hq, L, D] (any float dtype; computed in float32) -> float32 [B, Hq, L, D]. Hq must be a multiple of the
    KV heads of the fields; dense (k, v, position): k, v [B, Hkv, t, D] at positions position.. of the bias's T axis;
    paged: rows read through an index (`decode_partial`); tiles_pos: the position of tile 0."""
    b, hq, length, d = query.shape
    hkv = keys.tiles.codes.shape[1]
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads")
    g = hq // hkv
    q = _f32(query).reshape(b, hkv, g * length, d)
    rotated = keys.rotate != "none" or values.rotate != "none"
    out, _ = decode_partial(q, None, keys, values, block_table, n_blocks, tile, length, dense, tiles_pos, bias,
                            softcap, exact, splits, hadamard_dense(d, device=query.device) if rotated else None,
                            d ** -0.5 if scaling is None else scaling, validate, paged)
    return out.reshape(b, hq, length, d)


def _rows(x: torch.Tensor, keep: tuple[torch.dtype, ...] = ()) -> torch.Tensor:
    """Unit stride on the last axis (rows read as plain arrays); float32 unless x's dtype is in `keep`."""
    x = x if x.dtype in keep else _f32(x)
    return x if x.stride(-1) == 1 else x.contiguous()

