"""One attention layer over vLLM's paged kvarn cache: store the step's K/V, then attend.

What a query at position p of logical block j sees (the same whatever the batching, chunking, prefix-cache hits or
preemptions that led to it, so a prefill equals a token-by-token decode):

    blocks 0 .. j-1        as stored: sink blocks exact (fp slots), the others packed, except blocks kept exact in
                           this layer (`StepPlan.exact`: a tile that cannot be quantized), read from their fp slot
    block j, tokens <= p   exact (the fp slot's earlier rows and this step's fresh rows)

This is what kvarn's transformers cache gives a sequence fed one token at a time. Per layer and step:
  1. write: decode rows (one new token in a block with an fp slot: `DecodeBatch`) scatter their fresh rows into
     their slots at once; for every other block touched by a request's new tokens, assemble its exact rows; blocks
     that complete are quantized together (one `encode_tiles` for all of them, the quantizer of the transformers
     cache) into their pages, before any read; a block with a tile that cannot be quantized (non-finite K/V, a scale
     or the reconstruction overflowing: the transformers cache's test, `kvarn.cache.store.fits_dtype`) has its
     packed fields zeroed and its exact rows written to an fp slot (`SlotTable.take_exact`), and is marked exact in
     this layer; sink blocks and incomplete blocks also (re)write their fp slot;
  2. read: per query, one softmax over blocks < j and block j's exact rows, by one of
     - for all decode rows of the step, ONE call of the fused C++ kernel (`batched_decode`, through
       `kvarn.attention.launch`): batch rows = requests, each with its block-table row and tile count, the packed
       fields read in place from the pool's zero-copy views (`LayerPool.key_fields` / `value_fields`,
       [num_blocks, H, ...], stride_batch 0, `PackedTiles.pool`); the sink and current-block rows read in
       place from the fp slots through their row ids (the kernel's indexed rows: no copy), padding masked. A
       layer holding a block kept exact (rare) serves its decode rows by the per-request paths below instead;
     - the fused kernel per request and query block for other decode-like pieces (<= `fused.MAX_QUERIES` queries
       per head: the short last piece of a chunk) with at least one packed block: sink blocks, blocks kept exact and
       block j's rows are its dense segments;
     - else `kvarn.attention.packed.packed_attention` (PyTorch: prefill pieces under every KVARN_KERNEL, since the
       kernel is a decode kernel and the matmul path is faster there; every piece when KVARN_KERNEL=torch) over a
       `StoredKV` view whose packed fields are gathered through the block table; prompt pieces over a past decoded
       densely (many query rows) go instead, all of a step's at once, to ONE call of vLLM's own CPU attention over
       a scratch page cache (`_vllm_pieces`) where vLLM's CPU kernel serves the head size and dtype, else to SDPA
       batched by shape (`_batched_pieces`; KVARN_PREFILL_ATTENTION=sdpa forces it).
     Decode-like pieces follow `kvarn.attention.fused.take` (KVARN_KERNEL=auto: the kernel when it loads; torch;
     cpu: the kernel or an error naming why not), as the transformers cache does.
  Budget presets (`budget`): the same per layer once the engine's key widths are decided; before, completed tiles
  store their values only, and the step that decides holds its key tiles aside exact (`StepPlan.held`), which the
  read paths above honour (PyTorch for the pieces that read them).
  On CUDA (`decode_kernel`: chosen by the pool's device) the batched decode is `triton_decode` (the Triton split
  kernel, fixed `MAX_SPLITS`) and completed blocks are written by the Triton store kernel (`_store_triton`); the
  per-request pieces take PyTorch there (the fused kernel above is the CPU's).

kvarn-auto presets (rotate="auto": each tile stored in the basis, rotated or plain, that its encode chooses):
  * query statistics: each layer keeps ONE running `QueryEnergy` (mean of q_d^2 per KV head, [1, H, D] float32 sums +
    a count, on its `LayerPool`), for the whole engine: every request's queries of every step pooled, with the GQA
    query heads of a KV head and the positions. `observe_queries` adds the step's queries (after RoPE, as attention
    sees them; kept and folded in when the statistics are read: `pool.PendingQueries`) BEFORE `write_step` quantizes
    the step's completed key tiles, the transformers cache's order (`LayerStore.observe_queries`: a prompt's own
    queries count for its tiles). Why not per request, as the transformers cache keeps one mean per sequence: vLLM
    shares complete blocks between requests through prefix caching, and a block is quantized once; a per-request
    mean would make a shared block's bytes depend on which request happened to write it, and vLLM does not tell the
    backend when a request ends, so per-request state could not be freed. The engine mean is the closest causal
    analogue (it pools exactly the queries this layer has served so far). With tensor parallelism each rank keeps its
    own for its KV heads. Tokens with non-finite queries are left out (the mean outlives the request that sent them);
  * store: key tiles are encoded with that mean as the policy's weight (one row per tile, by KV head; values by
    plain squared error, as in the transformers cache), in the same single encode call for all completed blocks,
    served by the fused C++ store kernel (`kvarn::tile_store`, both bases per tile, no Python per block);
  * `-qar` presets (keys rounded query-aware, `QueryAwareQuantizer`): the layer keeps the running E[q q^T] per KV
    head instead (`QueryCovariance`, held as its upper triangle, pooled the same way; its diagonal is the energy
    above), and the store hands it to the key encode, one copy per tile (the C++ store kernel rounds with it; on
    CUDA the PyTorch encode);
  * the per-tile `rotated` flag is a packed field of the page (`layout`), so vLLM's capacity report counts it, and
    both read paths honour it: the kernel reads it through `PackedTiles.pool` as the transformers cache's fused
    decode does (queries rotated for rotated key tiles, rotated value accumulators rotated back once), PyTorch
    through `decode_tiles`.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvarn.attention import fused
from kvarn.attention import launch as kernel
from kvarn.attention.packed import KVarNPast, allowed, compute_dtype, decodes_past, packed_attention, sdpa_rows
from kvarn.attention.view import StoredKV
from kvarn.cache.store import fits_dtype
from kvarn.integrations.vllm.pool import Held, LayerPool, RequestPlan, StepPlan
from kvarn.kernels.cpu import decode as cpu_kernel
from kvarn.ops import dispatch
from kvarn.ops.decode import indexed_rows
from kvarn.quant.policy import kernel_weighted
from kvarn.quant.tiles import Tiles

log = logging.getLogger("vllm.kvarn")  # a child of vLLM's logger: its handlers and format
_NO_EXACT = torch.zeros(0, 3, dtype=torch.long)
# Context splits per (request, KV head) of the Triton decode: a constant, so the launch grid (B * H, MAX_SPLITS)
# depends on the batch only (CUDA graphs); 16 x B x H programs fill an H100/H200's 132 SMs from B * H = 8 on.
MAX_SPLITS = 16


def decode_kernel(device: torch.device) -> str:
    """The kernels that serve a pool on `device` (its batched decode and the store of its completed blocks): "cpu",
    the C++ kernels (`kvarn.attention.launch`, `AffineQuantizer.encode_tiles`), or "triton" on CUDA
    (`kvarn.kernels.triton`). Other devices are refused: kvarn has no backend for them."""
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        return "triton"
    raise ValueError(f"kvarn: the paged vLLM backend runs on CPU or CUDA tensors, not {device.type}")


def triton_unsupported(pool: LayerPool) -> str | None:
    """Why the Triton paged decode cannot read this pool's tiles (None: it can)."""
    from kvarn.kernels.triton import available

    lay = pool.layout
    if not available():
        return "triton is not installed (pip install 'kvarn[triton]')"
    why = fused.unsupported_quantizers(lay.key_q, lay.value_q)
    if why is not None:
        return why
    if lay.key_q.config.widths:
        return "key rows at their own widths (the Triton kernels read one width a tile)"
    from kvarn.kernels.triton.ops import SUPPORTED_BITS

    if lay.key_q.config.bits not in SUPPORTED_BITS or lay.value_q.config.bits not in SUPPORTED_BITS:
        return (f"{lay.key_q.config.bits}/{lay.value_q.config.bits}-bit codes (the Triton kernels read "
                f"{SUPPORTED_BITS})")
    d, g = lay.head_dim, lay.tile
    if min(d, g) < 16 or d & (d - 1) or g & (g - 1):
        return f"head_dim {d} or tile {g} not a power of two >= 16"
    return None


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


def observe_queries(pool: LayerPool, query: torch.Tensor) -> None:
    """query [T, Hq, D] (after RoPE, the step's queries as attention sees them) -> the layer's running query
    statistics, before `write_step` quantizes this step's completed key tiles (so a prompt's own queries count for its
    tiles, as in the transformers cache: `LayerStore.observe_queries`). All requests of the step pooled: one running
    mean per layer for the engine (module docstring); folded in lazily (`PendingQueries`). A no-op for quantizers that
    take no weight."""
    if pool.queries is not None:
        pool.queries.add(query)


def write_step(pool: LayerPool, plan: StepPlan, key: torch.Tensor, value: torch.Tensor, layer: str,
               hold: Callable[[list[Held]], None] | None = None) -> dict[tuple[int, int], tuple[torch.Tensor,
                                                                                              torch.Tensor]]:
    """Store the step's key/value [T, H, D]; returns the exact rows (K, V [H, t, D]) of every block touched, keyed by
    (request, logical block). `hold` (a budget preset before its key allocation, `budget.BudgetState.hold`):
    completed tiles store their values only; the keys of sink blocks wait in their slots, the others go to hold."""
    lay = pool.layout
    g, fp = lay.tile, lay.fp_dtype
    exact: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    done_k, done_v, done_blocks, done_where = [], [], [], []
    batch = decode_batch(plan, pool)
    if batch is not None:  # every decode row at once: its fresh K, V rows straight into their fp slots
        if batch.tok is None or not cpu_kernel.write_rows(pool.rows, key, value, batch.tok, batch.write_blk,
                                                          batch.write_sub):
            fresh = torch.stack([key[batch.rows], value[batch.rows]], 1)  # [B, 2, H, D]
            pool.rows[batch.write_blk, :, batch.write_sub] = fresh if fresh.dtype == fp else fresh.to(fp)
        if batch.done_blocks:  # the blocks these tokens complete: their exact rows, now all in their slots
            kv = pool.rows[batch.done_blk, :, batch.done_sub].to(key.dtype)  # [n, 2, G, H, D]
            done_k.extend(kv[:, 0].transpose(1, 2).unbind(0))
            done_v.extend(kv[:, 1].transpose(1, 2).unbind(0))
            done_blocks.extend(batch.done_blocks)
            done_where.extend(batch.done_where)
    for i, p, j, rows, hi in _pieces(plan, g) if batch is None else batch.others:
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
            slot = old if old is not None else torch.zeros(fk.shape[0], 2, g, lay.head_dim, dtype=fp,
                                                           device=fk.device)
            slot[:, 0, :fk.shape[1]] = fk.to(fp)
            slot[:, 1, :fv.shape[1]] = fv.to(fp)
            pool.write_slot(s, slot)
    if done_blocks:
        k, v = torch.stack(done_k), torch.stack(done_v)
        kinds = ("keys", "values")
        if hold is not None:
            kinds = ("values",)
            hold([Held(b, k[t], v[t]) for t, (b, (_, j)) in enumerate(zip(done_blocks, done_where))
                  if j >= plan.sink_blocks])
        bad = store_tiles(pool, k, v, done_blocks, kinds)
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


def store_tiles(pool: LayerPool, k: torch.Tensor, v: torch.Tensor, blocks: list[int],
                kinds: tuple[str, ...] = ("keys", "values")) -> torch.Tensor:
    """k, v [n, H, G, D] complete tiles -> packed fields of blocks (quantized once, never again; `kinds`: keys and
    values, or one of them). Returns [n] bool: the blocks with a tile (any head, of those kinds) that cannot be
    quantized, whose packed fields (of those kinds) are zeroed (so nothing non-finite is ever read from them) and
    which the caller keeps exact."""
    lay = pool.layout
    n, h = k.shape[:2]
    packs = []
    # rotate="auto" keys: each tile's rotation chosen with its KV head's running query energy (one row per tile, in
    # the flattened (block, head) order); values choose by plain squared error, as in the transformers cache
    # (query-aware keys: E[q q^T] [1, H, D, D] instead, one copy per tile: `QueryAwareQuantizer`)
    w = None if pool.queries is None else pool.queries.key_weight()  # [1, H, D] (or [1, H, D, D])
    kw = None if w is None else w.expand(n, h, *w.shape[2:]).reshape(n * h, *w.shape[2:])
    idx = torch.tensor(blocks, dtype=torch.long, device=k.device)
    if decode_kernel(k.device) == "triton" and len(kinds) == 2 and _triton_store(pool):
        return _store_triton(pool, k, v, kw, idx)
    ok = torch.ones(n, dtype=torch.bool, device=k.device)
    todo = [(q, x, weight, fields) for kind, q, x, weight, fields in (
        ("keys", lay.key_q, k, kw, pool.key_fields), ("values", lay.value_q, v, None, pool.value_fields))
        if kind in kinds]
    for q, x, weight, _ in todo:
        flat = x.flatten(0, 1)
        packed, finite, scale_ok = q.encode_tiles(flat, weight)  # non-finite tiles encoded as zeros
        ok &= fits_dtype(q, packed, flat, finite & scale_ok, x.dtype).view(n, h).all(1)
        packs.append(packed)
    bad = ~ok
    if bad.any():
        drop = bad.repeat_interleave(h)
        packs = [p.zeroed(drop) for p in packs]
    for (_, _, _, fields), packed in zip(todo, packs):
        new = packed.tensors()
        for name, view in fields.items():
            view[idx] = new[name].unflatten(0, (n, h))
    return bad


def _triton_store(pool: LayerPool) -> bool:
    """Whether the Triton store kernel writes this pool's tiles: it writes 16/32-bit scales only, so presets with
    8-bit scales (kvarn-auto's relative column scales) are encoded by `encode_tiles` (PyTorch on the tiles' device),
    logged once per pool."""
    if pool.triton_store is None:
        from kvarn.kernels.triton import ops

        lay = pool.layout
        qar = "query-aware key rounding" if getattr(lay.key_q, "takes_covariance", False) else None
        why = triton_unsupported(pool) or qar or ops.store_unsupported(lay.formats["keys"]) or ops.store_unsupported(
            lay.formats["values"])
        pool.triton_store = why is None
        if why is not None:
            log.info("kvarn: completed blocks are encoded by PyTorch on %s: the Triton store kernel cannot (%s)",
                     pool.packed.device, why)
    return pool.triton_store


def _store_triton(pool: LayerPool, k: torch.Tensor, v: torch.Tensor, kw: torch.Tensor | None,
                  idx: torch.Tensor) -> torch.Tensor:
    """`store_tiles` by the Triton store kernel, straight into the pool's fields at blocks idx; then the same test
    as `encode_tiles` + `fits_dtype` on what was written (non-finite tiles encoded as zeros)."""
    from kvarn.kernels.triton import ops

    lay = pool.layout
    n, h = k.shape[:2]
    dst = idx.to(torch.int32)
    ok = torch.ones(n, dtype=torch.bool, device=k.device)
    for q, x, fields, weight in ((lay.key_q, k, pool.key_fields, kw), (lay.value_q, v, pool.value_fields, None)):
        flat = x.flatten(0, 1)
        finite = torch.isfinite(flat).flatten(1).all(1)
        x0 = torch.where(finite.view(n, h, 1, 1), x, torch.zeros_like(x))
        ops.store_tiles(x0, ops.TileFields.from_pool(fields), dst, q.config.varn, q.config.varn_iters,
                        None if weight is None else weight.view(n, h, -1), bool(kernel_weighted(q.policy)))
        packed = fields.select(idx).flatten(2)  # [n * H, ...] as written
        ok &= fits_dtype(q, packed, flat, finite & packed.finite_tiles(), x.dtype).view(n, h).all(1)
    bad = ~ok
    if bad.any():
        for fields in (pool.key_fields, pool.value_fields):
            for _, view in fields.items():
                view[idx[bad]] = 0
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
    kv = torch.stack([pool.read_slot(p.slots[t]) for t in tiles])  # [m, H, 2, G, D]
    return _tile_index(tiles, ns, pool.geo.num_kv_heads), kv[:, :, 0].flatten(0, 1), kv[:, :, 1].flatten(0, 1)


def _tile_index(tiles: list[int], ns: int, h: int) -> torch.Tensor:
    """[len(tiles) * h, 3] rows (0, head, tile - ns): where `StoredKV` puts exact rows among a one-row cache's tiles."""
    return torch.tensor([(0, hh, t - ns) for t in tiles for hh in range(h)], dtype=torch.long)


def held_tiles(plan: StepPlan, p: RequestPlan, layer: str, ns: int,
               j: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The key tiles among blocks [ns, j) held aside exact in this layer (`StepPlan.held`: a budget preset's deciding
    step) and not kept exact: (index [k, 3] (0, head, tile - ns), keys [k, G, D]), or None."""
    held = plan.held.get(layer)
    if not held:
        return None
    tiles = [t for t in range(ns, j) if p.blocks[t] in held and not plan.exact_in(layer, p.blocks[t])]
    if not tiles:
        return None
    keys = torch.stack([held[p.blocks[t]] for t in tiles])  # [m, H, G, D]
    return _tile_index(tiles, ns, keys.shape[1]), keys.flatten(0, 1)


def past_view(pool: LayerPool, p: RequestPlan, j: int, sink_blocks: int, dtype: torch.dtype,
              plan: StepPlan | None = None, layer: str = "") -> tuple[StoredKV, StoredKV] | None:
    """Keys and values of logical blocks [0, j) as kvarn's attention reads them: exact sink blocks from their fp
    slots (up to the first one whose exact copy was evicted), then packed tiles gathered through the block table,
    those kept exact in this layer restored from their slots, and the keys held aside (`held_tiles`) exact."""
    if j == 0:
        return None
    lay = pool.layout
    sink = _sink_rows(pool, p, j, sink_blocks, dtype)
    ns = 0 if sink is None else sink[0].shape[2] // lay.tile
    idx = torch.tensor(p.blocks[ns:j], dtype=torch.long)
    h = pool.geo.num_kv_heads
    ex = None if plan is None else exact_tiles(pool, plan, p, layer, ns, j)
    held = None if plan is None else held_tiles(plan, p, layer, ns, j)
    views = []
    for i, (fields, q) in enumerate(((pool.key_fields, lay.key_q), (pool.value_fields, lay.value_q))):
        packed = fields.select(idx).map(lambda v: v.transpose(0, 1)[None]) if len(idx) else Tiles()
        index, rows = (_NO_EXACT, None) if ex is None else (ex[0], ex[1 + i])
        if held is not None and i == 0:  # keys only: the values of those tiles are stored
            index = held[0] if rows is None else torch.cat([index, held[0]])
            rows = held[1] if rows is None else torch.cat([rows, held[1].to(rows.dtype)])
        views.append(StoredKV(None if sink is None else sink[i], packed, len(idx), None, index, rows, q,
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
    if plan is not None and plan.held.get(layer):  # keys held aside exact (a budget preset's deciding step)
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
    ok = None if length == 1 else causal(plan, length, j * g + t, q.device)  # causal within block j
    ex = None if plan is None else exact_tiles(pool, plan, p, layer, ns, j)
    if ex is not None:  # the kernel's exact map: (row, head, tile) -> index into the exact rows (float32)
        emap = torch.full((1, pool.geo.num_kv_heads, n), -1, dtype=torch.int32)
        emap[ex[0][:, 0], ex[0][:, 1], ex[0][:, 2]] = torch.arange(len(ex[0]), dtype=torch.int32)
        ex = (emap, ex[1].float(), ex[2].float())
    out = kernel.decode_attention(q, *pool.tiles, table,
                                  torch.tensor([n], dtype=torch.int32), g, scaling=scale, dense=dense,
                                  tiles_pos=ns * g, bias=None if ok is None else fused.bias(None, ok),
                                  softcap=softcap, exact=ex)
    return out.transpose(1, 2).to(q.dtype)


def attend_step(pool: LayerPool, plan: StepPlan, query: torch.Tensor, output: torch.Tensor,
                exact: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]], scale: float,
                softcap: float | None, layer: str, prefill: str = "model") -> None:
    """query [T, Hq, D] -> output [T, Hq, D]: the step's decode rows in one batched call, the other pieces request by
    request and query block by query block; prefill: the dtype of their SDPA over a decoded past ("model": bf16 for
    a bf16 model, else float32; "float32"); `layer` as given to `write_step` (blocks kept exact are marked per
    layer)."""
    g = pool.layout.tile
    batch = decode_batch(plan, pool)
    batched = batch is not None and not any(layer in marked for marked in plan.exact.values())
    if batched:
        out = batched_decode(pool, batch, query[batch.rows], scale, softcap)
        if isinstance(batch.rows, slice):
            output[batch.rows] = out  # one copy, cast to output's dtype
        else:
            output[batch.rows] = out.to(output.dtype)
    # A bf16 model's prefill reads its decoded past in bf16, as stock vLLM reads its bf16 pages (the rounding, 2^-9
    # relative, is far below the codes' error; SDPA is faster in bf16 on a CPU with AMX-BF16: docs/VLLM.md).
    sdpa = torch.bfloat16 if prefill == "model" and query.dtype == torch.bfloat16 else compute_dtype(query.dtype)
    decoded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # request -> its past decoded once (prefill pieces)
    same: dict[tuple, list[tuple[slice, torch.Tensor, torch.Tensor, torch.Tensor, tuple | None]]] = {}
    groups = query.shape[1] // pool.geo.num_kv_heads
    waiting: list[tuple] = []  # pieces over a decoded past, served once every past is decoded (`_decoded_pasts`)
    pieces = batch.others if batched else list(_pieces(plan, g))
    ops = _vllm_cpu_ops(pool, query.dtype, sdpa, softcap) if pieces else None
    for i, p, j, rows, _ in pieces:
        if batch is not None and i in batch.request_set:  # a decode row of a layer that holds exact tiles
            exact[(i, j)] = _slot_rows(pool, p, j, query.dtype)  # write_step put them in the slot only
        q = query[rows].transpose(0, 1)[None]  # [1, Hq, L, D]
        k, v = exact[(i, j)]
        out = fused_piece(pool, p, j, plan.sink_blocks, q, k[None], v[None], scale, softcap, plan, layer)
        if out is None:
            if decodes_past(groups * q.shape[2], softcap) and (j or ops is not None):  # many query rows: served
                waiting.append((i, p, j, rows, q, k, v))  # together below (first blocks too, by vLLM's attention)
                continue
            past = past_view(pool, p, j, plan.sink_blocks, query.dtype, plan, layer)
            if past is None:  # nothing stored before this block (a first block): batched as well
                same.setdefault(_batch_key(True, j, q, k), []).append((rows, q, k, v, None))
                continue
            out = packed_attention(q, k[None], v[None], KVarNPast(*past), None, scale, softcap,
                                   kernel=False)  # [1, L, Hq, D]
        output[rows] = out[0]
    together = _decoded_pasts(pool, plan, {i: p for i, p, *_ in waiting}, query.dtype, sdpa, layer)
    for i, p, j, rows, q, k, v in waiting:
        if ops is None:  # SDPA by shape over each request's past, sink and packed rows joined
            past = _decoded_past(pool, plan, p, i, j, query.dtype, sdpa, layer, decoded, together)
            same.setdefault(_batch_key(False, j, q, k), []).append((rows, q, k, v, past))
        elif together is None and j:  # pasts decoded one request at a time (tiles kept exact, keys held aside)
            _decoded_past(pool, plan, p, i, j, query.dtype, sdpa, layer, decoded)
    if waiting and ops is not None:  # every piece with many query rows in one call of vLLM's CPU attention
        _vllm_pieces(ops, waiting, together, decoded, scale, g, query, output)
    for group in same.values():  # block j of equally long prompts: one call for all of them (batch axis)
        out = _batched_pieces(plan, group, scale, softcap, sdpa)  # [n, L, Hq, D]
        for (rows, *_), o in zip(group, out):
            output[rows] = o


@dataclass
class DecodedPasts:
    """The pasts of a step's prompt pieces decoded together (`_decoded_pasts`), left in parts: `rows` K, V
    [1, H, n, D] (in the pieces' SDPA dtype) of every such request's packed blocks, request after request; `parts`
    per request: its exact sink rows (K, V [1, H, ns * G, D] in that dtype, or None), its first row in `rows` and its
    row count. The SDPA route joins a request's parts once (`joined`); vLLM's route pages them as they are."""
    rows: tuple[torch.Tensor, torch.Tensor]
    parts: dict[int, tuple[tuple[torch.Tensor, torch.Tensor] | None, int, int]]

    def joined(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Request i's past, K and V [1, H, ns * G + n, D]: its sink rows, then its decoded rows."""
        sink, at, n = self.parts[i]
        return tuple(torch.cat(([] if sink is None else [sink[c]]) + [self.rows[c][:, :, at:at + n]], dim=2)
                     for c in (0, 1))


def _decoded_past(pool: LayerPool, plan: StepPlan, p: RequestPlan, i: int, j: int, dtype: torch.dtype,
                  sdpa: torch.dtype, layer: str, decoded: dict[int, tuple[torch.Tensor, torch.Tensor]],
                  together: DecodedPasts | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact rows (K, V [1, H, j * G, D] in `sdpa`) that `packed_attention` would read for a prefill piece of
    block j by decoding its past densely (`_decoded_sdpa`: many query rows, no soft cap): blocks [0, j) of request i
    decoded ONCE per step and layer (up to the request's last block touched in this step, every block before it
    stored already; taken from `together` where the step's pasts were decoded together) and sliced per piece,
    instead of decoding blocks 0 .. j-1 again for every piece j of a long prompt. The rows are
    `past_view(..).dequantized(float32, dense=True)`, what `_decoded_sdpa` would compute from the packed view, so the
    attention is the same to the bit; they are kept in `sdpa`, the dtype the pieces' SDPA reads them in (cast once
    here, not once per piece)."""
    if i not in decoded:
        if together is not None and i in together.parts:
            decoded[i] = together.joined(i)
        else:
            last = (p.length - 1) // pool.layout.tile  # the last block this step touches: its past is every stored one
            full = past_view(pool, p, last, plan.sink_blocks, dtype, plan, layer)
            decoded[i] = tuple(x.dequantized(torch.float32, dense=True).to(sdpa) for x in full)
    n = j * pool.layout.tile
    return decoded[i][0][:, :, :n], decoded[i][1][:, :, :n]


def _decoded_pasts(pool: LayerPool, plan: StepPlan, requests: dict[int, RequestPlan], dtype: torch.dtype,
                   sdpa: torch.dtype, layer: str) -> DecodedPasts | None:
    """`_decoded_past`'s full pasts of the step's requests at once: their packed blocks gathered in one select and
    decoded in one call per kind, their sinks beside them. The same rows as one request at a time (each tile decodes
    alone; tests/integrations/vllm/test_paged.py), with far fewer torch calls: decoding 8 prompts' pasts one by one
    took ~11 ms a layer of a prefill step (docs/VLLM.md). None for layers with tiles kept exact or keys held aside:
    `_decoded_past` restores those tiles request by request."""
    if not requests or plan.exact or plan.held.get(layer):
        return None
    lay, g, h = pool.layout, pool.layout.tile, pool.geo.num_kv_heads
    parts, blocks = {}, []  # request -> (sink K/V or None, first row, rows of its past); the packed blocks, in order
    for i, p in requests.items():
        last = (p.length - 1) // g  # as in `_decoded_past`: every stored block before the last one touched
        sink = _sink_rows(pool, p, last, plan.sink_blocks, dtype)
        ns = 0 if sink is None else sink[0].shape[2] // g
        sink = None if sink is None else tuple(x.to(torch.float32).to(sdpa) for x in sink)  # `dequantized`'s casts
        parts[i] = (sink, len(blocks) * g, (last - ns) * g)
        blocks += p.blocks[ns:last]
    idx = torch.tensor(blocks, dtype=torch.long)
    rows = []
    for fields, q in ((pool.key_fields, lay.key_q), (pool.value_fields, lay.value_q)):  # [1, H, n * G, D] each
        if not len(idx):  # every past is exact sinks
            rows.append(torch.empty(1, h, 0, lay.head_dim, dtype=sdpa, device=pool.rows.device))
            continue
        packed = fields.select(idx).map(lambda v: v.transpose(0, 1)[None])  # [1, H, n, ...]
        view = StoredKV(None, packed, len(idx), None, _NO_EXACT, None, q, (1, h, lay.head_dim), dtype)
        rows.append(view.decode_tiles(0, len(idx), sdpa, dense=True))  # = in float32, then cast (one pass)
    return DecodedPasts((rows[0], rows[1]), parts)


def _vllm_cpu_ops(pool: LayerPool, dtype: torch.dtype, sdpa: torch.dtype, softcap: float | None):
    """`vllm_cpu_attention` for this layer's prompt pieces, or None where they keep PyTorch's SDPA:
    KVARN_PREFILL_ATTENTION=sdpa, a pool off the CPU, a soft cap, or pieces computed in another dtype than the model's
    (`prefill="float32"` for a bf16 model)."""
    if os.environ.get("KVARN_PREFILL_ATTENTION", "vllm") == "sdpa" or pool.rows.device.type != "cpu" or softcap \
            or sdpa != dtype:
        return None
    return vllm_cpu_attention(dtype, pool.layout.tile, pool.layout.head_dim)


def vllm_cpu_attention(dtype: torch.dtype, tile: int, head_dim: int):
    """vLLM's CPU attention ops (`vllm._custom_ops`) and the ISA its kernel takes for pages of `tile` rows, or None:
    no vLLM, or a head size, tile or dtype that vLLM's CPU backend does not serve."""
    try:
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, _get_attn_isa
    except ImportError:
        return None
    if not hasattr(torch.ops._C, "cpu_attention_with_kv_cache") or tile % 32 or \
            head_dim not in CPUAttentionBackend.get_supported_head_sizes() or \
            dtype not in CPUAttentionBackend.supported_dtypes:
        return None
    return ops, _get_attn_isa(dtype, tile, head_dim)


def _vllm_pieces(ops, waiting: list[tuple], together: DecodedPasts | None,
                 decoded: dict[int, tuple[torch.Tensor, torch.Tensor]], scale: float, tile: int, query: torch.Tensor,
                 output: torch.Tensor) -> None:
    """The prompt pieces with many query rows (`attend_step`'s `waiting`: request i, block j, rows, q [1, Hq, L, D],
    its block's exact rows k, v [H, t, D]; each request's past in `together` (decoded together, in parts) or
    `decoded[i]` (K, V [1, H, m * tile, D]), none for a first block) as ONE causal call of vLLM's CPU attention
    (`cpu_attention_with_kv_cache`, the kernel stock vLLM runs; 1.2x-1.8x faster than `_batched_pieces` with AMX,
    fill included: docs/VLLM.md), from the step's query [T, Hq, D] into output's rows (in place where the pieces'
    rows are one run, as a prefill step's are); `ops` from `vllm_cpu_attention`. A scratch page cache holds every
    request's decoded past once and each piece's exact block; piece (i, j) is a sequence whose block table is request
    i's first j past pages, then its own page, of length j * tile + t, its L queries the last L positions (vLLM's
    causal alignment): the same keys and mask as `_batched_pieces`, summed in another order. The pages are written
    from the rows where they lie (vLLM's fill reads strided rows): the packed pasts decoded together in one call,
    sinks and pasts decoded alone one call each, the pieces' own rows in one."""
    ops, isa = ops
    g = tile

    def rows_from(page: int, n: int) -> torch.Tensor:  # the slots of n rows written from a page's first row on
        return torch.arange(page * g, page * g + n)

    fills = []  # (K, V [r, H, D] rows where they lie, their slots in the scratch pages)
    n = 0  # pages so far
    if together is not None and together.rows[0].shape[2]:  # every packed past decoded together: pages [0, n)
        k, v = (x[0].transpose(0, 1) for x in together.rows)
        fills.append((k, v, rows_from(0, k.shape[0])))
        n = k.shape[0] // g
    past: dict[int, list[int]] = {}  # request -> its past pages, in order
    for i, *_ in waiting:
        if i in past:
            continue
        if together is not None:
            sink, at, m = together.parts[i]
            ns = 0 if sink is None else sink[0].shape[2] // g
            if ns:
                fills.append((sink[0][0].transpose(0, 1), sink[1][0].transpose(0, 1), rows_from(n, ns * g)))
            past[i] = list(range(n, n + ns)) + list(range(at // g, (at + m) // g))
            n += ns
        elif i in decoded:  # decoded one request at a time
            kp, vp = decoded[i]
            fills.append((kp[0].transpose(0, 1), vp[0].transpose(0, 1), rows_from(n, kp.shape[2])))
            past[i] = list(range(n, n + kp.shape[2] // g))
            n += kp.shape[2] // g
        else:  # a first block alone: no past
            past[i] = []
    width = max(j for _, _, j, *_ in waiting) + 1
    table = torch.tensor([past[i][:j] + [n + r] + [0] * (width - 1 - j) for r, (i, _, j, *_) in enumerate(waiting)],
                         dtype=torch.int32)  # piece r's own page: n + r
    t = [k.shape[1] for *_, k, _ in waiting]
    h, _, d = waiting[0][5].shape
    cache = torch.empty(n + len(waiting), h, 2 * g, d, dtype=waiting[0][5].dtype)  # vLLM's CPU page: G key rows,
    key_cache, value_cache = cache.chunk(2, dim=2)  # then G value rows
    part = [n + r for r, x in enumerate(t) if x < g]
    if part:  # pages a piece fills in part: zeroed (the kernel weighs whole pages, and 0 x a stale NaN is NaN)
        cache[part] = 0
    fills.append((torch.cat([k.transpose(0, 1) for *_, k, _ in waiting]),
                  torch.cat([v.transpose(0, 1) for *_, v in waiting]),
                  torch.cat([rows_from(n + r, x) for r, x in enumerate(t)])))
    for k, v, slots in fills:  # vLLM's fill reads the rows where they lie (strided) but needs each row's channels
        # adjacent, which the PyTorch decode of channel-axis tiles with none rotated leaves apart (kvarn-w2.5 on Qwen)
        k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)
    span = _span([w[3] for w in waiting])  # the pieces' rows, one run of the step's rows (a prefill step's are)
    q = query[span] if span else torch.cat([query[w[3]] for w in waiting])  # [sum L, Hq, D] (strided, as stock's)
    seq_lens = torch.tensor([j * g + x for (_, _, j, *_), x in zip(waiting, t)], dtype=torch.int32)
    start = torch.zeros(len(waiting) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor([w[4].shape[2] for w in waiting], dtype=torch.int32), 0, out=start[1:])
    meta = ops.cpu_attn_get_scheduler_metadata(num_reqs=len(waiting), num_heads=q.shape[1], num_kv_heads=h,
                                               head_dim=d, seq_lens=seq_lens, dtype=q.dtype,
                                               query_start_loc=start, causal=True, sliding_window_size=-1, isa=isa,
                                               enable_kv_split=False)
    inplace = span is not None and output.dtype == q.dtype and output[span].is_contiguous()
    out = output[span] if inplace else torch.empty_like(q)
    ops.cpu_attention_with_kv_cache(query=q, key_cache=key_cache, value_cache=value_cache, output=out,
                                    query_start_loc=start, seq_lens=seq_lens, scale=scale, causal=True,
                                    alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0.0,
                                    scheduler_metadata=meta, s_aux=None)
    if not inplace:
        for r, w in enumerate(waiting):
            output[w[3]] = out[start[r]:start[r + 1]]


def _span(rows: list) -> slice | None:
    """The one slice that consecutive row slices make up, or None (rows not slices, or not back to back)."""
    if not all(isinstance(r, slice) and r.step in (None, 1) for r in rows):
        return None
    if any(a.stop != b.start for a, b in itertools.pairwise(rows)):
        return None
    return slice(rows[0].start, rows[-1].stop)


def _batch_key(fresh: bool, j: int, q: torch.Tensor, k: torch.Tensor) -> tuple:
    """Prefill pieces with one key share one call: nothing stored before them or a decoded past, block j, query
    rows, exact rows."""
    return fresh, j, q.shape[2], k.shape[1]


def causal(plan: StepPlan | None, length: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """`allowed(None, 1, length, kv_len)`, built once per step for every layer (kept on the plan; read only)."""
    if plan is None:
        return allowed(None, 1, length, kv_len, device)
    key = (length, kv_len, device)
    if key not in plan.masks:
        plan.masks[key] = allowed(None, 1, length, kv_len, device)
    return plan.masks[key]


def _batched_pieces(plan: StepPlan, pieces: list[tuple], scale: float, softcap: float | None,
                    sdpa: torch.dtype) -> torch.Tensor:
    """Prefill pieces (rows, q [1, Hq, L, D], k, v [H, t, D], past: (K, V) rows of a decoded past, or None) of one
    `_batch_key` as one SDPA call over the batch axis in `sdpa`: [n, L, Hq, D]. A decoded past and the piece's own
    rows are copied once, into one [n, H, past + t, D] buffer: the rows `packed_attention` joins, in its order."""
    _, q, k, v, pasts = zip(*pieces)
    query = torch.cat(q)
    if pasts[0] is None:
        return packed_attention(query, torch.stack(k), torch.stack(v), None, None, scale, softcap, kernel=False,
                                sdpa_dtype=sdpa)
    keys, values = (_joined([x[c] for x in pasts], rows, sdpa) for c, rows in ((0, k), (1, v)))
    ok = causal(plan, query.shape[2], keys.shape[2], query.device)
    return sdpa_rows(query, keys, values, ok, None, scale, sdpa, causal=True)


def _joined(pasts: list[torch.Tensor], rows: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
    """[n, H, past + t, D] in dtype: piece i's past [1, H, past, D] then its rows [H, t, D]."""
    n, (h, t, d), m = len(pasts), rows[0].shape, pasts[0].shape[2]
    out = torch.empty(n, h, m + t, d, dtype=dtype, device=rows[0].device)
    for i, (past, r) in enumerate(zip(pasts, rows)):
        out[i, :, :m] = past[0]
        out[i, :, m:] = r
    return out


def _slot_rows(pool: LayerPool, p: RequestPlan, j: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Block j's exact rows so far (K, V [H, t, D]), read from its fp slot."""
    kv = pool.read_slot(p.slots[j])[:, :, :p.length - j * pool.layout.tile].to(dtype)  # [H, 2, t, D]
    return kv[:, 0], kv[:, 1]


@dataclass
class DecodeBatch:
    """The decode rows of a step (requests with one new token, whose block has an fp slot) as the index tensors of
    one kernel call, built once per step and pool geometry and shared by every layer (`decode_batch`).

    Per row b the kernel reads packed tiles table[b, :n_blocks[b]] (logical blocks ns_b .. j-1, at positions 0 ..
    of the bias) and one dense segment (at position max_tiles * G): the exact sink rows (ns_b leading sink blocks
    with an fp slot, padded to sink_blocks * G) then the current block's rows 0 .. p (padded to the batch's
    longest), read from `LayerPool.rows` through their row ids `dense_index` in place (the CPU kernel's indexed
    rows) or gathered (Triton: `kvarn.ops.decode.indexed_rows`); bias masks the padding with -inf. The table and
    the index are checked against the pool once here (`launch.check_table`, `launch.check_paged`), so the
    per-layer calls skip it."""

    requests: list[int]
    request_set: frozenset[int]
    rows: slice | torch.Tensor  # [B] rows of the step's [T, ...] tensors: a slice where consecutive (a view)
    write_blk: torch.Tensor  # [B, 2] (K, V) where the fresh rows go in `LayerPool.rows`
    write_sub: torch.Tensor
    tok: torch.Tensor | None  # [B] int64 `rows` as indices, for the CPU's one-call write (None off the CPU)
    dense_index: torch.Tensor  # [B, 2, t] int64 row ids n * R + r into `LayerPool.rows` [N, H, R, D]
    table: torch.Tensor  # [B, max_tiles] int32
    n_blocks: torch.Tensor  # [B] int32
    tiles_len: int  # max_tiles * G: the dense segment's position
    bias: torch.Tensor  # [B, 1, 1, tiles_len + t] float32
    sink_rows: int  # sink_blocks * G: the dense segment's sink part (the rest: the current block's rows)
    sink_len: torch.Tensor  # [B] valid sink rows (ns_b * G); the bias's mask as lengths, for the Triton decode
    cur_len: torch.Tensor  # [B] valid current-block rows (p + 1)
    done_blocks: list[int]  # blocks these tokens complete (stored in this step)
    done_where: list[tuple[RequestPlan, int]]  # (request, logical block) of each
    done_blk: torch.Tensor  # [n, 2, G]
    done_sub: torch.Tensor
    others: list[tuple[int, RequestPlan, int, slice, int]]  # the step's other pieces (`_pieces`), listed once


def decode_batch(plan: StepPlan, pool: LayerPool) -> DecodeBatch | None:
    """The step's `DecodeBatch` for this pool's geometry (cached on the plan), or None when the decode rows take the
    per-request path: KVARN_KERNEL=torch or a kernel that cannot serve these quantizers (`fused.take`), or no decode
    row."""
    key = (pool.n_slots, pool.rows_per_slot)
    if key in plan.batches:
        return plan.batches[key]
    batch = None
    if fused.mode() != "torch":
        lay = pool.layout
        if decode_kernel(pool.rows.device) == "triton":
            take = dispatch.take(triton_unsupported(pool), "the Triton paged decode cannot serve this pool")
        else:
            take = fused.take(fused.unsupported_quantizers(lay.key_q, lay.value_q))
        if take:
            batch = _build_batch(plan, pool)
    plan.batches[key] = batch
    return batch


def _build_batch(plan: StepPlan, pool: LayerPool) -> DecodeBatch | None:
    g, sb = plan.tile, plan.sink_blocks
    reqs, tok, cur_slot, cur_row, ns, sink_slots, tables, done, done_where, done_slots = ([] for _ in range(10))
    for i, p in enumerate(plan.requests):
        t0, t1 = p.rows
        j = p.computed // g
        if t1 - t0 != 1 or p.slots[j] is None:
            continue
        n = 0
        while n < min(j, sb) and p.slots[n] is not None:  # exact sinks up to the first evicted one
            n += 1
        reqs.append(i)
        tok.append(t0)
        cur_slot.append(p.slots[j])
        cur_row.append(p.computed % g)
        ns.append(n * g)
        sink_slots.append(p.slots[:n] + [p.slots[j]] * (sb - n))  # padding: any valid slot, masked
        tables.append(p.blocks[n:j])
        if p.length % g == 0:
            done.append(p.blocks[j])
            done_where.append((p, j))
            done_slots.append(p.slots[j])
    if not reqs:
        return None
    b = len(reqs)
    width = max(1, max(len(t) for t in tables))
    table = torch.zeros(b, width, dtype=torch.int32)
    for r, t in enumerate(tables):
        table[r, :len(t)] = torch.tensor(t, dtype=torch.int32)
    n_blocks = torch.tensor([len(t) for t in tables], dtype=torch.int32)
    cur_slot_t, cur_row_t = torch.tensor(cur_slot), torch.tensor(cur_row)
    cur = int(cur_row_t.max()) + 1
    kinds = torch.tensor([0, 1]).view(1, 2, 1)
    # dense rows: sink_blocks * G sink rows, then cur rows of the current block
    r = torch.arange(sb * g)
    slots = torch.cat([torch.tensor(sink_slots, dtype=torch.long).view(b, sb)[:, r // g] if sb else
                       torch.zeros(b, 0, dtype=torch.long), cur_slot_t[:, None].expand(b, cur)], 1)
    rows = torch.cat([r % g, torch.arange(cur)]).expand(b, -1)
    valid = torch.cat([r[None] < torch.tensor(ns)[:, None], torch.arange(cur)[None] <= cur_row_t[:, None]], 1)
    dense_blk, dense_sub = pool.slot_rows(slots[:, None], kinds, rows[:, None])
    write_blk, write_sub = pool.slot_rows(cur_slot_t[:, None], kinds[..., 0], cur_row_t[:, None])
    tiles_len = width * g
    bias = torch.zeros(b, 1, 1, tiles_len + valid.shape[1])
    bias[:, 0, 0, tiles_len:] = torch.where(valid, 0.0, float("-inf"))
    if done_slots:
        done_blk, done_sub = pool.slot_rows(torch.tensor(done_slots).view(-1, 1, 1), kinds, torch.arange(g))
    else:
        done_blk = done_sub = torch.zeros(0, 2, g, dtype=torch.long)
    dense_index = (dense_blk * pool.rows_per_slot + dense_sub).contiguous()  # [B, 2, t]
    kernel.check_table(table, n_blocks, pool.key_fields.codes.shape[0])
    kernel.check_paged(pool.rows, dense_index, tiles_len, b)
    dev = pool.rows.device  # built on the host once per step, then moved once for every layer

    def to(t: torch.Tensor) -> torch.Tensor:
        return t.to(dev, non_blocking=True)

    chosen = frozenset(reqs)
    rows = slice(tok[0], tok[0] + b) if tok == list(range(tok[0], tok[0] + b)) else to(torch.tensor(tok))
    tok_t = torch.tensor(tok) if dev.type == "cpu" else None
    return DecodeBatch(reqs, chosen, rows, to(write_blk), to(write_sub), tok_t, to(dense_index),
                       to(table), to(n_blocks), tiles_len, to(bias), sb * g,
                       to(torch.tensor(ns, dtype=torch.int32)), to(cur_row_t.to(torch.int32) + 1), done, done_where,
                       to(done_blk), to(done_sub), [x for x in _pieces(plan, g) if x[0] not in chosen])


def batched_decode(pool: LayerPool, batch: DecodeBatch, q: torch.Tensor, scale: float,
                   softcap: float | None) -> torch.Tensor:
    """One kernel call for every decode row of the step: q [B, Hq, D] -> float32 [B, Hq, D]; the kernel of the
    pool's device (`decode_kernel`)."""
    if decode_kernel(pool.rows.device) == "triton":
        k, v = indexed_rows(pool.rows, batch.dense_index)  # [B, H, t, D]: sinks and current blocks, one gather
        return triton_decode(pool, batch, q, k, v, scale, softcap)
    # the sink and current-block rows read in place through their row ids; fields, table and index checked once per
    # step by `_build_batch`
    b, hq, d = q.shape
    qf = q.float().contiguous().view(b, pool.geo.num_kv_heads, -1, d)  # a float32 q may be a strided qkv slice
    out = kernel.decode_rows(qf, *pool.tiles, batch.table, batch.n_blocks, pool.layout.tile,
                             (pool.rows, batch.dense_index, batch.tiles_len), batch.bias, scale, softcap)
    return out.view(b, hq, d)


def triton_decode(pool: LayerPool, batch: DecodeBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  scale: float, softcap: float | None) -> torch.Tensor:
    """`batched_decode` on the Triton kernels: grid (request x KV head, MAX_SPLITS) over the packed tiles read in
    place through the block table (`TileFields.from_pool`), GQA query heads as rows of their KV head's program; the
    dense segment k, v [B, H, t, D] as two exact regions of the same online softmax (`ops.merge_states`): the sinks
    (first `sink_rows`, valid up to sink_len) and the current block (valid up to cur_len), which is what the C++
    path's -inf padding bias masks. -> float32 [B, Hq, D]."""
    from kvarn.kernels.triton.attention import paged_decode
    from kvarn.kernels.triton.ops import TileFields

    if softcap:
        raise ValueError("kvarn: the Triton paged decode has no logit soft cap yet (Gemma 2-like models); run this "
                         "model without additional_config['kvarn'] on CUDA")
    s = batch.sink_rows
    exact = [(k[:, :, s:], v[:, :, s:], batch.cur_len)]
    if s:
        exact.insert(0, (k[:, :, :s], v[:, :, :s], batch.sink_len))
    return paged_decode(q.float(), TileFields.from_pool(pool.key_fields), TileFields.from_pool(pool.value_fields),
                        batch.table, batch.n_blocks, exact, scale, splits=MAX_SPLITS)
