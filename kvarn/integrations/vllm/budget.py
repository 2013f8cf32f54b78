"""Budget presets (kvarn-b2.5, kvarn-b3.0 and their -qar versions) in vLLM: key widths per layer, one allocation per
engine.

The transformers cache chooses per request which layers' keys take the high (4-bit) and mid (3-bit) quantizers
(`kvarn.cache.allocation`). A vLLM page holds one layout per layer for every request (prefix caching shares blocks
between requests), so the backend makes ONE allocation per engine (per worker process; each tensor-parallel rank
for its own KV heads): on the first request that completes a key tile past the sink, by the transformers cache's
rule on that request ("output": that tile's own 128 queries attending over the keys and values up to its end, values
as stored; "logit": the tile's query-weighted key error), with the engine's running query statistics as the weight
(`paged.observe_queries`). It holds for the engine's life.

Bytes. vLLM sizes the pages before any request, so the kvarn layers get pages of three classes, in layer order
(`page_classes`): h* that hold high keys, m* mid ones, the rest low ones, (h*, m*) the split of the budget that
promotes the most layers (`sized_split`); vLLM's capacity report thus counts the budget's bytes. A decision picks
among the splits these pages hold (`feasible_splits`: h <= h*, m <= h* - h + m*; a mid layer may take a high
page). vLLM binds one page tensor to each layer; once decided, the backend binds them anew (`BudgetState._bind`):
each layer takes a tensor of its class (its own when that fits), and the tensor's fp slots and value fields
move with the layer.

Before the decision:
  * values are stored as they complete (their fields lead every layout, `TileLayout`), keys are not: sink blocks'
    keys are exact in their fp slots, which are not evicted meanwhile (`SlotTable.keep_sinks`), and get their packed
    copies (read only after an eviction) when the allocation is decided;
  * the step that completes the first key tile past the sink keeps every key tile it completes aside, exact
    (`StepPlan.held`), and its attention reads them exact, as the transformers cache reads key tiles that wait in its
    tail; each layer scores the first such request (`score_layer`), and the last layer's report decides; after that
    layer's attention the tensors are bound anew and every layer stores the held keys and its sinks' keys with its
    decided quantizer (`settle`).
If the pool runs out of slots before any request is long enough to score, the engine decides without scores: every
layer at the low width (the k2v2 base), with a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kvarn.cache.allocation import OUTPUT_ROWS, output_gains, preset_allocation, promotion_gains
from kvarn.integrations.vllm.layout import PageGeometry, TileLayout
from kvarn.integrations.vllm.paged import attend_step, observe_queries, store_tiles, write_step
from kvarn.integrations.vllm.pool import Held, LayerPool, SlotTable, StepPlan, page_regions
from kvarn.presets import Preset
from kvarn.quant.affine import AffineQuantizer

log = logging.getLogger("vllm.kvarn")  # a child of vLLM's logger: its handlers and format

CLASSES = ("high", "mid", "low")


def key_quantizers(preset: Preset, head_dim: int) -> dict[str, AffineQuantizer]:
    """The budget preset's key quantizers by width class (no "mid" when it has none)."""
    out = {"high": preset.key_high(head_dim), "low": preset.quantizers(head_dim)[0]}
    if preset.key_mid is not None:
        out["mid"] = preset.key_mid(head_dim)
    return out


def splits_of(preset: Preset, n: int, head_dim: int) -> tuple[tuple[int, int], ...]:
    """Every (high layers, mid layers) the budget allows over n quantized layers (the transformers cache's)."""
    if preset.picks_best:
        return tuple(preset.key_splits(n, head_dim))
    return ((preset.promoted_layers(n), preset.mid_layers(n, head_dim)),)


def sized_split(preset: Preset, n: int, head_dim: int) -> tuple[int, int]:
    """(h*, m*): the split the pages are sized for, the one that promotes the most layers (then the most high ones):
    the split the transformers cache chose on every request of the task runs recorded on Qwen2.5-Coder (docs/tasks:
    (0, 8) at 2.5 bits, (8, 16) at 3.0, 24 layers), which pages sized for the most high layers ((4, 0), (16, 0))
    cannot hold (docs/TASKS.md, "... task accuracy through vLLM")."""
    return max(splits_of(preset, n, head_dim), key=lambda s: (s[0] + s[1], s[0]))


def page_classes(preset: Preset, n: int, head_dim: int) -> list[str]:
    """The width class of each of n kvarn layers' pages, in layer order: h* "high", m* "mid", the rest "low"."""
    h, m = sized_split(preset, n, head_dim)
    return ["high"] * h + ["mid"] * m + ["low"] * (n - h - m)


def feasible_splits(splits: Sequence[tuple[int, int]], high_pages: int, mid_pages: int) -> list[tuple[int, int]]:
    """The splits the pages hold: h high layers on high pages, m mid layers on the high pages left and the mid ones."""
    return [(h, m) for h, m in splits if h <= high_pages and m <= high_pages - h + mid_pages]


def layouts(preset: Preset, head_dim: int, fp_dtype: torch.dtype) -> dict[str, TileLayout]:
    """One `TileLayout` per width class."""
    return {c: TileLayout(preset, head_dim, fp_dtype, q) for c, q in key_quantizers(preset, head_dim).items()}


def extra_page_bytes(preset: Preset, n: int, num_kv_heads: int, head_dim: int, fp_dtype: torch.dtype) -> int:
    """What one block costs in the n kvarn layers beyond n low pages (the high and mid classes' packed bytes)."""
    lay = layouts(preset, head_dim, fp_dtype)
    return sum(num_kv_heads * lay["low"].tile * (lay[c].c0 - lay["low"].c0) for c in page_classes(preset, n, head_dim))


def class_counts(preset: Preset, n: int, head_dim: int) -> str:
    """The page classes of n layers, for the start-up log: e.g. "5 high, 1 mid, 24 low"."""
    classes = page_classes(preset, n, head_dim)
    return ", ".join(f"{classes.count(c)} {c}" for c in CLASSES)


def class_spec_bytes(specs: dict, preset: Preset, e: int, fp_dtype: torch.dtype) -> dict[str, int]:
    """Layer name -> bytes per token slot and head (`state_content_bytes`) of its page class, for the kvarn layers of
    a worker's spec dict in its order (what vLLM then sizes each layer's tensor with)."""
    if not specs:
        return {}
    head_dim = next(iter(specs.values())).head_size
    lay = layouts(preset, head_dim, fp_dtype)
    return {name: lay[c].c0 + e for name, c in zip(specs, page_classes(preset, len(specs), head_dim))}


class BudgetState:
    """One engine's key allocation over its kvarn layers (per worker process) and the pools it binds them to.

    names      the kvarn layers in model order (the allocation's layer i is names[i])
    tensors    vLLM's uint8 page tensor of each, [num_blocks, H, G, C_i] (C_i: its class's packed bytes + e)
    e          the fp pool share's bytes per token slot, the same in every tensor
    """

    def __init__(self, preset: Preset, names: Sequence[str], tensors: Sequence[torch.Tensor], head_dim: int, e: int,
                 fp_dtype: torch.dtype, table: SlotTable) -> None:
        self.preset, self.names, self.e, self.table = preset, tuple(names), e, table
        self.tensors = list(tensors)
        self.num_kv_heads, self.tile = tensors[0].shape[1], tensors[0].shape[2]
        self.index = {n: i for i, n in enumerate(self.names)}
        self.layouts = layouts(preset, head_dim, fp_dtype)
        self.page_class: list[str] = []  # per tensor: the widest key class its packed part holds
        self.pools: dict[str, LayerPool] = {}
        self.bound: list[int] = list(range(len(self.names)))  # layer i -> tensor index
        self.stash: dict[str, dict[int, list[torch.Tensor]]] = {n: {} for n in self.names}  # block sb's queries
        self.held: dict[str, list[Held]] = {}
        self.settled = False
        preset, n = self.preset, len(self.names)
        by_c0 = {lay.c0: c for c, lay in self.layouts.items()}
        for t, name in zip(self.tensors, self.names):
            c0 = t.shape[-1] - self.e
            if c0 not in by_c0:
                raise ValueError(f"kvarn: layer {name}'s page holds {c0} packed bytes per token slot, none of the "
                                 f"budget preset's widths ({sorted(by_c0)})")
            self.page_class.append(by_c0[c0])
        high_pages = self.page_class.count("high")
        mid_pages = self.page_class.count("mid")
        splits = feasible_splits(splits_of(preset, n, head_dim), high_pages, mid_pages)
        if (high_pages, mid_pages) != sized_split(preset, n, head_dim):
            log.warning("kvarn: budget preset %s: vLLM allocated %d high and %d mid key pages of the %s sized; the "
                        "allocation chooses among the splits those hold", preset.name, high_pages, mid_pages,
                        sized_split(preset, n, head_dim))
        self.allocation = preset_allocation(preset, range(n), head_dim, splits)
        for i, name in enumerate(self.names):
            self.pools[name] = self._pool(i, self.layouts["low"], None)

    def _geometry(self, t: torch.Tensor, layout: TileLayout) -> PageGeometry:
        """Tensor t's page (its class's packed bytes + the shared e) holding `layout`'s tiles."""
        return PageGeometry(layout, self.num_kv_heads, self.e, t.shape[-1] - self.e)

    def _pool(self, i: int, layout: TileLayout, keep: LayerPool | None) -> LayerPool:
        t = self.tensors[self.bound[i]]
        return LayerPool(t, self._geometry(t, layout), keep.queries if keep is not None else None)

    @property
    def decided(self) -> bool:
        return self.allocation.decided

    def pool(self, name: str) -> LayerPool:
        return self.pools[name]

    # --- before the decision -------------------------------------------------------------------------------------

    def scoring_request(self, plan: StepPlan) -> int | None:
        """The request of this step that completes the first key tile past the sink (the first such), or None."""
        end = (plan.sink_blocks + 1) * plan.tile
        for i, p in enumerate(plan.requests):
            if p.computed < end <= p.length:
                return i
        return None

    def stash_queries(self, name: str, plan: StepPlan, query: torch.Tensor) -> None:
        """Keep the queries of block sink_blocks (the tile the "output" rule scores with) until it completes."""
        g, sb = plan.tile, plan.sink_blocks
        lo, hi = sb * g, (sb + 1) * g
        mine = self.stash[name]
        for p in plan.requests:
            t0, _ = p.rows
            a, b = max(p.computed, lo), min(p.length, hi)
            if a >= b:
                continue
            block = p.blocks[sb]
            if p.computed <= lo:  # the block's first token is new: new content
                mine[block] = []
            mine.setdefault(block, []).append(query[t0 + a - p.computed:t0 + b - p.computed].float())

    def score_layer(self, name: str, pool: LayerPool, plan: StepPlan, i: int,
                    exact: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> None:
        """Layer `name`'s gains on request i's first tile past the sink, reported to the allocation."""
        a = self.allocation
        p = plan.requests[i]
        g, sb = plan.tile, plan.sink_blocks
        keys, values = [], []
        for j in range(sb + 1):
            if (i, j) in exact:
                k, v = exact[(i, j)]
            else:  # a sink block of an earlier step: exact in its slot (not evicted before the decision)
                kv = pool.read_slot(p.slots[j]).to(dtype)
                k, v = kv[:, 0], kv[:, 1]
            keys.append(k)
            values.append(v)
        # values as stored (they were, this step): what the transformers cache's values.full() gives its rule
        idx = torch.tensor([p.blocks[sb]], dtype=torch.long, device=pool.packed.device)
        values[sb] = pool.layout.value_q.decode(pool.value_fields.select(idx).flatten(2), dtype)
        k = torch.cat(keys, 1)[None]  # [1, H, (sb + 1) G, D]
        v = torch.cat(values, 1)[None]
        w = pool.queries.weight() if pool.queries is not None else None
        highs = (a.high, a.mid) if a.scores_mid else (a.high,)
        block_q = self.stash[name].pop(p.blocks[sb], [])
        if a.rule == "output" and block_q:
            q = torch.cat(block_q)[-OUTPUT_ROWS:].to(dtype).transpose(0, 1)[None]  # [1, Hq, G, D]
            gains = output_gains(q, k, v, sb * g, w, a.low, highs, OUTPUT_ROWS)
        else:
            gains = promotion_gains(k[:, :, sb * g:], w, a.low, highs)
        a.report(self.index[name], *gains)

    def hold(self, name: str, plan: StepPlan, done: Sequence[Held]) -> None:
        """Key tiles completed in the deciding step (not stored yet): their exact keys are what attention reads."""
        self.held.setdefault(name, []).extend(done)
        plan.held.setdefault(name, {}).update({h.block: h.keys for h in done})

    def decide_unscored(self) -> None:
        """No request long enough to score before the pool ran out: the layers not scored yet report no gain (ties
        go to the lower layers), and the allocation is decided and settled now."""
        a = self.allocation
        if not a.decided:
            log.warning("kvarn: budget preset %s: the full-precision pool filled up before any request reached %d "
                        "tokens (sink + one tile) to choose key widths on; they are chosen without scores",
                        self.preset.name, self.table.sink_blocks * self.tile + self.tile)
            for i in range(len(self.names)):
                a.report(i, 0.0, 0.0 if a.scores_mid else None)
        self.settle()

    # --- the decision --------------------------------------------------------------------------------------------

    def width(self, i: int) -> str:
        a = self.allocation
        return "high" if i in a.promoted else "mid" if i in a.middle else "low"

    def _bind(self) -> None:
        """Each layer onto a tensor of its width class (its own when that holds it), moving the tensor's fp slots
        and value fields (stored before the decision) with the layer."""
        rank = {c: r for r, c in enumerate(CLASSES)}  # 0 widest
        n = len(self.names)
        free = set(range(n))
        new = [-1] * n
        order = sorted(range(n), key=lambda i: rank[self.width(i)])
        for i in order:
            need = rank[self.width(i)]
            own = self.bound[i]
            fits = [t for t in free if rank[self.page_class[t]] <= need]
            t = own if own in fits else max(fits, key=lambda t: (rank[self.page_class[t]], -t))
            free.discard(t)
            new[i] = t
        # what holds data yet: the values of the blocks completed before the decision (sinks kept in the pool, the
        # deciding step's tiles) and the fp slots in use; only those rows move (not whole tensors)
        t = self.table
        done = {b for b in t.slot_of if b in t.sink} | {h.block for held in self.held.values() for h in held}
        dev = self.tensors[0].device
        slots = torch.tensor(sorted(set(t.slot_of.values())), dtype=torch.long, device=dev)
        blocks = torch.tensor(sorted(done), dtype=torch.long, device=dev)
        low = self.layouts["low"]
        values_end = max(f.offset + f.nbytes for f in low.fields if f.kind == "values")

        def regions(k: int) -> tuple[torch.Tensor, torch.Tensor]:  # tensor k's packed runs and fp slots
            return page_regions(self.tensors[k], self._geometry(self.tensors[k], low))

        moved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (values, fp slots) rows, copies
        for i in range(n):
            if new[i] != self.bound[i]:
                packed, fp = regions(self.bound[i])
                moved[i] = (packed[blocks, :, :values_end], fp[slots])
        for i, (vals, rows) in moved.items():
            packed, fp = regions(new[i])
            packed[blocks, :, :values_end] = vals
            fp[slots] = rows
        self.bound = new

    def settle(self) -> None:
        """Once decided: bind the tensors, then store every layer's held key tiles and its sinks' keys (from their
        fp slots) with its quantizer. A tile that cannot be quantized keeps its block exact (`SlotTable.exact`)."""
        if self.settled or not self.decided:
            return
        self._bind()
        t = self.table
        sinks = sorted((b, s) for b, s in t.slot_of.items() if b in t.sink)
        for i, name in enumerate(self.names):
            old = self.pools[name]
            pool = self.pools[name] = self._pool(i, self.layouts[self.width(i)], old)
            held = self.held.get(name, [])
            blocks = [h.block for h in held] + [b for b, _ in sinks]
            if not blocks:
                continue
            ks, vs = [h.keys for h in held], [h.values for h in held]
            for _, s in sinks:
                kv = pool.read_slot(s)  # [H, 2, G, D]
                ks.append(kv[:, 0])
                vs.append(kv[:, 1])
            k, v = torch.stack(ks), torch.stack(vs)
            bad = store_tiles(pool, k, v, blocks, kinds=("keys",))
            for n_ in bad.nonzero().flatten().tolist():
                b = blocks[n_]
                s = t.take_exact(b)
                pool.write_slot(s, torch.stack([k[n_], v[n_]], 1).to(pool.layout.fp_dtype))
                t.exact.setdefault(b, set()).add(name)  # the next plans read it from that slot
        self.held.clear()
        self.stash = {n: {} for n in self.names}
        t.keep_sinks = False
        self.settled = True
        log.info("kvarn: budget preset %s: key widths decided, %s", self.preset.name, self.summary())

    def report(self) -> dict:
        """The key allocation for the pool stats file (`pool.write_stats`): "key_bits" per kvarn layer in model order
        (None until decided) and the layers' names."""
        bits = ([self.layouts[self.width(i)].key_q.config.bits for i in range(len(self.names))] if self.decided
                else None)
        return {"key_bits": bits, "key_layers": list(self.names)}

    def summary(self) -> str:
        widths = [self.width(i) for i in range(len(self.names))]
        bits = {c: self.layouts[c].key_q.config.bits for c in self.layouts}
        return ", ".join(f"{widths.count(c)} layers {bits[c]}-bit keys" for c in CLASSES if c in bits) + (
            f" (high: {sorted(i for i, w in enumerate(widths) if w == 'high')}, mid: "
            f"{sorted(i for i, w in enumerate(widths) if w == 'mid')})")


def step_layer(bud: BudgetState, name: str, plan: StepPlan, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, output: torch.Tensor, scale: float, softcap: float | None,
               prefill: str = "model") -> None:
    """One kvarn layer's step under a budget preset (the backend's forward): query [T, Hq, D], key, value [T, H, D]
    -> output [T, Hq, D]: the layer's store and attention over the pool the allocation binds it to; before the
    decision, the first tile past the sink scored with its keys held exact (module docstring)."""
    pool = bud.pool(name)
    observe_queries(pool, query)  # kvarn-auto: before this step's key tiles are quantized
    waiting = not bud.decided
    if waiting:
        bud.stash_queries(name, plan, query)
    exact = write_step(pool, plan, key, value, name, (lambda done: bud.hold(name, plan, done)) if waiting else None)
    scoring = bud.scoring_request(plan) if waiting else None
    if scoring is not None:
        bud.score_layer(name, pool, plan, scoring, exact, query.dtype)
    attend_step(pool, plan, query, output, exact, scale, softcap, name, prefill)
    bud.settle()  # a no-op until the last layer's report decided, and after
