"""Byte layout of a kvarn page: what one vLLM block of one layer pays for.

vLLM views each layer's cache as uint8 [num_blocks, H, N = G, C] (layout LBHNC): per block and KV head G*C bytes.
kvarn counts them in two parts:

    G*c0 bytes         the packed tile of this head: key fields then value fields (`TileLayout.fields`; budget presets:
                       value fields first, `budget`), zero padded;
                       under rotate="auto" (kvarn-auto presets) each tile's `rotated` flag (one uint8, the basis it was
                       stored in) is one of those fields, so the page bytes vLLM accounts for hold it
    G*e bytes          a share of the full-precision pool, e = C - c0 bytes per token slot

The shares of k blocks pay for one full-precision block ("fp slot") of a head, K and V [2, G, D] in the model dtype:
k = 2*D*itemsize / e (e divides 2*D*itemsize). The pool thus lives inside the memory vLLM sizes and allocates, so
vLLM's own capacity report counts it: a page costs G*C bytes per head instead of G*2*D*itemsize. Where the bytes sit
in the layer's tensor (every block's packed runs first, then the fp slots) is `pool.page_regions`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvarn.presets import Preset
from kvarn.quant.affine import AffineQuantizer
from kvarn.quant.tiles import AffineFormat, AffineTiles


@dataclass(frozen=True)
class Field:
    kind: str  # "keys" | "values"
    name: str  # codes, row_scale, row_zero, col_scale, rotated
    shape: tuple[int, ...]  # per tile
    dtype: torch.dtype
    offset: int  # bytes into the head's run
    nbytes: int


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


class TileLayout:
    """Where each packed field of a (keys, values) tile pair sits in a head's run of a page: the key tile's
    `AffineFormat.offsets` from 0, then the value tile's from where the keys end (each field aligned to its
    itemsize). Budget presets (key width per layer, `budget`): `key_q` the layer's key quantizer, and the value tile
    first, so its fields sit at the same offsets whatever the key width (values stored before the engine's key
    allocation is decided stay where they are)."""

    def __init__(self, preset: Preset, head_dim: int, fp_dtype: torch.dtype,
                 key_q: AffineQuantizer | None = None) -> None:
        self.preset, self.head_dim, self.fp_dtype = preset, head_dim, fp_dtype
        self.tile = g = preset.tile
        self.key_q, self.value_q = preset.quantizers(head_dim)
        if key_q is not None:
            self.key_q = key_q
        for q in (self.key_q, self.value_q):
            if not isinstance(q, AffineQuantizer):
                raise TypeError(f"kvarn's vLLM pages hold AffineQuantizer tiles, not {type(q).__name__}")
        self.formats: dict[str, AffineFormat] = {"keys": self.key_q.format(head_dim),
                                                 "values": self.value_q.format(head_dim)}
        order = ("values", "keys") if preset.key_high is not None else ("keys", "values")
        fields, at = [], 0
        for kind in order:
            fmt = self.formats[kind]
            for f, offset in fmt.offsets(at):
                fields.append(Field(kind, f.name, f.shape, f.dtype, offset, f.nbytes))
                at = offset + f.nbytes
        self.fields = tuple(fields)
        self.packed_bytes = at  # per head per tile
        self.c0 = _ceil(at, g)  # bytes per token slot for the packed part
        self.fp_bytes = 2 * g * head_dim * fp_dtype.itemsize  # one fp block of one head, K and V

    def share_choices(self) -> list[int]:
        """Possible e (bytes per token slot of fp share), smallest first: divisors of 2*D*itemsize whose block share
        (G*e bytes per head) holds whole fp rows. (When each block held its share of the pool, a share that split rows
        across blocks sent every decode row down the per-request path: docs/VLLM.md. Since the fp slots form one
        region, `pool.page_regions`, the rule only keeps the choices as they were.)"""
        m, row = 2 * self.head_dim * self.fp_dtype.itemsize, self.head_dim * self.fp_dtype.itemsize
        return [e for e in range(1, m + 1) if m % e == 0 and self.tile * e % row == 0]

    def blocks_per_slot(self, e: int) -> int:
        return 2 * self.head_dim * self.fp_dtype.itemsize // e

    def bf16_page_per_head(self) -> int:
        """What stock vLLM stores per head per block at 16 bits, for capacity ratios."""
        return self.tile * 2 * self.head_dim * 2

    def views(self, runs: torch.Tensor) -> tuple[AffineTiles, AffineTiles]:
        """runs uint8 [num_blocks, H, >= packed_bytes] -> (keys, values): each field a zero-copy strided view
        [num_blocks, H, *shape] in its dtype: field f of block b, head h at base + b*stride(0) + h*stride(1), the
        block-table addressing of the shared kernel design."""
        out: dict[str, dict[str, torch.Tensor]] = {"keys": {}, "values": {}}
        for f in self.fields:
            raw = runs[:, :, f.offset:f.offset + f.nbytes].view(f.dtype)
            # a per-tile scalar (rotate="auto"'s `rotated` flag, shape ()) is one element: [num_blocks, H]
            out[f.kind][f.name] = raw.unflatten(-1, f.shape) if f.shape else raw.squeeze(-1)
        return tuple(AffineTiles.template_of(self.formats[k]).with_tensors(out[k]) for k in ("keys", "values"))


@dataclass(frozen=True)
class PageGeometry:
    """One layer's page: C bytes per token slot per head, of which e belong to the fp pool; the packed part c0 is the
    layout's, or more (`packed`: a budget preset's page class, whose tiles may be narrower than it holds)."""

    layout: TileLayout
    num_kv_heads: int
    e: int
    packed: int | None = None  # packed bytes per token slot, >= layout.c0 (None: layout.c0)

    def __post_init__(self) -> None:
        if self.e not in self.layout.share_choices():
            raise ValueError(f"kvarn: an fp share of {self.e} bytes per token slot is not one of "
                             f"{self.layout.share_choices()} (divisors of an fp block's bytes that hold whole rows)")
        if self.packed is not None and self.packed < self.layout.c0:
            raise ValueError(f"kvarn: a page class of {self.packed} packed bytes per token slot cannot hold tiles "
                             f"of {self.layout.c0}")

    @property
    def c0(self) -> int:
        return self.layout.c0 if self.packed is None else self.packed

    @property
    def c(self) -> int:
        return self.c0 + self.e

    @property
    def page_bytes(self) -> int:
        return self.num_kv_heads * self.layout.tile * self.c

    @property
    def blocks_per_slot(self) -> int:
        return self.layout.blocks_per_slot(self.e)

    def fp_slots(self, num_blocks: int) -> int:
        return num_blocks // self.blocks_per_slot

    def tokens_ratio_vs_bf16(self) -> float:
        return self.layout.bf16_page_per_head() / (self.layout.tile * self.c)


def choose_geometry(layout: TileLayout, num_kv_heads: int, num_layers: int, budget: int, slots: int,
                    other_bytes: int = 0) -> PageGeometry:
    """The smallest fp share that still gives every layer `slots` fp blocks within `budget` bytes of KV cache.

    vLLM then makes num_blocks = budget // (num_layers * page_bytes + other_bytes) blocks (kv_cache_utils; other_bytes:
    what a block costs in the layers kvarn does not pack, e.g. sliding-window layers kept in the model dtype); each
    layer's shares form num_blocks // blocks_per_slot fp slots."""
    for e in layout.share_choices():
        geo = PageGeometry(layout, num_kv_heads, e)
        num_blocks = num_blocks_in(geo, num_layers, budget, other_bytes)
        if geo.fp_slots(num_blocks) >= slots:
            return geo
    raise ValueError(f"kvarn: {slots} full-precision blocks per layer (the running sequences' sinks and blocks "
                     f"being filled) do not fit in a KV cache of {budget / 2**30:.2f} GiB; lower "
                     "max_num_seqs, or raise the KV budget (VLLM_CPU_KVCACHE_SPACE / kv_cache_memory_bytes), or set "
                     "additional_config kvarn.fp_slots")


FP_SHARE_MAX = 0.5  # the most of each page (so of the KV budget) the fp pool takes when it must lower concurrency


def num_blocks_in(geo: PageGeometry, num_layers: int, budget: int, other_bytes: int = 0) -> int:
    """vLLM's block count for a budget: every block costs a page in each of the num_layers kvarn layers plus
    other_bytes in the others."""
    return budget // (num_layers * geo.page_bytes + other_bytes)


def choose_pool(layout: TileLayout, num_kv_heads: int, num_layers: int, budget: int, max_num_seqs: int,
                slots_for: Callable[[int], int], other_bytes: int = 0) -> tuple[PageGeometry, int]:
    """(geometry, sequences) for a pool sized from the KV budget. `slots_for(n)`: fp blocks per layer that n running
    sequences need.

    The smallest fp share that holds `slots_for(max_num_seqs)` blocks (`choose_geometry`), if it takes at most
    FP_SHARE_MAX of a page; else the pool keeps to FP_SHARE_MAX, the sequences are lowered to the most whose blocks
    its largest share within that holds, and the share is again the smallest that holds those (so a second call with
    the lowered count returns the same geometry). ValueError if not even one sequence fits."""
    within = [e for e in layout.share_choices() if e <= FP_SHARE_MAX * (layout.c0 + e)]
    for e in within:
        geo = PageGeometry(layout, num_kv_heads, e)
        if geo.fp_slots(num_blocks_in(geo, num_layers, budget, other_bytes)) >= slots_for(max_num_seqs):
            return geo, max_num_seqs
    top = PageGeometry(layout, num_kv_heads, within[-1]) if within else None
    have = top.fp_slots(num_blocks_in(top, num_layers, budget, other_bytes)) if top is not None else 0
    seqs = max_num_seqs
    while seqs > 0 and slots_for(seqs) > have:
        seqs -= 1
    if seqs == 0:
        raise ValueError(f"kvarn: a KV cache of {budget / 2**30:.3f} GiB cannot hold the full-precision blocks of even "
                         f"one sequence ({slots_for(1)} per layer: sink blocks and the blocks being filled) within "
                         f"{FP_SHARE_MAX:.0%} of it; raise the KV budget (VLLM_CPU_KVCACHE_SPACE / "
                         "kv_cache_memory_bytes) or lower the sink")
    return choose_geometry(layout, num_kv_heads, num_layers, budget, slots_for(seqs), other_bytes), seqs
