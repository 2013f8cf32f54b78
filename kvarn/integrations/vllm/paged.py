"""One attention layer over vLLM's paged kvarn cache: store the step's K/V, then attend.

What a query at position p of logical block j sees (the same whatever the batching, chunking, prefix-cache hits or
preemptions that led to it, so a prefill equals a token-by-token decode):

    blocks 0 .. j-1        as stored: sink blocks exact (fp slots), the others packed, except blocks kept exact in
                           this layer (`StepPlan.exact`: a tile that cannot be quantized), read from their fp slot
    block j, tokens <= p   exact (the fp slot's earlier rows and this step's fresh rows)

This is what kvarn's transformers cache gives a sequence fed one token at a time. Per layer and step:
  1. write: for every block touched by a request's new tokens, assemble its exact rows; blocks that complete are
     quantized together (one `encode_tiles` for all of them, the quantizer of the transformers cache) into their
     pages; a block with a tile that cannot be quantized (non-finite K/V, a scale or the reconstruction overflowing:
     the transformers cache's test, `kvarn.cache.store.fits_dtype`) has its packed fields zeroed and its exact rows
     written to an fp slot (`SlotTable.take_exact`), and is marked exact in this layer; sink blocks and incomplete
     blocks also (re)write their fp slot;
  2. read: per request and per query block j, one softmax over blocks < j and block j's exact rows, by one of
     - the fused C++ kernel (through `kvarn.attention.launch`), for decode-like pieces (<= `fused.MAX_QUERIES` queries
       per head: decode tokens, and the short last piece of a chunk) with at least one packed block: it reads the
       pool's zero-copy field views (`LayerPool.key_fields` / `value_fields`, [num_blocks, H, ...], stride_batch 0,
       `PackedTiles.pool`) through this request's row of the block table; sink blocks and block j's rows are its
       dense segments. One call per request and block (rows differ in sink and exact lengths);
     - else `kvarn.attention.packed.packed_attention` (PyTorch: prefill pieces under every KVARN_KERNEL, since the
       kernel is a decode kernel and the matmul path is faster there; every piece when KVARN_KERNEL=torch) over a
       `StoredKV` view whose packed fields are gathered through the block table.
     Decode-like pieces follow `kvarn.attention.fused.take` (KVARN_KERNEL=auto: the kernel when it loads; torch;
     cpu: the kernel or an error naming why not), as the transformers cache does.
"""

from __future__ import annotations

import logging

import torch

from kvarn.attention import fused
from kvarn.attention import launch as kernel
from kvarn.attention.packed import KVarNPast, allowed, packed_attention
from kvarn.attention.view import StoredKV
from kvarn.cache.store import fits_dtype
from kvarn.integrations.vllm.pool import LayerPool, RequestPlan, StepPlan
from kvarn.quant.tiles import Tiles

log = logging.getLogger("vllm.kvarn")  # a child of vLLM's logger: its handlers and format
_NO_EXACT = torch.zeros(0, 3, dtype=torch.long)


def _pieces(plan: StepPlan, g: int):
    """(request index, request, logical block j, rows of the step's [T, ...] tensors that fall in block j, position
    after the last of them) for every block a step touches."""
    for i, p in enumerate(plan.requests):
        t0, t1 = p.rows
        if t1 == t0:
            continue
        nc = p.computed
        for j in range(nc // g, -(-p.length // g)):
            lo, hi = max(nc, j * g), min(p.length, (j + 1) * g)
            yield i, p, j, slice(t0 + lo - nc, t0 + hi - nc), hi


def write_step(pool: LayerPool, plan: StepPlan, key: torch.Tensor, value: torch.Tensor,
               layer: str) -> dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]:
    """Store the step's key/value [T, H, D]; returns the exact rows (K, V [H, t, D]) of every block touched, keyed by
    (request, logical block)."""
    lay = pool.layout
    g, fp = lay.tile, lay.fp_dtype
    exact: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    done_k, done_v, done_blocks, done_where = [], [], [], []
    for i, p, j, rows, hi in _pieces(plan, g):
        nc = p.computed
        fk = key[rows].transpose(0, 1)  # [H, t, D]
        fv = value[rows].transpose(0, 1)
        s = p.slots[j]
        old = None
        if j * g < nc:  # earlier rows of this block wait in its fp slot
            old = pool.read_slot(s)  # [H, 2, G, D]
            n_old = nc - j * g
            fk = torch.cat([old[:, 0, :n_old].to(fk.dtype), fk], dim=1)
            fv = torch.cat([old[:, 1, :n_old].to(fv.dtype), fv], dim=1)
        exact[(i, j)] = (fk, fv)
        complete = hi == (j + 1) * g
        if complete:
            done_k.append(fk)
            done_v.append(fv)
            done_blocks.append(p.blocks[j])
            done_where.append((p, j))
        if s is not None and (j < plan.sink_blocks or not complete):  # a completing block's slot: only kept exact
            slot = old if old is not None else torch.zeros(fk.shape[0], 2, g, lay.head_dim, dtype=fp)
            slot[:, 0, :fk.shape[1]] = fk.to(fp)
            slot[:, 1, :fv.shape[1]] = fv.to(fp)
            pool.write_slot(s, slot)
    if done_blocks:
        k, v = torch.stack(done_k), torch.stack(done_v)
        bad = _store_tiles(pool, k, v, done_blocks)
        for t in bad.nonzero().flatten().tolist():
            p, j = done_where[t]
            if p.slots[j] is None:
                if plan.take_exact is None:
                    raise RuntimeError(f"kvarn: layer {layer}: block {done_blocks[t]} cannot be quantized and this "
                                       "plan has no slot table to keep it exact")
                p.slots[j] = plan.take_exact(done_blocks[t])
            pool.write_slot(p.slots[j], torch.stack([k[t], v[t]], dim=1).to(fp))  # [H, 2, G, D]
            if done_blocks[t] not in plan.exact:
                log.warning("kvarn: layer %s: block %d holds keys/values that cannot be quantized (non-finite or "
                            "overflowing); kept exact in the full-precision pool", layer, done_blocks[t])
            plan.exact.setdefault(done_blocks[t], set()).add(layer)
    return exact


def _store_tiles(pool: LayerPool, k: torch.Tensor, v: torch.Tensor, blocks: list[int]) -> torch.Tensor:
    """k, v [n, H, G, D] complete tiles -> packed fields of blocks (quantized once, never again). Returns [n] bool:
    the blocks with a tile (any head, keys or values) that cannot be quantized, whose packed fields are zeroed (so
    nothing non-finite is ever read from them) and which the caller keeps exact."""
    lay = pool.layout
    n, h = k.shape[:2]
    ok = torch.ones(n, dtype=torch.bool)
    packs = []
    for q, x in ((lay.key_q, k), (lay.value_q, v)):
        flat = x.flatten(0, 1)
        packed, finite, scale_ok = q.encode_tiles(flat)  # non-finite tiles encoded as zeros
        ok &= fits_dtype(q, packed, flat, finite & scale_ok, x.dtype).view(n, h).all(1)
        packs.append(packed)
    bad = ~ok
    if bad.any():
        drop = bad.repeat_interleave(h)
        packs = [p.zeroed(drop) for p in packs]
    kp, vp = packs
    idx = torch.tensor(blocks, dtype=torch.long)
    for fields, packed in ((pool.key_fields, kp), (pool.value_fields, vp)):
        new = packed.tensors()
        for name, view in fields.items():
            view[idx] = new[name].unflatten(0, (n, h))
    return bad


def _sink_rows(pool: LayerPool, p: RequestPlan, j: int, sink_blocks: int,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """K, V [1, H, ns*G, D] of the exact sink blocks among logical blocks [0, j) (up to the first one whose exact copy
    was evicted: from there on, blocks are read packed), or None."""
    sinks = []
    for jj in range(min(j, sink_blocks)):
        if p.slots[jj] is None:
            break
        sinks.append(pool.read_slot(p.slots[jj]))
    if not sinks:
        return None
    kv = torch.cat(sinks, dim=2).to(dtype)  # [H, 2, ns*G, D]
    return kv[None, :, 0], kv[None, :, 1]


def exact_tiles(pool: LayerPool, plan: StepPlan, p: RequestPlan, layer: str, ns: int,
                j: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The blocks among [ns, j) kept exact in this layer (`StepPlan.exact`), as tiles of a one-row cache whose packed
    tiles are blocks ns .. j-1: (index [k, 3] (0, head, tile - ns), keys, values [k, G, D] from their fp slots), or
    None."""
    if not plan.exact:
        return None
    tiles = [t for t in range(ns, j) if plan.exact_in(layer, p.blocks[t])]
    if not tiles:
        return None
    h = pool.geo.num_kv_heads
    kv = torch.stack([pool.read_slot(p.slots[t]) for t in tiles])  # [m, H, 2, G, D]
    index = torch.tensor([(0, hh, t - ns) for t in tiles for hh in range(h)], dtype=torch.long)
    return index, kv[:, :, 0].flatten(0, 1), kv[:, :, 1].flatten(0, 1)


def past_view(pool: LayerPool, p: RequestPlan, j: int, sink_blocks: int, dtype: torch.dtype,
              plan: StepPlan | None = None, layer: str = "") -> tuple[StoredKV, StoredKV] | None:
    """Keys and values of logical blocks [0, j) as kvarn's attention reads them: exact sink blocks from their fp
    slots (up to the first one whose exact copy was evicted), then packed tiles gathered through the block table,
    those kept exact in this layer restored from their slots."""
    if j == 0:
        return None
    lay = pool.layout
    sink = _sink_rows(pool, p, j, sink_blocks, dtype)
    ns = 0 if sink is None else sink[0].shape[2] // lay.tile
    idx = torch.tensor(p.blocks[ns:j], dtype=torch.long)
    h = pool.geo.num_kv_heads
    ex = None if plan is None else exact_tiles(pool, plan, p, layer, ns, j)
    views = []
    for i, (fields, q) in enumerate(((pool.key_fields, lay.key_q), (pool.value_fields, lay.value_q))):
        packed = fields.select(idx).map(lambda v: v.transpose(0, 1)[None]) if len(idx) else Tiles()
        views.append(StoredKV(None if sink is None else sink[i], packed, len(idx), None,
                              _NO_EXACT if ex is None else ex[0], None if ex is None else ex[1 + i], q,
                              (1, h, lay.head_dim), dtype))
    return views[0], views[1]


def fused_piece(pool: LayerPool, p: RequestPlan, j: int, sink_blocks: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, scale: float, softcap: float | None, plan: StepPlan | None = None,
                layer: str = "") -> torch.Tensor | None:
    """The fused kernel's attention [1, L, Hq, D] (q's dtype) for queries q [1, Hq, L, D], the last L of block j's
    exact rows k, v [1, H, t, D], over blocks < j read in place through the block table; None when this piece takes
    the PyTorch path (`fused.take`: KVARN_KERNEL, the queries, the quantizers, no packed block)."""
    if fused.mode() == "torch" or q.shape[2] > fused.MAX_QUERIES:  # prefill pieces: PyTorch under every mode
        return None
    lay = pool.layout
    sink = _sink_rows(pool, p, j, sink_blocks, k.dtype) if j else None  # the kernel reads fp16/bf16 rows as they are
    ns = 0 if sink is None else sink[0].shape[2] // lay.tile
    n = j - ns
    why = "no packed tiles" if n <= 0 else fused.unsupported_query(q) or fused.unsupported_quantizers(lay.key_q,
                                                                                                       lay.value_q)
    if not fused.take(why):
        return None
    g, length, t = lay.tile, q.shape[2], k.shape[2]
    dense = [] if sink is None else [(sink[0], sink[1], 0)]
    dense.append((k, v, j * g))
    table = torch.tensor([p.blocks[ns:j]], dtype=torch.int32)
    ok = None if length == 1 else allowed(None, 1, length, j * g + t, q.device)  # causal within block j
    ex = None if plan is None else exact_tiles(pool, plan, p, layer, ns, j)
    if ex is not None:  # the kernel's exact map: (row, head, tile) -> index into the exact rows (float32)
        emap = torch.full((1, pool.geo.num_kv_heads, n), -1, dtype=torch.int32)
        emap[ex[0][:, 0], ex[0][:, 1], ex[0][:, 2]] = torch.arange(len(ex[0]), dtype=torch.int32)
        ex = (emap, ex[1].float(), ex[2].float())
    out = kernel.decode_attention(q, kernel.PackedTiles.pool(pool.key_fields),
                                  kernel.PackedTiles.pool(pool.value_fields), table,
                                  torch.tensor([n], dtype=torch.int32), g, scaling=scale, dense=dense,
                                  tiles_pos=ns * g, bias=None if ok is None else fused.bias(None, ok),
                                  softcap=softcap, exact=ex)
    return out.transpose(1, 2).to(q.dtype)


def attend_step(pool: LayerPool, plan: StepPlan, query: torch.Tensor, output: torch.Tensor,
                exact: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]], scale: float,
                softcap: float | None, layer: str) -> None:
    """query [T, Hq, D] -> output [T, Hq, D], request by request and query block by query block; `layer` as given to
    `write_step` (blocks kept exact are marked per layer)."""
    g = pool.layout.tile
    for i, p, j, rows, _ in _pieces(plan, g):
        q = query[rows].transpose(0, 1)[None]  # [1, Hq, L, D]
        k, v = exact[(i, j)]
        out = fused_piece(pool, p, j, plan.sink_blocks, q, k[None], v[None], scale, softcap, plan, layer)
        if out is None:
            past = past_view(pool, p, j, plan.sink_blocks, query.dtype, plan, layer)
            out = packed_attention(q, k[None], v[None], None if past is None else KVarNPast(*past), None, scale,
                                   softcap, kernel=False)  # [1, L, Hq, D]
        output[rows] = out[0]
