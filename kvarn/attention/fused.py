"""The fused fast path of `packed_attention`: a stored past handed to the kernel behind the packed-decode seat (CPU:
kvarn.kernels.cpu; CUDA: the Triton kernel, kvarn.kernels.triton.register).

Taken for decode-like steps (at most `MAX_QUERIES` queries per head) on CPU tensors of float32/bf16/fp16 when both
keys and values are AffineQuantizer tiles of the KVarN orientation (keys per channel, values per token, 1/2/3/4/8-bit
codes, the same tile and region boundaries) with keys stored after RoPE. Everything else, and every step when
KVARN_KERNEL=torch, takes the PyTorch path (the reference). KVARN_KERNEL=cpu refuses to fall back (an error names
the reason), which is what the kernel tests use.

CUDA queries take the Triton kernel for single-token steps with nothing masked (the kernel has no mask or soft cap
yet), 2/4-bit codes, power-of-two head_dim and tile, no tile kept exact (`unsupported_cuda`; a mask that turns out
to allow everything still qualifies: `fused_attention` returns None otherwise and the caller takes PyTorch). Before
this, the transformers cache never reached the Triton kernel on a GPU (found on the first GPU run, 2026-12-04).

The kernel gets the segments in position order: sink (dense) | tiles | tail (dense) | fresh keys (dense), one mask
bias over all positions (None when everything is allowed), and the tiles kept exact as an (b, h, tile) -> row map:
a key tile or a value tile kept exact makes that tile exact for both, the other kind decoded from its fields.
"""

from __future__ import annotations

import torch

from kvarn.attention import launch as kernel
from kvarn.attention.view import StoredKV
from kvarn.ops.dispatch import mode, use_kernel  # noqa: F401 (mode: also read by integrations.vllm.paged)
from kvarn.ops.seats import supported
from kvarn.quant.affine import AffineQuantizer

_CPU = torch.device("cpu")
_EMPTY, _ONE = torch.empty(0), torch.empty(1)  # the CUDA seat's reasons read only whether a mask / exact map is given

MAX_QUERIES = 16  # queries per head; longer chunks (prefill) take the matmul-based PyTorch path
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def unsupported_query(query: torch.Tensor) -> str | None:
    """Why the kernel cannot serve these queries [B, Hq, L, D] (None: it can)."""
    if query.device.type != "cpu" or query.dtype not in DTYPES:
        return f"query on {query.device.type} in {query.dtype}"
    if query.shape[2] > MAX_QUERIES:
        return f"{query.shape[2]} queries per head (prefill): the matmul path is faster"
    return None


def unsupported_quantizers(key_q, value_q) -> str | None:
    """Why the kernel cannot read tiles of these (key, value) quantizers (None: it can)."""
    for what, q, axis in (("keys", key_q, "channel"), ("values", value_q, "token")):
        if not isinstance(q, AffineQuantizer):
            return f"{what} are not AffineQuantizer tiles"
        if q.config.axis != axis:
            return f"{what} quantized per {q.config.axis}"
        if q.config.bits not in kernel.KERNEL_BITS:
            return f"{what} have {q.config.bits}-bit codes"
        if q.config.refine:
            return f"{what} have refined channels (codes of two widths in a tile)"
    return None


def unsupported_cuda(query: torch.Tensor, keys: StoredKV, values: StoredKV, softcap: float | None) -> str | None:
    """Why the Triton kernel cannot serve this CUDA step (None: it can, unless the mask turns out to hide a
    position: `fused_attention` checks that once the mask is known)."""
    if query.shape[2] != 1:
        return f"{query.shape[2]} queries per head (the Triton kernel has no causal mask yet)"
    if keys.quantizer.config.widths:
        return "keys have rows at their own widths (the Triton kernel reads one width a tile)"
    if query.dtype not in DTYPES:
        return f"query in {query.dtype}"
    exact = len(keys.exact_index) or len(values.exact_index)
    return supported("packed_decode", query.device, query, keys.quantizer.config.bits, values.quantizer.config.bits,
                     keys.tile, _EMPTY, float(softcap or 0.0), _ONE if exact else _EMPTY)


def unsupported(query: torch.Tensor, keys: StoredKV | None, values: StoredKV | None,
                softcap: float | None = None) -> str | None:
    """Why the fused kernel cannot serve this step (None: it can)."""
    if keys is None or values is None or not keys.n_tiles:
        return "no packed tiles"
    why = unsupported_quantizers(keys.quantizer, values.quantizer)
    if why is None and query.device.type == "cuda":
        why = unsupported_cuda(query, keys, values, softcap)
    elif why is None:
        why = unsupported_query(query)
    if why is not None:
        return why
    for what, v in (("keys", keys), ("values", values)):
        if v.post is not None:
            return f"{what} stored before RoPE"
    if (keys.tile, keys.n_tiles, keys.sink_len) != (values.tile, values.n_tiles, values.sink_len):
        return "keys and values have different tiles or regions"
    return None


def take(why: str | None, device: torch.device = _CPU) -> bool:
    """Whether a step on `device` for which the kernel gave `why` (None: it can serve it) takes the kernel, by
    KVARN_KERNEL (`kvarn.ops.dispatch.use_kernel`; under torch the CPU extension is never built); "no packed tiles"
    is not an error under cpu: there is nothing to fuse."""
    cpu = device.type == "cpu"
    return use_kernel(lambda: why if why is not None or not cpu else supported("packed_decode", _CPU),
                      "the fused kernel cannot serve this step", optional=("no packed tiles",))


def _tiles(view: StoredKV) -> kernel.PackedTiles:
    return kernel.PackedTiles.cache(view.packed)


def _decoded(view: StoredKV, idx: torch.Tensor) -> torch.Tensor:
    """Tiles (b, h, j) of idx [k, 3] as attention sees them, float32 [k, G, D] (exact copies where kept exact)."""
    x = view.quantizer.decode(view.packed.select((idx[:, 0], idx[:, 1], idx[:, 2])), torch.float32)
    if len(view.exact_index):
        hit = (idx.unsqueeze(1) == view.exact_index.to(idx.device).unsqueeze(0)).all(-1)  # [k, n_exact]
        row, col = hit.nonzero(as_tuple=True)
        x[row] = view.exact_values[col].float()
    return x


def _exact(keys: StoredKV, values: StoredKV):
    if not len(keys.exact_index) and not len(values.exact_index):
        return None
    idx = torch.cat([keys.exact_index, values.exact_index]).unique(dim=0)
    b, h, _ = keys.shape_bhd
    emap = torch.full((b, h, keys.n_tiles), -1, dtype=torch.int32)
    emap[idx[:, 0], idx[:, 1], idx[:, 2]] = torch.arange(len(idx), dtype=torch.int32)
    return emap, _decoded(keys, idx), _decoded(values, idx)


def bias(mask: torch.Tensor | None, ok: torch.Tensor | None) -> torch.Tensor | None:
    """float32 [B or 1, 1 or Hq, L, T]: 0 or the additive mask where allowed, -inf elsewhere; None if all allowed
    (ok None: a decode step without a mask)."""
    if ok is None:
        return None
    add = mask if mask is not None and mask.dtype != torch.bool else None
    if add is None and bool(ok.all()):
        return None
    base = add.float() if add is not None else torch.zeros(ok.shape, device=ok.device)
    return base.masked_fill(~ok, float("-inf"))


_TABLES: dict[tuple[int, int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _table(b: int, n: int, device: torch.device = _CPU) -> tuple[torch.Tensor, torch.Tensor]:
    """The block table of the cache layout (block_table[b, j] = j) and n_blocks, cached per (B, n, device)."""
    t = _TABLES.get((b, n, device))
    if t is None:
        if len(_TABLES) > 64:
            _TABLES.clear()
        t = _TABLES[b, n, device] = (torch.arange(n, dtype=torch.int32, device=device).expand(b, n),
                                     torch.full((b,), n, dtype=torch.int32, device=device))
    return t


def fused_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keys: StoredKV, values: StoredKV,
                    ok: torch.Tensor | None, mask: torch.Tensor | None, scale: float,
                    softcap: float | None) -> torch.Tensor | None:
    """packed_attention's result [B, L, Hq, D] (query dtype) through the kernel; `ok` the boolean allowed mask
    (`attention.packed.allowed`), None for a single query without a mask (everything allowed). None on CUDA when
    the mask hides a position (the Triton kernel has no mask yet): the caller takes the PyTorch path."""
    b = query.shape[0]
    add = bias(mask, ok)
    if add is not None and query.device.type != "cpu":
        return None
    dense = []
    if keys.sink_len:  # in its stored dtype (fp16 by default): the kernel widens rows as it reads them
        dense.append((keys.sink_rows(keys.sink.dtype), values.sink_rows(values.sink.dtype), 0))
    tail_pos = keys.sink_len + keys.n_tiles * keys.tile
    if keys.tail_len:
        dense.append((keys.tail_rows(keys.tail.dtype), values.tail_rows(values.tail.dtype), tail_pos))
    dense.append((key, value, keys.length))
    n = keys.n_tiles
    table, count = _table(b, n, query.device)
    out = kernel.decode_attention(query, _tiles(keys), _tiles(values), table, count, keys.tile, scaling=scale,
                                  dense=dense, tiles_pos=keys.sink_len, bias=add, softcap=softcap,
                                  exact=_exact(keys, values), validate=False)
    return out.transpose(1, 2).to(query.dtype).contiguous()
