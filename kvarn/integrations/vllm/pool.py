"""The full-precision pool: which vLLM blocks hold an exact copy, and the bytes of that copy in each layer.

A block needs an fp slot while it is a sink block (logical block < sink / G, exact for good) or the block being
filled (incomplete at the end of a step). Slots are assigned per physical block id, once per step for all layers
(`SlotTable.plan`, called by the metadata builder), so prefix-cache sharing of sink blocks shares their slot too.

Lifetimes, as the backend sees vLLM's blocks through the block tables:
  * a block whose first token is written in this step holds new content: whatever slot it held is released first;
  * a filling block that completes is quantized in this step and its slot released at the start of the next one
    (this step's layers still read its exact rows);
  * a completed block whose tile cannot be quantized in some layer (non-finite K/V, a scale or the reconstruction
    overflowing) is kept exact in that layer: the layer writes its exact rows to the block's slot (its filling slot,
    or one taken then, `take_exact`: a free slot, else the least recently used one of a block this step does not
    read) and marks it (`exact`); the slot is then kept until vLLM reuses the block, never evicted, and the read
    path restores the block from it in that layer (`paged`), as the transformers cache restores a tile kept exact.
    The slot index is taken in every layer's pool; only the marking layers use it;
  * a sink block keeps its slot after its request ends, so a prefix-cache hit finds it exact;
  * the backend is not told when a request ends, so the slot of its last (partial) block stays held until vLLM
    reuses the block or the slot is needed: when none is free, a slot of a block that this step does not touch is
    evicted, a partial block's before a sink's (vLLM never hits a partial block in its prefix cache, so a finished
    request's last block is read by nothing; a sink may be hit again, e.g. by a preempted request resuming), least
    recently used first. A later prefix-cache hit on an evicted sink block reads the block's packed copy (every
    complete block is packed, sink blocks included), with a warning, and is counted (`lost_sink_reads`); a running
    request whose filling block lost its slot (possible only if it went unscheduled while the pool was full) stops
    with an error naming the fix, never a wrong answer.
Capacity (`fp_slots_for`): between steps a running sequence holds its sink blocks and at most one block being filled
(`SEQ_FP_BLOCKS`); within a step, a request whose new tokens complete a partly filled block and start the next holds
both (the completing one until the next step), and only a prefill chunk that continues a block does that (a decode
row writes one token; speculative decoding is refused). vLLM's scheduler cuts at most one request a step at its
token budget, so one such request runs at a time, or more with `long_prefill_token_threshold`
(`backend.crossing_requests`). So `fp_slots` >= (sink blocks + 1) * max_num_seqs + crossing keeps every running
sequence's blocks (tests/integrations/vllm/test_pool_capacity.py drives the table with a scheduler of vLLM's rules
at exactly that size). Blocks kept exact come on top.

`SlotTable.stats` reports the table's state (`PoolStats`); the backend writes it to a JSON file every step when
KVARN_POOL_STATS names one (docs/VLLM.md).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvarn.attention.launch import PackedTiles
from kvarn.integrations.vllm.layout import PageGeometry
from kvarn.quant.policy import QueryEnergy, query_statistics

log = logging.getLogger("vllm.kvarn")  # a child of vLLM's logger: its handlers and format


@dataclass
class RequestPlan:
    rows: tuple[int, int]  # this request's token rows in the batch
    computed: int  # tokens already in the cache before this step
    length: int  # tokens in the cache after this step
    blocks: list[int]  # physical block id of each logical block 0 .. ceil(length / G) - 1
    slots: list[int | None]  # fp slot of each logical block (None: none; blocks >= sink read packed unless exact)


@dataclass
class StepPlan:
    requests: list[RequestPlan]
    tile: int
    sink_blocks: int
    lost_sinks: list[tuple[int, int]] = field(default_factory=list)  # (request index, logical block)
    # block -> layers in which it is kept exact (the table's live dict: a layer's store marks blocks during the step)
    exact: dict[int, set[str]] = field(default_factory=dict)
    take_exact: Callable[[int], int] | None = None  # block -> its slot, taken if it has none (`SlotTable.take_exact`)
    batches: dict = field(default_factory=dict)  # pool geometry -> paged.DecodeBatch | None, built by the first layer
    masks: dict = field(default_factory=dict)  # (L, T) -> causal mask of prefill pieces (`paged.causal`), shared
    # budget presets, the step deciding the key allocation: layer -> block -> exact keys [H, G, D] of the key tiles
    # completed in it, stored once decided (`budget`); attention reads them exact
    held: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)

    def exact_in(self, layer: str, block: int) -> bool:
        return layer in self.exact.get(block, ())


@dataclass
class Held:
    """A budget preset's key tile kept aside in the step deciding the key allocation (`budget`): its block and exact
    rows K, V [H, G, D] (its values are stored; the rows keep the block exact if its keys cannot be quantized)."""

    block: int
    keys: torch.Tensor
    values: torch.Tensor


SEQ_FP_BLOCKS = 1  # fp blocks per running sequence besides its sink blocks, between steps: the block being filled


def seq_fp_slots(sink_blocks: int) -> int:
    """fp slots per layer that one running sequence holds between steps (module docstring)."""
    return sink_blocks + SEQ_FP_BLOCKS


def fp_slots_for(sink_blocks: int, seqs: int, crossing: int = 1) -> int:
    """fp slots per layer that `seqs` running sequences can need within one step, of which at most `crossing` complete
    a partly filled block and start the next (module docstring)."""
    return seq_fp_slots(sink_blocks) * seqs + min(crossing, seqs)


@dataclass(frozen=True)
class PoolStats:
    """One worker's fp pool after the latest step's plan (`SlotTable.stats`); counts are slots per layer.

    slots = free + held; held = slots assigned to a block, of which `sinks` (kept after their request, for
    prefix-cache hits), `exact` (kept exact for good until vLLM reuses the block), `pinned` (read or written by the
    latest step: not evictable during it) and `pending` (a block that completed in the latest step: freed at the start
    of the next). `idle` = held - (sinks | exact | pinned): mostly the last partial blocks of finished requests, which
    the backend is not told about (module docstring), evicted first when the pool runs out."""

    step: int
    slots: int
    free: int
    held: int
    sinks: int
    exact: int
    pinned: int
    pending: int
    idle: int
    evictions: int
    lost_sink_reads: int

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def write_stats(path: str, stats: PoolStats, extra: dict | None = None) -> None:
    """`stats` (with this process's pid and the time, and `extra`: a budget preset's key widths,
    `budget.BudgetState.report`) as JSON at `path`, atomically: a temp file beside it, then os.replace, so a reader
    never sees a partial file."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"pid": os.getpid(), "time": round(time.time(), 3), **stats.as_dict(), **(extra or {})}, f)
    os.replace(tmp, path)


class SlotTable:
    """Block id -> fp slot, shared by every layer of one worker process."""

    def __init__(self, n_slots: int, tile: int, sink_blocks: int) -> None:
        self.n_slots, self.tile, self.sink_blocks = n_slots, tile, sink_blocks
        self.slot_of: dict[int, int] = {}
        self.sink: set[int] = set()  # blocks whose slot is a sink (kept after their request)
        self.exact: dict[int, set[str]] = {}  # blocks kept exact for good, by layer (non-finite or overflowing tiles)
        self.last_use: dict[int, int] = {}
        self.free = list(range(n_slots - 1, -1, -1))
        self.release_next: list[int] = []
        self.step = 0
        self.lost_sink_reads = 0  # prefix-cache hits on sink blocks whose exact copy was evicted
        self.evictions = 0
        self._in_use: set[int] = set()  # blocks the current step reads or writes (not evictable during it)
        self._warned = False
        # budget presets before their key allocation: sink blocks have no packed key copy yet, so their slots are
        # not evicted; `on_full` (which decides without scores) runs when only such slots could be
        self.keep_sinks = False
        self.on_full: Callable[[], None] | None = None

    def _release(self, block: int) -> None:
        s = self.slot_of.pop(block, None)
        if s is not None:
            self.free.append(s)
        self.sink.discard(block)
        self.exact.pop(block, None)
        self.last_use.pop(block, None)

    def _take(self, block: int, in_use: set[int]) -> int:
        if not self.free:
            idle = self._idle(in_use)
            if not idle and self.keep_sinks and self.on_full is not None:
                self.on_full()  # decides; the sinks get their packed copies and may go
                idle = self._idle(in_use)
            if not idle:
                raise RuntimeError(f"kvarn: all {self.n_slots} full-precision blocks are in use by running sequences; "
                                   "raise additional_config kvarn.fp_slots or lower max_num_seqs")
            victim = min(idle, key=lambda b: (b in self.sink, self.last_use.get(b, -1)))  # partial blocks first
            self._release(victim)
            self.evictions += 1
        s = self.free.pop()
        self.slot_of[block] = s
        return s

    def _idle(self, in_use: set[int]) -> list[int]:
        """Evictable blocks: an exact block has no other faithful copy (it keeps its slot until vLLM reuses the
        block), nor a sink before a budget preset's allocation (`keep_sinks`)."""
        return [b for b in self.slot_of if b not in in_use and b not in self.exact
                and not (self.keep_sinks and b in self.sink)]

    def stats(self) -> PoolStats:
        """The table's state now (`PoolStats`); O(held) set arithmetic, cheap enough for every step."""
        held = self.slot_of.keys()
        kept = self.sink | self.exact.keys() | (self._in_use & held)
        return PoolStats(step=self.step, slots=self.n_slots, free=len(self.free), held=len(held),
                         sinks=len(self.sink & held), exact=len(self.exact.keys() & held),
                         pinned=len(self._in_use & held), pending=len(set(self.release_next) & held),
                         idle=len(held - kept), evictions=self.evictions, lost_sink_reads=self.lost_sink_reads)

    def take_exact(self, block: int) -> int:
        """The slot of a block that a layer keeps exact, during the step that completed it: its own, else a free one,
        else that of an idle block this step does not read (`_take`)."""
        s = self.slot_of.get(block)
        return s if s is not None else self._take(block, self._in_use)

    def plan(self, rows: list[tuple[int, int]], computed: list[int], lengths: list[int],
             block_rows: list[list[int]]) -> StepPlan:
        """One step: assign slots for every request (lists indexed by request)."""
        self.step += 1
        for b in self.release_next:
            if b not in self.sink and b not in self.exact:
                self._release(b)
        self.release_next = []
        g, sb = self.tile, self.sink_blocks
        in_use: set[int] = set()
        # blocks read as past this step must not be evicted by this step's allocations
        for nc, bt in zip(computed, block_rows):
            in_use.update(bt[:min(nc // g, sb)])
            if nc % g:
                in_use.add(bt[nc // g])
            if self.exact:  # blocks kept exact are read from their slot
                in_use.update(b for b in bt[:nc // g] if b in self.exact)
        plans = []
        for i, (nc, n, bt) in enumerate(zip(computed, lengths, block_rows)):
            slots: list[int | None] = [None] * len(bt)
            for j in range(nc // g, len(bt)):  # written this step
                b = bt[j]
                in_use.add(b)
                if j * g >= nc:  # its first token is new: new content
                    self._release(b)
                complete = (j + 1) * g <= n
                if j < sb or not complete:
                    if b not in self.slot_of:
                        if j * g < nc:
                            raise RuntimeError(f"kvarn: block {b} (logical {j}) was partly filled in an earlier step "
                                               "but its full-precision slot was evicted while its request was not "
                                               "scheduled; raise additional_config kvarn.fp_slots")
                        self._take(b, in_use)
                    if j < sb:
                        self.sink.add(b)
                elif b in self.slot_of:  # a filling block completes: its exact rows are read this step
                    self.release_next.append(b)
                slots[j] = self.slot_of.get(b)
                self.last_use[b] = self.step
            if self.exact:
                for j in range(sb, nc // g):
                    if bt[j] in self.exact:
                        slots[j] = self.slot_of[bt[j]]
                        self.last_use[bt[j]] = self.step
            plans.append(RequestPlan(rows[i], nc, n, bt, slots))
        plan = StepPlan(plans, g, sb, exact=self.exact, take_exact=self.take_exact)
        self._in_use = in_use
        for i, p in enumerate(plans):  # sink blocks read as past
            for j in range(min(p.computed // g, sb)):
                b = p.blocks[j]
                s = self.slot_of.get(b) if b in self.sink else None
                p.slots[j] = s
                if s is None:
                    plan.lost_sinks.append((i, j))
                    self.lost_sink_reads += 1
                    if not self._warned:
                        self._warned = True
                        log.warning("kvarn: a prefix-cache hit on sink block %d found its exact copy evicted from the "
                                    "full-precision pool; its packed copy is read instead (raise kvarn.fp_slots to "
                                    "keep more sinks)", b)
                else:
                    self.last_use[b] = self.step
        return plan


OBSERVE_CHUNK = 512  # tokens of queries squared at a time (`PendingQueries.flush`)
PENDING_ROWS = 128  # query tokens a layer keeps before folding them into its statistics (`PendingQueries`)


class PendingQueries:
    """A layer's running query statistics (`QueryEnergy`, or `QueryCovariance` for query-aware keys), fed lazily.

    Folding a step's queries in takes ~10 torch calls (float, pool the GQA heads, square, sum, a finiteness check,
    add), which cost 0.1-0.2 ms per layer in a serving decode step, where every call runs cold (docs/VLLM.md), for a
    few rows. So `add` keeps a step's rows (one copy) and `flush` folds the kept rows in, in chunks of OBSERVE_CHUNK
    tokens: before anything reads the statistics (`count`, `weight`, `key_weight`, `covariance`: the tile store's key
    weight, the budget rule's weight), when PENDING_ROWS tokens wait, and at once for a step of at least that many (a
    prompt). A store thus sees every query up to its own step's, as
    when each step was folded in at once; the sums differ from that only in float32 summation order.

    Tokens with a non-finite query (or square) are left out: the mean is the engine's, for good."""

    def __init__(self, stats: QueryEnergy, kv_heads: int) -> None:
        self.stats, self.kv_heads = stats, kv_heads
        self.rows: list[torch.Tensor] = []  # [t, Hq, D] copies of the steps' queries, not folded in yet
        self.waiting = 0

    def add(self, query: torch.Tensor) -> None:
        """query [T, Hq, D], a step's queries (after RoPE, as attention sees them)."""
        t = query.shape[0]
        if not t:
            return
        if self.waiting + t > PENDING_ROWS:
            self.flush()
        if t >= PENDING_ROWS:
            self._fold(query)
        else:
            self.rows.append(query.clone())  # vLLM reuses the query buffer next step
            self.waiting += t

    def flush(self) -> None:
        if self.rows:
            rows = self.rows[0] if len(self.rows) == 1 else torch.cat(self.rows)
            self.rows, self.waiting = [], 0
            self._fold(rows)

    def _fold(self, query: torch.Tensor) -> None:
        e, h = self.stats, self.kv_heads
        t, hq, d = query.shape

        def pooled(qc: torch.Tensor) -> torch.Tensor:  # [c, Hq, D] -> [1, H, c * Hq/H, D]: heads of a group, positions
            return qc.view(-1, h, hq // h, d).transpose(0, 1).reshape(1, h, -1, d)

        total, kept = None, 0
        for c0 in range(0, t, OBSERVE_CHUNK):  # small float temporaries: a whole prompt at once took ~8x the CPU
            qc = query[c0:c0 + OBSERVE_CHUNK].float()  # [c, Hq, D]
            s = e.moments(pooled(qc))  # q^2 sums, or q q^T's for query-aware keys (`QueryCovariance`)
            if not bool(torch.isfinite(s).all()):
                qc = qc[torch.isfinite(qc.square()).flatten(1).all(1)]
                s = e.moments(pooled(qc))
            kept += qc.shape[0]
            total = s if total is None else total + s
        if kept:
            e.accumulate(total, kept * (hq // h))

    # the readers: each folds in what waits first
    @property
    def count(self) -> int:
        self.flush()
        return self.stats.count

    def weight(self) -> torch.Tensor | None:
        self.flush()
        return self.stats.weight()

    def key_weight(self) -> torch.Tensor | None:
        self.flush()
        return self.stats.key_weight()

    def covariance(self) -> torch.Tensor | None:  # `QueryCovariance` only
        self.flush()
        return self.stats.covariance()


def page_regions(kv_cache: torch.Tensor, geo: PageGeometry) -> tuple[torch.Tensor, torch.Tensor]:
    """A kvarn layer's page tensor, uint8 [num_blocks, H, G, C] (contiguous), as its two regions, zero-copy views:
    the packed runs [num_blocks, H, G * c0] (block b's tiles at [b]), then the fp slots [geo.fp_slots(num_blocks), H,
    fp block bytes] (slot s of head h: its K rows, then its V rows). The bytes are those of every block's fp share,
    gathered at the end of the tensor, so a head's sink and current-block rows lie in runs of G rows (in per-block
    shares they lay a row or a few apart by a page, and the decode kernel waited on memory: docs/VLLM.md)."""
    nb, h, g, _ = kv_cache.shape
    if not kv_cache.is_contiguous():
        raise ValueError(f"kvarn: the layer's KV cache must be one contiguous tensor, got strides {kv_cache.stride()}")
    flat = kv_cache.view(-1)
    split, slot_bytes = nb * h * g * geo.c0, geo.layout.fp_bytes
    packed = flat[:split].view(nb, h, g * geo.c0)
    return packed, flat[split:split + geo.fp_slots(nb) * h * slot_bytes].view(-1, h, slot_bytes)


class LayerPool:
    """One layer's page bytes: packed runs and fp slots, over vLLM's uint8 tensor [num_blocks, H, G, C]
    (`page_regions`)."""

    def __init__(self, kv_cache: torch.Tensor, geo: PageGeometry, queries: PendingQueries | None = None) -> None:
        lay = geo.layout
        _, h, g, c = kv_cache.shape
        if kv_cache.dtype != torch.uint8 or (h, g, c) != (geo.num_kv_heads, lay.tile, geo.c):
            raise ValueError(f"kvarn: the layer's KV cache is {kv_cache.dtype} {tuple(kv_cache.shape)}, expected uint8 "
                             f"[num_blocks, {geo.num_kv_heads}, {lay.tile}, {geo.c}]")
        self.geo, self.layout = geo, lay
        self.packed, fp = page_regions(kv_cache, geo)
        self.n_slots = fp.shape[0]
        self.key_fields, self.value_fields = lay.views(self.packed)  # name -> [num_blocks, H, *shape], zero copy
        # the fields as the decode kernel addresses them (block, head), built once: their seat arguments are cached
        self.tiles = PackedTiles.pool(self.key_fields), PackedTiles.pool(self.value_fields)
        # The fp rows as one view [n_slots, H, 2 G, D] in the fp dtype: row r of kind c (0 K, 1 V) of slot s, head h,
        # is rows[s, h, c * G + r] (`slot_rows`); kernels read them through ids s * 2G + c * G + r.
        self.rows_per_slot = 2 * lay.tile
        self.rows = fp.view(lay.fp_dtype).view(self.n_slots, h, self.rows_per_slot, lay.head_dim)
        # rotate="auto" keys: the layer's running query energy, [1, H, D] float32 sums + count, for the whole engine
        # (all requests pooled; `paged.observe_queries`, folded in lazily: `PendingQueries`); kept across pools of the
        # same layer when given (query-aware keys, `-qar` presets: the running E[q q^T] per KV head, `QueryCovariance`)
        if queries is None:
            stats = query_statistics(lay.key_q)
            queries = PendingQueries(stats, geo.num_kv_heads) if stats is not None else None
        self.queries = queries
        self.triton_store: bool | None = None  # CUDA: whether the Triton store kernel writes its tiles (`paged`)

    def slot_rows(self, slots: torch.Tensor, kind: int | torch.Tensor,
                  row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot, row-in-slot) indices into `rows` of row `row` of kind `kind` (0 K, 1 V) of fp slots `slots`
        (broadcast together): `rows[slot, :, sub]` is that row for every head, [..., H, D]."""
        slots, sub = torch.broadcast_tensors(torch.as_tensor(slots), kind * self.layout.tile + row)
        return slots.contiguous(), sub.contiguous()

    def read_slot(self, s: int) -> torch.Tensor:
        """[H, 2, G, D] (K, V) of fp slot s, a copy in the fp dtype."""
        return self.rows[s].unflatten(1, (2, self.layout.tile)).clone()

    def write_slot(self, s: int, kv: torch.Tensor) -> None:
        """kv [H, 2, G, D] in the fp dtype -> fp slot s."""
        self.rows[s] = kv.flatten(1, 2)
