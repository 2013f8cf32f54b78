"""The paged kvarn cache without vLLM: fp-slot bookkeeping, page bytes, and attention against a float64 oracle.

A small engine stand-in drives `SlotTable.plan` + `write_step` + `attend_step` over a fake uint8 page pool with
chunked prefills, decodes, several requests per step, a prefix shared through the block table and block reuse.

Oracle (float64, plain): a query at position p of logical block j attends to blocks < j as stored (sink blocks
exact, the others `decode(encode(tile))` with the same quantizers) and to the exact rows of block j up to p.
Both read paths are checked (`read_path`): KVARN_KERNEL=torch (packed_attention over fields gathered through the
block table) and KVARN_KERNEL=cpu (the fused C++ kernel over the pool's zero-copy field views for every decode-like
piece with a packed block; prefill pieces take PyTorch under every mode). Tolerance, both: the backend computes in
float32 from fp16 scales that the oracle decodes identically, so the only difference is float32 vs float64
accumulation over <= 96 keys of magnitude ~N(0, 1): outputs agree to 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from kvarn.integrations.vllm import paged
from kvarn.integrations.vllm.layout import FP_SHARE_MAX, PageGeometry, TileLayout, choose_geometry, choose_pool
from kvarn.integrations.vllm.paged import attend_step, write_step
from kvarn.integrations.vllm.pool import (
    OBSERVE_CHUNK,
    PENDING_ROWS,
    LayerPool,
    PendingQueries,
    SlotTable,
    page_regions,
)
from kvarn.presets import Preset, affine_preset
from kvarn.presets.family import widths_preset

G, D, H, HQ = 16, 16, 2, 4


def _count_kernel_calls(monkeypatch, calls: list) -> None:
    """Count the fused kernel's calls: pieces (`decode_attention`) and batched decode rows (`decode_rows`)."""
    for name in ("decode_attention", "decode_rows"):
        real = getattr(paged.kernel, name)
        monkeypatch.setattr(paged.kernel, name, lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))


@pytest.fixture(params=["torch", "cpu"])
def read_path(request, monkeypatch):
    """KVARN_KERNEL for the test; under "cpu", counts the kernel's calls (the test asserts it served some)."""
    calls = []
    if request.param == "cpu":
        if not paged.kernel.available():
            from kvarn.kernels.cpu.build import error

            pytest.skip(f"the CPU kernel cannot be built here: {error()}")
        _count_kernel_calls(monkeypatch, calls)
    monkeypatch.setenv("KVARN_KERNEL", request.param)
    yield calls
    assert bool(calls) == (request.param == "cpu")


class Engine:
    """Blocks handed out like vLLM's pool (free list, shared prefix blocks), one layer, float32 (or `dtype`)."""

    def __init__(self, preset_bits=(4, 2), sink_blocks: int = 1, num_blocks: int = 64, e: int = 32,
                 family: str = "kvarn", rounding: str = "nearest", dtype: torch.dtype = torch.float32,
                 clip: tuple[float, float] = (1.0, 1.0), preset: Preset | None = None) -> None:
        preset = preset or affine_preset(family, *preset_bits, G, rounding=rounding, clip=clip)
        self.dtype = dtype  # the model's: keys, values and queries are rounded to it
        self.prefill = "model"  # additional_config['kvarn']['prefill']
        self.lay = TileLayout(preset, D, dtype)
        assert e in self.lay.share_choices(), e
        geo = PageGeometry(self.lay, H, e)
        self.geo = geo
        self.kv = torch.zeros(num_blocks, H, G, geo.c, dtype=torch.uint8)
        self.pool = LayerPool(self.kv, geo)
        self.table = SlotTable(self.pool.n_slots, G, sink_blocks)
        self.sink_blocks = sink_blocks
        self.free = list(range(1, num_blocks))  # block 0 is vLLM's null block
        self.blocks: dict[str, list[int]] = {}
        self.hist: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # K, V, Q [T, H(q), D] so far
        self.poison: dict[str, list[tuple[int, str, int, int, float]]] = {}  # rid -> (position, "k"/"v", head, ch, x)
        self.exact: dict[str, set[int]] = {}  # rid -> logical blocks the oracle reads exact (poisoned ones)
        # kvarn-auto: the oracle's running q^2 per KV head (float64, every request pooled) and, per stored key tile, the
        # mean up to and including the step that completed it: the weight the oracle encodes that tile with
        self.q_scale: torch.Tensor | None = None  # [HQ, D] multiplies the stand-in's queries (channel energies)
        self.q_mix: torch.Tensor | None = None  # [D, D] mixes their channels (correlated queries: -qar presets)
        self.energy, self.energy_count = torch.zeros(H, D, dtype=torch.float64), 0
        self.cov = torch.zeros(H, D, D, dtype=torch.float64)  # -qar: the running sum of q q^T per KV head
        self.tile_weight: dict[tuple[str, int], torch.Tensor] = {}
        self.tile_cov: dict[tuple[str, int], torch.Tensor] = {}
        self.stale_weight: dict[tuple[str, int], torch.Tensor | None] = {}  # the mean before that step (for a check)

    def add(self, rid: str, shared_from: tuple[str, int] | None = None) -> None:
        self.blocks[rid] = []
        empty = (torch.zeros(0, H, D), torch.zeros(0, H, D), torch.zeros(0, HQ, D))
        if shared_from is not None:  # a prefix-cache hit: the first n complete blocks of another request
            src, n = shared_from
            self.blocks[rid] = list(self.blocks[src][:n])
            for seen in (self.tile_weight, self.stale_weight, self.tile_cov):  # shared tiles as their writer made them
                seen.update({(rid, j): seen[(src, j)] for j in range(n) if (src, j) in seen})
            k, v, q = self.hist[src]
            empty = (k[:n * G], v[:n * G], q[:n * G])
        self.hist[rid] = empty

    def finish(self, rid: str) -> None:
        self.free.extend(b for b in self.blocks.pop(rid) if all(b not in bl for bl in self.blocks.values()))

    def step(self, work: dict[str, int], gen: torch.Generator) -> dict[str, torch.Tensor]:
        """work: request -> new tokens this step. Returns each request's attention output [t, HQ, D]."""
        rows, computed, lengths, block_rows, keys, values, queries = [], [], [], [], [], [], []
        at = 0
        for rid, t in work.items():
            k_old, v_old, q_old = self.hist[rid]
            nc = k_old.shape[0]
            while len(self.blocks[rid]) * G < nc + t:
                self.blocks[rid].append(self.free.pop(0))
            k, v = torch.randn(t, H, D, generator=gen), torch.randn(t, H, D, generator=gen)
            k[:, 0, 3] *= 8  # one heavy key channel, as real models have
            for pos, kind, h, c, x in self.poison.get(rid, ()):
                if nc <= pos < nc + t:
                    (k if kind == "k" else v)[pos - nc, h, c] = x
                    self.exact.setdefault(rid, set()).add(pos // G)
            q = torch.randn(t, HQ, D, generator=gen)
            if self.q_scale is not None:
                q = q * self.q_scale
            if self.q_mix is not None:
                q = q @ self.q_mix
            k, v, q = k.to(self.dtype), v.to(self.dtype), q.to(self.dtype)
            self.hist[rid] = (torch.cat([k_old, k]), torch.cat([v_old, v]), torch.cat([q_old, q]))
            rows.append((at, at + t))
            at += t
            computed.append(nc)
            lengths.append(nc + t)
            block_rows.append(list(self.blocks[rid]))
            keys.append(k)
            values.append(v)
            queries.append(q)
        plan = self.table.plan(rows, computed, lengths, block_rows)
        key, value, query = torch.cat(keys), torch.cat(values), torch.cat(queries)
        # as vLLM passes them: views of one fused qkv output, strided along the tokens
        qkv = torch.cat([query.flatten(1), key.flatten(1), value.flatten(1)], 1)
        query, key, value = (x.view(-1, n, D) for x, n in zip(qkv.split([HQ * D, H * D, H * D], 1), (HQ, H, H)))
        stale = (self.energy / self.energy_count).float() if self.energy_count else None
        self.energy += query.double().square().view(-1, H, HQ // H, D).sum((0, 2))
        self.energy_count += query.shape[0] * (HQ // H)
        grouped = query.double().view(-1, H, HQ // H, D).transpose(0, 1).reshape(H, -1, D)
        self.cov += grouped.transpose(1, 2) @ grouped
        for rid, nc, n in zip(work, computed, lengths):  # key tiles this step completes: weighed with this step's mean
            for j in range(nc // G, n // G):
                self.tile_weight[(rid, j)] = (self.energy / self.energy_count).float()
                self.tile_cov[(rid, j)] = (self.cov / self.energy_count).float()
                self.stale_weight[(rid, j)] = stale
        out = torch.zeros_like(query)
        paged.observe_queries(self.pool, query)  # as the backend's forward: before the step's tiles are stored
        exact = write_step(self.pool, plan, key, value, "test")
        attend_step(self.pool, plan, query, out, exact, D ** -0.5, None, "test", self.prefill)
        return {rid: out[r0:r1] for rid, (r0, r1) in zip(work, rows)}

    def oracle(self, rid: str, first: int) -> torch.Tensor:
        """float64 outputs of positions [first, T) of request rid."""
        k, v, q = (x.double() for x in self.hist[rid])
        t = k.shape[0]
        kd, vd = k.clone(), v.clone()
        for j in set(range(self.sink_blocks, t // G)) - self.exact.get(rid, set()):  # complete blocks as stored
            sl = slice(j * G, (j + 1) * G)
            for full, dq, quant in ((k, kd, self.lay.key_q), (v, vd, self.lay.value_q)):
                w = self.tile_weight[(rid, j)] if quant.takes_weight and quant is self.lay.key_q else None
                if getattr(quant, "takes_covariance", False):
                    w = self.tile_cov[(rid, j)]
                dq[sl] = quant.decode(quant.encode(full[sl].transpose(0, 1).float(), w)).double().transpose(0, 1)
        out = torch.zeros(t - first, HQ, D, dtype=torch.float64)
        for p in range(first, t):
            j = p // G
            keys = torch.cat([kd[:j * G], k[j * G:p + 1]])  # [n, H, D]
            vals = torch.cat([vd[:j * G], v[j * G:p + 1]])
            for hq in range(HQ):
                h = hq // (HQ // H)
                w = torch.softmax(keys[:, h] @ q[p, hq] * D ** -0.5, dim=0)
                out[p - first, hq] = w @ vals[:, h]
        return out


def _check(eng: Engine, outs: dict[str, torch.Tensor]) -> None:
    for rid, o in outs.items():
        t = eng.hist[rid][0].shape[0]
        ref = eng.oracle(rid, t - o.shape[0])
        torch.testing.assert_close(o.double(), ref, rtol=1e-4, atol=1e-4, equal_nan=True, msg=f"request {rid}")


@pytest.mark.parametrize("sink_blocks", [0, 1])
def test_prefill_pieces_of_one_shape_share_a_call(sink_blocks: int, monkeypatch) -> None:
    """Pieces served by SDPA over their decoded past (or over no past: first blocks) that have one shape (block j of
    equally long chunks of several requests in one step) go as one batch: the outputs match the float64 oracle and
    equal, bit for bit (at these sizes), the run in which every piece has its own call; a piece of another shape keeps
    its own."""
    import kvarn.attention.packed as packed_mod

    monkeypatch.setattr(packed_mod, "FOLD_MAX_ROWS", 8)
    monkeypatch.setenv("KVARN_KERNEL", "torch")
    real = paged.packed_attention

    def run(alone: bool) -> tuple[list[dict[str, torch.Tensor]], list[int]]:
        batches = []
        with monkeypatch.context() as m:
            m.setattr(paged, "packed_attention", lambda q, *a, **k: batches.append(q.shape[0]) or real(q, *a, **k))
            if alone:
                m.setattr(paged, "_batch_key", lambda *a: object())  # every piece a key of its own
            gen = torch.Generator().manual_seed(7)
            eng = Engine(sink_blocks=sink_blocks)
            for rid in "abc":
                eng.add(rid)
            outs = []
            for work in ({"a": 3 * G + 5, "b": 3 * G + 5, "c": 2 * G},  # a, b: the same shapes; c: shorter
                         {"a": 1, "b": G, "c": G}):  # b, c: blocks 3 and 2, pasts of other lengths: own calls
                outs.append(eng.step(work, gen))
                _check(eng, outs[-1])
        return outs, batches

    apart, single = run(True)
    together, batches = run(False)
    for x, y in zip(together, apart):
        assert x.keys() == y.keys() and all(torch.equal(x[r], y[r]) for r in x)
    assert max(single) == 1 and max(batches) == 3 and sum(batches) == sum(single)


@pytest.mark.parametrize(("prefill", "sdpa"), [("model", torch.bfloat16), ("float32", torch.float32)])
def test_bf16_prefill_reads_its_past_in_bf16(prefill: str, sdpa: torch.dtype, monkeypatch) -> None:
    """A bf16 model: prefill pieces over a decoded past run SDPA in bf16 (as stock vLLM reads its bf16 pages), or in
    float32 with additional_config['kvarn']['prefill'] = "float32"; the outputs, decode rows included, match the
    float64 oracle of the same bf16 inputs to bf16 rounding either way (2^-7, absolute and relative: the output's own
    rounding is 2^-9 relative, the decoded past's another 2^-9). An unknown value is refused by name."""
    from kvarn.integrations.vllm.config import parse

    assert parse({"preset": "kvarn-k2v2-g128", "prefill": prefill}).prefill == prefill
    assert parse({"preset": "kvarn-k2v2-g128"}).prefill == "model"
    with pytest.raises(ValueError, match="prefill must be one of"):
        parse({"preset": "kvarn-k2v2-g128", "prefill": "fp16"})
    import kvarn.attention.packed as packed_mod
    import kvarn.integrations.vllm.paged as paged_mod

    monkeypatch.setattr(packed_mod, "FOLD_MAX_ROWS", 8)
    seen = []
    real = packed_mod.sdpa_rows
    spy = lambda *a, **kw: seen.append(a[6]) or real(*a, **kw)  # noqa: E731  (a[6]: the SDPA's dtype)
    for mod in (packed_mod, paged_mod):  # pieces with no past (through packed_attention), pieces over a decoded one
        monkeypatch.setattr(mod, "sdpa_rows", spy)
    gen = torch.Generator().manual_seed(11)
    eng = Engine(dtype=torch.bfloat16)
    eng.prefill = prefill
    eng.add("a")
    eng.add("b")
    for work in ({"a": 3 * G + 2, "b": 2 * G}, {"a": 1, "b": G + 4}, {"a": 1, "b": 1}):
        for rid, o in eng.step(work, gen).items():
            ref = eng.oracle(rid, eng.hist[rid][0].shape[0] - o.shape[0])
            torch.testing.assert_close(o.double(), ref, rtol=2 ** -7, atol=2 ** -7, msg=f"request {rid}")
    assert seen and set(seen) == {sdpa}


@pytest.mark.parametrize("sink_blocks", [0, 1, 2])
def test_chunked_prefill_decode_and_batching_match_oracle(sink_blocks: int, read_path) -> None:
    gen = torch.Generator().manual_seed(1)
    eng = Engine(sink_blocks=sink_blocks)
    eng.add("a")
    eng.add("b")
    _check(eng, eng.step({"a": 21}, gen))  # a: 1 full block + 5 rows
    _check(eng, eng.step({"a": 30, "b": 7}, gen))  # a crosses two block ends in one chunk; b starts
    for _ in range(12):  # decode both; a completes block 3 along the way
        _check(eng, eng.step({"a": 1, "b": 1}, gen))
    _check(eng, eng.step({"b": 40}, gen))  # b: a long chunk while a is not scheduled
    _check(eng, eng.step({"a": 1, "b": 1}, gen))


def test_outputs_do_not_depend_on_chunking(read_path) -> None:
    """The same tokens fed as one prefill or as ragged chunks give the same codes (bit for bit) and outputs."""
    runs = []
    for chunks in ([50], [7, 9, 16, 1, 17], [1] * 50):
        gen = torch.Generator().manual_seed(7)
        eng = Engine(sink_blocks=1)
        eng.add("r")
        k = torch.randn(50, H, D, generator=gen)
        v = torch.randn(50, H, D, generator=gen)
        q = torch.randn(50, HQ, D, generator=gen)
        outs, at = [], 0
        for c in chunks:  # feed fixed tensors instead of the stand-in's random ones
            eng.hist["r"] = (k[:at], v[:at], q[:at])
            while len(eng.blocks["r"]) * G < at + c:
                eng.blocks["r"].append(eng.free.pop(0))
            plan = eng.table.plan([(0, c)], [at], [at + c], [list(eng.blocks["r"])])
            o = torch.zeros(c, HQ, D)
            exact = write_step(eng.pool, plan, k[at:at + c], v[at:at + c], "t")
            attend_step(eng.pool, plan, q[at:at + c], o, exact, D ** -0.5, None, "t")
            outs.append(o)
            at += c
        pages = eng.pool.packed[torch.tensor(eng.blocks["r"][1:3])].clone()  # the two packed (non-sink) blocks
        runs.append((torch.cat(outs), pages))
    for out, pages in runs[1:]:
        assert torch.equal(pages, runs[0][1])
        torch.testing.assert_close(out, runs[0][0], rtol=1e-5, atol=1e-5)


def test_prefill_pieces_take_pytorch_under_kvarn_kernel_cpu(monkeypatch) -> None:
    """KVARN_KERNEL=cpu: pieces of more than fused.MAX_QUERIES queries (lowered to 4 here, as G = 16 pieces never
    exceed the real 16) take the PyTorch path instead of failing; the decode pieces take the kernel."""
    from kvarn.attention import fused

    if not paged.kernel.available():
        pytest.skip("the CPU kernel cannot be built here")
    calls = []
    _count_kernel_calls(monkeypatch, calls)
    monkeypatch.setattr(fused, "MAX_QUERIES", 4)
    monkeypatch.setenv("KVARN_KERNEL", "cpu")
    gen = torch.Generator().manual_seed(2)
    eng = Engine(sink_blocks=1)
    eng.add("a")
    _check(eng, eng.step({"a": 40}, gen))  # pieces of 16, 16 and 8 queries: PyTorch
    assert not calls
    for _ in range(3):
        _check(eng, eng.step({"a": 1}, gen))
    assert len(calls) == 3


def test_prefix_sharing_reads_shared_blocks_and_reuse_resets_them(read_path) -> None:
    gen = torch.Generator().manual_seed(3)
    eng = Engine(sink_blocks=1)
    eng.add("a")
    _check(eng, eng.step({"a": 40}, gen))  # blocks 0 (sink), 1 (packed), 2 (filling)
    eng.add("b", shared_from=("a", 2))  # hit on a's two complete blocks
    _check(eng, eng.step({"b": 5, "a": 1}, gen))
    sink_block = eng.blocks["a"][0]
    eng.finish("a")
    eng.finish("b")
    assert sink_block in eng.table.slot_of  # the sink keeps its exact copy for later hits
    eng.add("c")  # gets freed blocks back: their new first tokens reset them
    for _ in range(3):
        _check(eng, eng.step({"c": 20}, gen))


def test_pool_exhaustion_evicts_idle_sink_then_reads_packed_copy(read_path) -> None:
    gen = torch.Generator().manual_seed(5)
    eng = Engine(sink_blocks=1, num_blocks=64, e=8)  # a small share: few fp slots
    n_slots = eng.pool.n_slots
    assert n_slots >= 2
    eng.add("a")
    eng.step({"a": G + 3}, gen)  # sink slot + filling slot
    eng.add("h", shared_from=("a", 1))
    keep = eng.blocks["a"][0]
    eng.finish("a")
    eng.finish("h")
    others = [f"x{i}" for i in range(n_slots)]
    for rid in others:  # fill the pool with other requests' sinks until a's sink is evicted
        eng.add(rid)
        eng.step({rid: G}, gen)
        eng.finish(rid)
    assert keep not in eng.table.slot_of and eng.table.evictions > 0
    eng.blocks["z"] = [keep]  # a later hit on the evicted sink block
    eng.hist["z"] = eng.hist["a"][0][:G], eng.hist["a"][1][:G], eng.hist["a"][2][:G]
    out = eng.step({"z": 2}, gen)
    assert eng.table.lost_sink_reads == 1
    # the block is read packed: the oracle with no sink blocks gives the same answer
    eng.sink_blocks = 0
    _check(eng, out)


def test_blocks_that_cannot_be_quantized_are_kept_exact(read_path) -> None:
    """A completed block with a huge key (its fp16 scale overflows), an inf value or a NaN value among normal blocks:
    kept exact in this layer's fp pool (not the engine stopped), read exact by later queries of the same step, of
    later steps and of a prefix-cache hit, equal to the oracle that reads exactly those blocks exact (inf/NaN where
    full-precision attention gives them); the mark and its slot go when the block is reused."""
    gen = torch.Generator().manual_seed(13)
    eng = Engine(sink_blocks=1)
    eng.add("a")
    eng.add("b")
    eng.poison["a"] = [(G + 5, "k", 1, 0, 3e7), (2 * G + 9, "v", 0, 3, float("inf"))]  # blocks 1 and 2 of a
    eng.poison["b"] = [(3 * G + 2, "v", 1, 5, float("nan"))]  # block 3 of b, filled over decode steps
    # a's chunks start at its inf row (an earlier query of the same chunk would give 0 * inf = NaN for it when masking
    # it, as full-precision attention by matmul does): block 1 completes in the first chunk and is read exact by
    # block 2's queries of that chunk; block 2 in the second, read by block 3's
    _check(eng, eng.step({"a": 2 * G + 9, "b": 3 * G}, gen))
    _check(eng, eng.step({"a": G}, gen))
    assert eng.exact == {"a": {1, 2}}
    marked = {eng.blocks["a"][1], eng.blocks["a"][2]}
    assert set(eng.table.exact) == marked and all(eng.table.exact[b] == {"test"} for b in marked)
    for _ in range(G + 1):  # b fills block 3 token by token (the poisoned one early) and completes it
        _check(eng, eng.step({"a": 1, "b": 1}, gen))
    assert eng.exact["b"] == {3} and eng.blocks["b"][3] in eng.table.exact
    slots = {b: eng.table.slot_of[b] for b in eng.table.exact}
    eng.add("c", shared_from=("a", 3))  # a prefix-cache hit on a's blocks 0-2: reads 1 and 2 exact
    eng.exact["c"] = {1, 2}
    _check(eng, eng.step({"c": 7, "a": 1}, gen))
    assert {b: eng.table.slot_of[b] for b in eng.table.exact} == slots  # kept for good, never moved
    for rid in ("a", "b", "c"):
        eng.finish(rid)
    eng.add("d")
    while not set(eng.blocks["d"]) & set(slots):  # vLLM hands the blocks out again: new content, mark dropped
        _check(eng, eng.step({"d": G}, gen))
    reused = set(eng.blocks["d"]) & set(slots)
    assert not reused & set(eng.table.exact)


@pytest.mark.parametrize("e", [16, 8])
def test_block_kept_exact_in_a_full_pool_evicts_an_idle_slot(e: int, read_path) -> None:
    """A block filled and completed within one chunk has no slot; when the pool has no free one, keeping it exact
    evicts the least recently used slot of a block this step does not read (an idle sink), and is read exact. With 4
    slots, all held by this request (sink, an exact block, one completing, one filling), there is none to take: a
    RuntimeError naming fp_slots (what stops the engine, docs/VLLM.md), never a wrong answer."""
    gen = torch.Generator().manual_seed(19)
    eng = Engine(sink_blocks=1, num_blocks=64, e=e)  # 8 or 4 fp slots
    for i in range(eng.pool.n_slots):  # finished requests' sinks fill the pool
        eng.add(f"x{i}")
        eng.step({f"x{i}": G}, gen)
        eng.finish(f"x{i}")
    assert not eng.table.free
    eng.add("a")
    eng.poison["a"] = [(G + 3, "v", 1, 0, float("inf"))]  # block 1 of a
    _check(eng, eng.step({"a": G + 3}, gen))  # sink (evicts one) + block 1 partial: filling (evicts one)
    _check(eng, eng.step({"a": 2 * G}, gen))  # block 1 completes, block 2 completes within the chunk, block 3 reads
    assert eng.exact["a"] == {1} and eng.blocks["a"][1] in eng.table.exact
    evictions = eng.table.evictions
    eng.poison["a"] += [(4 * G + 5, "k", 0, 2, float("nan"))]  # block 4: filled and completed within the next chunk
    if eng.pool.n_slots == 4:
        with pytest.raises(RuntimeError, match="fp_slots"):
            eng.step({"a": 2 * G}, gen)
        return
    _check(eng, eng.step({"a": 2 * G}, gen))  # [3G + 3, 5G + 3): block 3 completes, 4 fills and completes, 5 reads
    assert eng.exact["a"] == {1, 4} and eng.blocks["a"][4] in eng.table.exact
    assert eng.table.evictions > evictions  # its slot came from an idle block


def test_unquantizable_tile_marks_whole_block_and_zeroes_packed_fields() -> None:
    """`store_tiles` flags the block of a bad tile (any head, keys or values) and zeroes its packed fields; the
    other blocks are stored as the quantizer encodes them."""
    gen = torch.Generator().manual_seed(17)
    eng = Engine()
    k, v = torch.randn(3, H, G, D, generator=gen), torch.randn(3, H, G, D, generator=gen)
    v[1, 1, 4, 2] = float("nan")
    bad = paged.store_tiles(eng.pool, k, v, [4, 7, 9])
    assert bad.tolist() == [False, True, False]
    assert not eng.pool.packed[7].any()
    ref = eng.lay.key_q.encode(k[2])
    for name, view in eng.pool.key_fields.items():
        assert torch.equal(view[9], ref.tensors()[name])


def test_capacity_geometry_smollm2_shapes() -> None:
    """vLLM's num_blocks = budget // (layers * page): the chosen share keeps the asked fp slots and the capacity
    targets of issue 11 for SmolLM2's geometry (3 KV heads, D = 64, 30 layers, bf16) in 1 GiB with 16 sequences."""
    from kvarn.presets import get_preset

    for name, target in (("kvarn-k2v2-g128", 5.0), ("kvarn-k4v2-g128", 3.5)):
        lay = TileLayout(get_preset(name), 64, torch.bfloat16)
        geo = choose_geometry(lay, 3, 30, 2**30, slots=3 * 16)
        num_blocks = 2**30 // (30 * geo.page_bytes)
        assert geo.fp_slots(num_blocks) >= 48
        stock_tokens = 2**30 // (30 * 3 * 2 * 64 * 2)
        assert num_blocks * 128 / stock_tokens >= target, (name, num_blocks * 128 / stock_tokens)
    with pytest.raises(ValueError, match="lower max_num_seqs"):
        choose_geometry(lay, 3, 30, 2**30, slots=3 * 256)


def test_pool_sized_from_the_budget_lowers_concurrency_instead_of_refusing() -> None:
    """vLLM's CPU defaults (max_num_seqs 256 for LLM) with 1 GiB on SmolLM2's geometry: the pool keeps to at most half
    of each page, holds the most sequences it can (fewer than 256) and is the smallest share that holds them; a
    count that fits keeps the smallest share (today's rule, same as choose_geometry); a budget that cannot hold one
    sequence is refused."""
    from kvarn.presets import get_preset

    for name in ("kvarn-k2v2-g128", "kvarn-k4v2-g128"):
        lay = TileLayout(get_preset(name), 64, torch.bfloat16)

        def need(n: int) -> int:
            return 3 * n  # 1 sink block + 2 per sequence

        def slots(g: PageGeometry) -> int:
            return g.fp_slots(2**30 // (30 * g.page_bytes))

        geo, seqs = choose_pool(lay, 3, 30, 2**30, 256, need)
        assert 1 <= seqs < 256
        assert geo.e <= FP_SHARE_MAX * geo.c and slots(geo) >= need(seqs)
        capped = [e for e in lay.share_choices() if e <= FP_SHARE_MAX * (lay.c0 + e)][-1]
        assert slots(PageGeometry(lay, 3, capped)) < need(seqs + 1)  # the most the capped share holds
        assert choose_pool(lay, 3, 30, 2**30, seqs, need) == (geo, seqs)  # a second call agrees
        small, n = choose_pool(lay, 3, 30, 2**30, 8, need)
        assert n == 8 and small == choose_geometry(lay, 3, 30, 2**30, need(8))
        with pytest.raises(ValueError, match="even one sequence"):
            choose_pool(lay, 3, 30, 2**20, 256, need)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_share_holds_whole_rows(dtype: torch.dtype) -> None:
    """Every fp share a geometry can choose holds whole fp rows (G * e a multiple of a row's bytes), and every choice
    gives a pool whose rows are one view [slots, H, 2G, D], which the batched decode reads (`paged.decode_batch`); a
    share that would split rows is refused. (When each block held its share of the pool, an ample budget chose e = 1
    byte per token slot: for a float32 model a row then spanned two blocks' shares, and every decode row went request
    by request, half the tokens/s: docs/VLLM.md.)"""
    from kvarn.presets import get_preset

    for name in ("kvarn-k2v2-g128", "kvarn-auto-k2v2-g64", "kvarn-k4v2-g128"):
        for d in (64, 128):
            lay = TileLayout(get_preset(name), d, dtype)
            row, block = d * dtype.itemsize, 2 * d * dtype.itemsize
            assert lay.share_choices() == [e for e in range(1, block + 1) if block % e == 0 and lay.tile * e % row == 0]
            for e in lay.share_choices():
                kv = torch.zeros(2 * lay.blocks_per_slot(e), 2, lay.tile, lay.c0 + e, dtype=torch.uint8)
                pool = LayerPool(kv, PageGeometry(lay, 2, e))
                assert pool.rows.shape == (2, 2, 2 * lay.tile, d), (name, d, dtype, e)  # 2 slots of K, V rows
            assert choose_geometry(lay, 8, 32, 4 << 30, slots=2).e == lay.share_choices()[0]  # ample budget
            if lay.tile % row:  # e = 1 would split rows: refused by name
                with pytest.raises(ValueError, match="hold whole rows"):
                    PageGeometry(lay, 2, 1)


def test_smallest_share_batches_the_decode(read_path, monkeypatch) -> None:
    """A float32 pool at the smallest share (e = 4 here; e = 1 split its rows before) serves each step's decode rows
    in one batched call under KVARN_KERNEL=cpu, and matches the float64 oracle (`test_mixed_batch_matches_oracle`'s
    steps)."""
    e = TileLayout(affine_preset("kvarn", 4, 2, G), D, torch.float32).share_choices()[0]
    assert e == 4
    sizes = []
    real = paged.batched_decode
    monkeypatch.setattr(paged, "batched_decode", lambda pool, batch, *a: sizes.append(len(batch.requests)) or
                        real(pool, batch, *a))
    _mixed_steps(Engine(sink_blocks=1, num_blocks=512, e=e), torch.Generator().manual_seed(13), check=True)
    assert sizes == ([] if paged.fused.mode() == "torch" else [3, 4, 5, 5, 5]), sizes


def test_page_fields_round_trip_through_views() -> None:
    """Fields written through the strided dtype views land in the block's own run of the packed region and read back
    bit for bit; no other byte of the page tensor changes (the fp region at its end included)."""
    gen = torch.Generator().manual_seed(11)
    eng = Engine()
    x = torch.randn(3 * H, G, D, generator=gen)
    kp = eng.lay.key_q.encode(x)
    blocks = torch.tensor([5, 9, 2])
    new = kp.tensors()
    for name, view in eng.pool.key_fields.items():
        view[blocks] = new[name].unflatten(0, (3, H))
    for name, view in eng.pool.key_fields.items():
        assert torch.equal(view[blocks].flatten(0, 1), new[name])
    packed, fp = page_regions(eng.kv, eng.geo)
    untouched = torch.ones(packed.shape[0], dtype=torch.bool)
    untouched[blocks] = False
    assert not packed[untouched].any() and not fp.any()
    assert packed[blocks].any()


def test_page_regions_split_the_tensor() -> None:
    """`page_regions`: the packed runs [num_blocks, H, G c0] from the tensor's first byte, then the fp slots, each
    head's K and V rows of a slot one contiguous run; the two regions do not overlap and stay within the tensor, and
    the slots are as many as the blocks' shares hold (num_blocks // blocks_per_slot). A slot written through
    `write_slot` reads back through `read_slot` and through the row ids of `slot_rows`."""
    eng = Engine()
    kv, geo, lay = eng.kv, eng.geo, eng.lay
    packed, fp = page_regions(kv, geo)
    base = kv.data_ptr()
    assert packed.data_ptr() == base and packed.shape == (kv.shape[0], H, G * geo.c0) and packed.is_contiguous()
    assert fp.data_ptr() == base + packed.numel() and fp.is_contiguous()
    assert fp.shape == (kv.shape[0] // geo.blocks_per_slot, H, lay.fp_bytes) and fp.shape[0] == eng.pool.n_slots
    assert packed.numel() + fp.numel() <= kv.numel()
    s = eng.pool.n_slots - 1
    slot = torch.randn(H, 2, G, D, generator=torch.Generator().manual_seed(5)).to(lay.fp_dtype)
    eng.pool.write_slot(s, slot)
    assert torch.equal(eng.pool.read_slot(s), slot)
    blk, sub = eng.pool.slot_rows(torch.tensor([s]), torch.tensor([0, 1])[:, None], torch.arange(G))
    assert torch.equal(eng.pool.rows[blk, :, sub], slot.permute(1, 2, 0, 3))  # [2, G, H, D]
    assert torch.equal(fp[s].view(lay.fp_dtype).view(H, 2, G, D), slot)
    with pytest.raises(ValueError, match="contiguous"):
        page_regions(kv.transpose(0, 1).contiguous().transpose(0, 1), geo)


def _mixed_steps(eng: Engine, gen: torch.Generator, check: bool) -> list[dict[str, torch.Tensor]]:
    """Steps that put in one batch: decode rows of different lengths (one completing a block), a chunked-prefill
    piece, a prefix-cache hit on a sink block (prefilling, then decoding from the shared sink slot) and a request
    whose first token is its whole prompt."""
    outs = []

    def step(work: dict[str, int]) -> None:
        outs.append(eng.step(work, gen))
        if check:
            _check(eng, outs[-1])

    for rid in "acde":
        eng.add(rid)
    step({"a": 40, "c": 15})  # a: sink, packed, filling; c: one row short of a block
    eng.add("b", shared_from=("a", 2))  # prefix hit on a's sink block and its packed block
    step({"a": 1, "c": 1, "b": 5, "d": 20, "e": 1})  # c completes block 0; d's first chunk; e's one-token prompt
    step({"a": 1, "c": 1, "b": 1, "d": 7, "e": 1})  # b decodes over the shared sink slot
    for _ in range(3):
        step({"a": 1, "b": 1, "c": 1, "d": 1, "e": 1})
    return outs


def test_mixed_batch_matches_oracle(read_path, monkeypatch) -> None:
    """Decode rows, chunked prefill and a prefix hit in one step match the float64 oracle at the tolerance of the
    module docstring (1e-4): the batched decode call adds only padding rows masked with -inf, whose weights are
    exactly 0, so its error is the per-request path's (float32 accumulation). Under KVARN_KERNEL=cpu every step's
    decode rows are served by one kernel call (sizes recorded below), prefill pieces by PyTorch."""
    sizes, rows = [], []
    real = paged.batched_decode
    monkeypatch.setattr(paged, "batched_decode", lambda pool, batch, *a: sizes.append(len(batch.requests)) or
                        rows.append(isinstance(batch.rows, slice)) or real(pool, batch, *a))
    _mixed_steps(Engine(sink_blocks=1), torch.Generator().manual_seed(13), check=True)
    if paged.fused.mode() == "torch":
        assert not sizes
    else:  # a, c, e (b is prefilling); then a, c, b, e; then all five
        assert sizes == [3, 4, 5, 5, 5], sizes
        assert rows == [False, False, True, True, True], rows  # decode rows between pieces: gathered, else a view


def _views_per_decoded_past(m: pytest.MonkeyPatch, decoded_past=None) -> list[int]:
    """Within the monkeypatch context m: each `_decoded_past` call (or `decoded_past` in its place) appends how many
    `past_view` calls it made to the list returned."""
    views, built = [], []
    real_view, inner = paged.past_view, decoded_past or paged._decoded_past

    def counted(*a):
        before = len(views)
        out = inner(*a)
        built.append(len(views) - before)
        return out

    m.setattr(paged, "past_view", lambda *a, **k: views.append(1) or real_view(*a, **k))
    m.setattr(paged, "_decoded_past", counted)
    return built


@pytest.mark.parametrize(("sink_blocks", "dtype"), [(0, torch.float32), (1, torch.float32), (2, torch.float32),
                                                   (1, torch.bfloat16)])
def test_prefill_pieces_decode_their_past_once(sink_blocks: int, dtype: torch.dtype, monkeypatch) -> None:
    """Prefill pieces that `packed_attention` serves by decoding the past densely (more than FOLD_MAX_ROWS query rows
    per KV head; lowered to 8 here so G = 16 pieces qualify) read their request's past decoded once per step and
    layer: long chunks over many stored blocks, a block kept exact among them (a huge key) and a prefix hit match
    the float64 oracle (1e-4, module docstring; float32); every output equals, bit for bit, the run in which each
    piece builds and decodes its own packed view (`past_view`), for a bf16 model too (its SDPA reads the past in
    bf16); the view is built once per request and step (4 here, for 14 such pieces)."""
    import kvarn.attention.packed as packed_mod

    monkeypatch.setattr(packed_mod, "FOLD_MAX_ROWS", 8)
    monkeypatch.setenv("KVARN_KERNEL", "torch")
    real_view = paged.past_view

    def run(once: bool) -> tuple[list[dict[str, torch.Tensor]], list[int]]:
        with monkeypatch.context() as m:
            decodes = _views_per_decoded_past(m, None if once else (  # each piece its own view (not counted)
                lambda pool, plan, p, i, j, dtype, sdpa, layer, decoded, together=None:
                tuple(x.dequantized(sdpa, dense=True) for x in
                      real_view(pool, p, j, plan.sink_blocks, dtype, plan, layer))))
            gen = torch.Generator().manual_seed(5)
            eng = Engine(sink_blocks=sink_blocks, dtype=dtype)
            eng.poison["a"] = [(3 * G + 2, "k", 1, 0, 3e7)]  # block 3 kept exact (its fp16 scale overflows)
            eng.add("a")
            outs = []
            for work in ({"a": 5 * G + 3},  # one chunk over five blocks: pieces j = 0 .. 5
                         {"a": 1, "b": 3 * G},  # b: a prefix hit on a's first four blocks, then long chunks
                         {"b": 2 * G + 7, "a": 4 * G}):
                if "b" in work and "b" not in eng.blocks:
                    eng.add("b", shared_from=("a", 4))
                    eng.exact["b"] = {3}
                outs.append(eng.step(work, gen))
                if once and dtype == torch.float32:
                    _check(eng, outs[-1])
        return outs, decodes

    once, decodes = run(True)
    each, pieces = run(False)
    for a, b in zip(once, each):
        for rid in a:
            assert torch.equal(a[rid], b[rid]), rid
    assert len(pieces) == len(decodes) == 14 and sum(decodes) == 4, (pieces, decodes)


def _prefix_hit_steps(eng: Engine, gen: torch.Generator, check: bool) -> list[dict[str, torch.Tensor]]:
    """Requests a, b, c, then d (a prefix hit on a's first three blocks) over four steps of unequal chunks, prompt
    pieces over decoded pasts in every step; each step's outputs, checked against the float64 oracle if `check`."""
    for rid in "abc":
        eng.add(rid)
    outs = []
    for work in ({"a": 3 * G + 5, "b": 2 * G, "c": G + 3},
                 {"a": 2 * G, "b": 3 * G + 1, "c": 4 * G, "d": 0},
                 {"a": 1, "d": 3 * G + 2, "c": 2 * G},
                 {"b": 2 * G}):
        if "d" in work and "d" not in eng.blocks:
            eng.add("d", shared_from=("a", 3))
            work = {r: t for r, t in work.items() if t}
        outs.append(eng.step(work, gen))
        if check:
            _check(eng, outs[-1])
    return outs


@pytest.mark.parametrize(("sink_blocks", "dtype", "family"), [(0, torch.float32, "kvarn"), (1, torch.float32, "kvarn"),
                                                             (2, torch.float32, "kvarn-auto"),
                                                             (1, torch.bfloat16, "kvarn")])
def test_prefill_pasts_of_several_requests_decode_together(sink_blocks: int, dtype: torch.dtype, family: str,
                                                           monkeypatch) -> None:
    """Prefill pieces of several requests over a decoded past (FOLD_MAX_ROWS lowered to 8 so G = 16 pieces qualify)
    read pasts decoded together, one select and one decode per kind and layer (`_decoded_pasts`): no request builds
    its own view, the outputs match the float64 oracle (float32) and equal, bit for bit, the run in which each
    request decodes its own past (`_decoded_past` alone), a bf16 model and kvarn-auto's per-tile rotations too; a
    prefix hit (shared blocks read by two requests), requests of unequal lengths and a step with one such request."""
    import kvarn.attention.packed as packed_mod

    monkeypatch.setattr(packed_mod, "FOLD_MAX_ROWS", 8)
    monkeypatch.setenv("KVARN_KERNEL", "torch")

    def run(together: bool) -> tuple[list[dict[str, torch.Tensor]], int]:
        with monkeypatch.context() as m:
            built = _views_per_decoded_past(m)  # decode rows build views too: only `_decoded_past`'s count
            if not together:
                m.setattr(paged, "_decoded_pasts", lambda *a, **k: None)
            eng = Engine(sink_blocks=sink_blocks, dtype=dtype, family=family)
            outs = _prefix_hit_steps(eng, torch.Generator().manual_seed(7), check=together and dtype == torch.float32)
        return outs, sum(built)

    together, views = run(True)
    alone, views_alone = run(False)
    for a, b in zip(together, alone):
        for rid in a:
            assert torch.equal(a[rid], b[rid]), rid
    assert views == 0 and views_alone > 0, (views, views_alone)


@pytest.mark.parametrize("sink_blocks", [1, 2])
def test_batched_decode_equals_per_request_kernel_calls(sink_blocks: int, monkeypatch) -> None:
    """The one-call batched decode equals the per-request kernel calls it replaces: identical page bytes (the same
    tiles stored) and outputs equal up to float32 summation order (the online softmax walks the sink and current
    rows as one segment instead of two): 1e-5."""
    if not paged.kernel.available():
        pytest.skip("the CPU kernel cannot be built here")
    monkeypatch.setenv("KVARN_KERNEL", "cpu")
    runs = []
    for batched in (True, False):
        if not batched:
            monkeypatch.setattr(paged, "decode_batch", lambda plan, pool: None)
        eng = Engine(sink_blocks=sink_blocks)
        outs = _mixed_steps(eng, torch.Generator().manual_seed(17), check=False)
        runs.append((outs, eng.kv.clone()))
    (out_b, kv_b), (out_r, kv_r) = runs
    assert torch.equal(kv_b, kv_r)
    for ob, orq in zip(out_b, out_r):
        for rid in ob:
            torch.testing.assert_close(ob[rid], orq[rid], rtol=1e-5, atol=1e-5, msg=f"request {rid}")


@pytest.mark.parametrize(("name", "why"), [("kivi-k2v2-g128", "baseline"), ("fp16", "does not quantize"),
                                           ("kvarn-b2.5@64", "tiles of 64 tokens")])
def test_presets_the_backend_does_not_run_are_refused_by_name(name: str, why: str) -> None:
    from kvarn.integrations.vllm.config import check_preset
    from kvarn.presets import get_preset
    from kvarn.presets.family import budget_preset

    preset = budget_preset(2.5, tile=64, name=name) if "@" in name else get_preset(name)
    with pytest.raises(ValueError, match=f"{name}.*{why}"):
        check_preset(preset)
    for ok in ("kvarn-k2v2-g128", "kvarn-auto-k2v2-g128", "kvarn-auto-k4v2-g128", "kvarn-b2.5", "kvarn-b3.0-qar"):
        check_preset(get_preset(ok))  # the families it runs pass


def _auto_engine() -> Engine:
    """kvarn-auto-k2v2 at the stand-in's size; queries with uneven channel energies (the heavy key channel 3 of
    `Engine.step` is set per step by the test), so the query-weighted choice differs from plain squared error."""
    eng = Engine(preset_bits=(2, 2), sink_blocks=1, family="kvarn-auto")
    scale = torch.ones(HQ, D)
    scale[:, :3] = 0.3
    eng.q_scale = scale
    return eng


def _flags(eng: Engine, rid: str) -> tuple[list[int], torch.Tensor]:
    """Stored key tiles of a request past the sink: (logical blocks, rotated flags [n, H] read from the pages)."""
    t = eng.hist[rid][0].shape[0]
    js = list(range(eng.sink_blocks, t // G))
    return js, eng.pool.key_fields.rotated[torch.tensor([eng.blocks[rid][j] for j in js], dtype=torch.long)]


def test_auto_mixed_batch_matches_oracle_with_running_query_energy(read_path, monkeypatch) -> None:
    """kvarn-auto-k2v2 over the mixed steps (decode rows, a completing block, chunked prefill, a prefix-cache hit):
    each key tile's rotation is chosen with the engine's running mean of q^2 per KV head, every request's queries of
    every step up to and including the one that completes the tile (`Engine.tile_weight`), and both read paths honour
    the per-tile flag stored in the page: the flags equal the oracle's encode's and outputs match the float64 oracle
    (1e-4). The queries' reading of channel 3 alternates between steps, so the choice with this mean differs on some
    tiles from the unweighted one and from the one with the mean before the tile's step (asserted): a backend that
    dropped the weight, or observed the step's queries after storing its tiles, would fail here."""
    eng = _auto_engine()
    steps = iter([1.0, 0.05, 1.0, 0.05, 1.0, 0.05])

    def step(work: dict[str, int]) -> None:
        eng.q_scale[:, 3] = next(steps)
        out = eng.step(work, gen)
        _check(eng, out)

    gen = torch.Generator().manual_seed(13)
    for rid in "acde":
        eng.add(rid)
    step({"a": 40, "c": 15})
    eng.add("b", shared_from=("a", 2))
    step({"a": 1, "c": 1, "b": 5, "d": 20, "e": 1})
    step({"a": 1, "c": 1, "b": 1, "d": 7, "e": 1})
    step({"a": 30, "b": 12, "c": 1, "d": 1, "e": 1})  # a and b complete blocks mid-chunk
    for _ in range(2):
        step({"a": 1, "b": 1, "c": 1, "d": 1, "e": 1})
    unweighted = stale = 0
    for rid in "abcd":
        js, flags = _flags(eng, rid)
        k = eng.hist[rid][0]
        for j, stored in zip(js, flags):
            x = k[j * G:(j + 1) * G].transpose(0, 1)
            want = eng.lay.key_q.encode(x, eng.tile_weight[(rid, j)]).rotated
            assert torch.equal(stored, want), (rid, j, stored, want)
            unweighted += int((eng.lay.key_q.encode(x).rotated != want).sum())
            stale += int((eng.lay.key_q.encode(x, eng.stale_weight[(rid, j)]).rotated != want).sum())
    assert unweighted and stale, ("the test would not see the weight dropped or stale", unweighted, stale)
    assert eng.pool.queries.count == eng.energy_count  # every query of every step, pooled per KV head
    torch.testing.assert_close(eng.pool.queries.weight()[0].double(), eng.energy / eng.energy_count, rtol=1e-5,
                               atol=0)


@pytest.mark.parametrize("name", ["kvarn-auto-k2v2-g128", "kvarn-auto-k4v2-g128", "kvarn-k2v2-g128"])
def test_auto_flags_live_in_the_accounted_page_bytes(name: str) -> None:
    """The per-tile rotation flags (keys and values) are packed fields of the head's run, inside the G*c0 bytes of
    packed tile that the page (what vLLM sizes and reports: H*G*C per block) holds; the packed part equals the
    quantizers' bits_per_element (flags included) up to field alignment; writing the fields of one block touches only
    its bytes."""
    from kvarn.presets import get_preset

    d, h = 64, 3
    lay = TileLayout(get_preset(name), d, torch.bfloat16)
    kq, vq = lay.key_q, lay.value_q
    stored = sum(f.nbytes for f in lay.fields)  # bits_per_element counts every field, flags included
    assert stored * 8 == (kq.bits_per_element(d) + vq.bits_per_element(d)) * lay.tile * d
    assert stored <= lay.packed_bytes < stored + len(lay.fields)  # plus alignment of each field to its itemsize
    flags = [f for f in lay.fields if f.name == "rotated"]
    assert len(flags) == (2 if "auto" in name else 0)
    assert all(f.offset + f.nbytes <= lay.packed_bytes <= lay.tile * lay.c0 for f in lay.fields)
    geo = PageGeometry(lay, h, lay.share_choices()[-1])
    assert geo.page_bytes == h * lay.tile * (lay.c0 + geo.e)
    kv = torch.zeros(4, h, lay.tile, geo.c, dtype=torch.uint8)
    pool = LayerPool(kv, geo)
    x = torch.randn(2, h, lay.tile, d)
    x[:, :, :, 0] *= 30
    bad = paged.store_tiles(pool, x, x.clone(), [1, 3])
    assert not bad.any()
    if flags:
        ref = kq.encode(x.flatten(0, 1)).rotated.view(2, h)  # no queries seen: unweighted
        assert torch.equal(pool.key_fields.rotated[torch.tensor([1, 3])], ref)
    runs, fp = page_regions(kv, geo)  # [num_blocks, H, G*c0]: per head, the packed tile
    for f in flags:  # each flag byte is the one at its offset in the head's run
        fields = pool.key_fields if f.kind == "keys" else pool.value_fields
        assert torch.equal(runs[:, :, f.offset], fields.rotated)
    assert not runs[[0, 2]].any() and not fp.any()  # only the blocks' packed parts


@pytest.mark.parametrize("clip", [1.0, 0.8, "widths"])
def test_query_aware_keys_match_oracle_with_running_covariance(read_path, clip: float | str) -> None:
    """kvarn-auto-k2v2 with query-aware keys (`-qar`) over mixed steps with a prefix-cache hit: the layer keeps the
    engine's running E[q q^T] per KV head (every query of every step, GQA heads pooled; float64 oracle to 1e-5), each
    key tile is rounded with the matrix as of the step that completes it (its codes equal the oracle encode's), and the
    outputs match the float64 oracle (1e-4). The queries are correlated across channels, so the codes differ from
    those of the diagonal weight alone on some tiles (asserted): a backend that kept only the energy would fail.
    clip 0.8: the clipped grids of `kvarn-auto-k2v2-g128-qar-clip` (`AffineConfig.clip`), the same page fields;
    "widths": the `kvarn-w` presets' keys, each channel at its own width (`AffineConfig.widths`: codes [W G / 8] and
    the widths in the page)."""
    if clip == "widths":
        eng = Engine(sink_blocks=1, preset=widths_preset(tile=G, mean=2.5))
        assert eng.lay.key_q.format(D).widths == 40
    else:
        eng = Engine(preset_bits=(2, 2), sink_blocks=1, family="kvarn-auto", rounding="query-aware", clip=(clip, clip))
        assert eng.lay.key_q.config.clip == clip
    gen = torch.Generator().manual_seed(31)
    eng.q_mix = torch.eye(D) + torch.randn(D, 2, generator=gen) @ torch.randn(2, D, generator=gen)
    for rid in "acd":
        eng.add(rid)
    _check(eng, eng.step({"a": 40, "c": 15}, gen))
    eng.add("b", shared_from=("a", 2))
    _check(eng, eng.step({"a": 1, "c": 1, "b": 5, "d": 20}, gen))
    _check(eng, eng.step({"a": 30, "b": 12, "c": 1, "d": 1}, gen))
    for _ in range(2):
        _check(eng, eng.step({"a": 1, "b": 1, "c": 1, "d": 1}, gen))
    kq, moved = eng.lay.key_q, 0
    for rid in "abcd":
        t = eng.hist[rid][0].shape[0]
        for j in range(eng.sink_blocks, t // G):
            x = eng.hist[rid][0][j * G:(j + 1) * G].transpose(0, 1)
            block = torch.tensor([eng.blocks[rid][j]])
            stored = eng.pool.key_fields.select(block).flatten(2).codes  # [H, ...]
            assert torch.equal(stored, kq.encode(x, eng.tile_cov[(rid, j)]).codes), (rid, j)
            moved += int(not torch.equal(stored, kq.encode(x, eng.tile_weight[(rid, j)]).codes))
    assert moved, "the test would not see the covariance dropped"
    e = eng.pool.queries
    assert e.count == eng.energy_count
    torch.testing.assert_close(e.covariance()[0].double(), eng.cov / eng.energy_count, rtol=1e-5, atol=1e-6)


def test_auto_query_statistics_skip_non_finite_queries() -> None:
    """The engine-wide mean outlives every request: tokens with a non-finite query (or one whose square overflows) are
    left out of it, the others of the same step counted; a step with none finite adds nothing."""
    eng = _auto_engine()
    gen = torch.Generator().manual_seed(23)
    q = torch.randn(5, HQ, D, generator=gen)
    bad = q.clone()
    bad[1, 2, 7] = float("nan")
    bad[3, 0, 0] = 3e30  # finite, but its square is not in float32
    paged.observe_queries(eng.pool, bad)
    paged.observe_queries(eng.pool, torch.full((2, HQ, D), float("inf")))
    e = eng.pool.queries
    assert e.count == 3 * HQ // H
    keep = q[[0, 2, 4]]
    torch.testing.assert_close(e.weight()[0], keep.square().view(3, H, HQ // H, D).sum((0, 2)) / e.count)


def test_auto_query_statistics_over_several_chunks() -> None:
    """A step longer than one chunk of `observe_queries` (a long prompt) gives the float64 mean of its finite
    queries, a bad token in a later chunk left out and the earlier chunks' sums kept; a second step adds to it."""
    eng = _auto_engine()
    gen = torch.Generator().manual_seed(29)
    t = 2 * OBSERVE_CHUNK + 3
    q = torch.randn(t, HQ, D, generator=gen).bfloat16()
    q[OBSERVE_CHUNK + 5, HQ - 1, 1] = float("inf")
    q2 = torch.randn(7, HQ, D, generator=gen).bfloat16()
    paged.observe_queries(eng.pool, q)
    paged.observe_queries(eng.pool, q2)
    keep = torch.cat([q[torch.arange(t) != OBSERVE_CHUNK + 5], q2]).double()
    e = eng.pool.queries
    assert e.count == keep.shape[0] * (HQ // H)
    want = keep.square().view(-1, H, HQ // H, D).sum((0, 2)) / e.count
    torch.testing.assert_close(e.weight()[0].double(), want, rtol=1e-5, atol=0)  # float32 sums of ~3e3 terms


@pytest.mark.parametrize("stats", ["energy", "covariance"])
def test_pending_queries_fold_lazily_and_equal_eager_folding(stats: str) -> None:
    """`PendingQueries` keeps decode steps' few query rows (copies: the caller's buffer is reused) and folds them in
    when anything reads the statistics or PENDING_ROWS wait; a long step folds at once. Every read sees every query
    added so far: the same statistics as folding each step in at once (float32 summation order aside; float64
    oracle), non-finite tokens left out either way."""
    from kvarn.quant.policy import QueryCovariance, QueryEnergy

    make = QueryEnergy if stats == "energy" else QueryCovariance
    lazy, eager = PendingQueries(make(), H), PendingQueries(make(), H)
    gen = torch.Generator().manual_seed(37)
    buf = torch.empty(16, HQ + 2 * H, D)  # vLLM's qkv output: the query a strided view of it, reused every step
    seen = []
    for step, t in enumerate([3, 8, 8, 1, PENDING_ROWS - 5, 8, PENDING_ROWS + 9, 2]):
        q = torch.randn(t, HQ, D, generator=gen)
        if step == 3:
            q[0, 1, 2] = float("nan")
        if t <= buf.shape[0]:
            buf[:t, :HQ] = q
            q_in = buf[:t, :HQ]
        else:
            q_in = q
        lazy.add(q_in)
        eager.add(q_in)
        eager.flush()
        if t <= buf.shape[0]:
            buf.normal_(generator=gen)  # the next step overwrites the buffer: kept rows must be copies
        seen.append(q)
        assert lazy.waiting <= PENDING_ROWS
        if step in (2, 6):  # a reader: flushed first, everything so far counted
            assert lazy.waiting == (19 if step == 2 else 0)  # step 6's long step was folded at once
            keep = torch.cat(seen)
            keep = keep[torch.isfinite(keep).flatten(1).all(1)].double().view(-1, H, HQ // H, D)
            assert lazy.count == eager.count == keep.shape[0] * HQ // H
            if stats == "energy":
                want = keep.square().sum((0, 2)) / lazy.count
                torch.testing.assert_close(lazy.weight()[0].double(), want, rtol=1e-5, atol=0)
            else:
                want = torch.einsum("thgd,thge->hde", keep, keep) / lazy.count
                torch.testing.assert_close(lazy.covariance()[0].double(), want, rtol=1e-5, atol=1e-6)
            assert not lazy.rows
            torch.testing.assert_close(lazy.key_weight(), eager.key_weight(), rtol=1e-5, atol=1e-6)
    assert lazy.waiting == 2 and len(lazy.rows) == 1  # the last step waits for a reader



@pytest.mark.parametrize("dtype,widths", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_prompt_pieces_through_vllm_cpu_attention(dtype: torch.dtype, widths: bool, monkeypatch) -> None:
    """Where vLLM's CPU attention can serve them (head_dim 64, G = 32 here), the prompt pieces over a decoded past go
    as ONE call of its kernel (`paged._vllm_pieces`) per layer and step: float32 matches the float64 oracle (1e-4) and
    the SDPA route (1e-5); bf16 matches the SDPA route within two bf16 ulps at the outputs' scale (|o| < 4: 3e-2;
    the routes sum in different orders). The scratch pages come NaN-filled, so a row the kernel weighs without
    writing it (an exact block's rows past t) would show. KVARN_PREFILL_ATTENTION=sdpa is the SDPA route. widths:
    the `kvarn-w` keys, with every decoded past handed over channel-major, as their PyTorch decode leaves key tiles
    none of which is rotated (vLLM's fill needs each row's channels adjacent; it stopped the engine on Qwen2.5)."""
    pytest.importorskip("vllm")
    import sys

    import kvarn.attention.packed as packed_mod

    mod = sys.modules[__name__]
    monkeypatch.setattr(mod, "G", 32)
    monkeypatch.setattr(mod, "D", 64)
    monkeypatch.setattr(packed_mod, "FOLD_MAX_ROWS", 8)
    monkeypatch.setenv("KVARN_KERNEL", "torch")
    real, empty, real_pasts = paged._vllm_pieces, torch.empty, paged._decoded_pasts

    def apart(x: torch.Tensor) -> torch.Tensor:  # the same values, each row's channels apart in memory
        return x.transpose(-1, -2).contiguous().transpose(-1, -2)

    def pasts_apart(*a):
        out = real_pasts(*a)
        if out is None:
            return None
        parts = {i: (None if sink is None else tuple(apart(x) for x in sink), at, n)
                 for i, (sink, at, n) in out.parts.items()}
        return paged.DecodedPasts(tuple(apart(x) for x in out.rows), parts)

    if widths:
        monkeypatch.setattr(paged, "_decoded_pasts", pasts_apart)

    def pieces_nan_scratch(*a):
        calls.append(len(a[1]))
        with monkeypatch.context() as m:  # torch.empty inside the call: NaN-filled
            m.setattr(torch, "empty", lambda *s, **k: empty(*s, **k).fill_(float("nan")))
            return real(*a)

    def run(route: str) -> list[dict[str, torch.Tensor]]:
        with monkeypatch.context() as m:
            m.setenv("KVARN_PREFILL_ATTENTION", route)
            m.setattr(paged, "_vllm_pieces", pieces_nan_scratch)
            eng = Engine(sink_blocks=1, dtype=dtype, num_blocks=256,
                         preset=widths_preset(tile=G, mean=2.5) if widths else None)
            return _prefix_hit_steps(eng, torch.Generator().manual_seed(11), check=dtype == torch.float32)

    calls: list[int] = []
    fast = run("vllm")
    assert sum(calls) >= 8, calls
    calls.clear()
    slow = run("sdpa")
    assert not calls
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for a, b in zip(fast, slow):
        for rid in a:
            torch.testing.assert_close(a[rid].float(), b[rid].float(), rtol=tol, atol=tol, msg=rid)
