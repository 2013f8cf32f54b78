"""Budget presets in the paged backend without vLLM (`kvarn.integrations.vllm.budget`): the engine's one key
allocation, scored on the first request that completes a tile past the sink, then the layers bound to pages of
their width, against a float64 oracle.

A stand-in engine drives several layers through `SlotTable.plan` + `budget.step_layer` (the backend's forward) over
uint8 page tensors of the classes vLLM allocates (`budget.page_classes`). Oracle, per layer (float64): a query at
position p of block j attends to blocks < j as stored and to block j's exact rows up to p, where "as stored" is:
sink blocks exact; values decode(encode(tile)); keys exact in the step that decides the allocation (held aside),
else decode(encode(tile)) with the layer's decided key quantizer, weighted with the layer's running query energy
after the step that completed the tile (every request pooled). Tolerance: float32 vs float64 accumulation over
<= 512 keys of magnitude ~N(0, 1), and float32 vs float64 running query energies feeding only the rotation choice
(identical here: the choices are far from ties): 1e-4, as the single-layer tests.
"""

from __future__ import annotations

import pytest
import torch

from kvarn.cache.allocation import OUTPUT_ROWS, KeyAllocation, output_gains
from kvarn.integrations.vllm import budget
from kvarn.integrations.vllm.layout import PageGeometry
from kvarn.integrations.vllm.pool import SlotTable
from kvarn.presets import get_preset

G, D, H, HQ, LAYERS = 128, 16, 2, 4, 4


class BudgetEngine:
    def __init__(self, preset: str = "kvarn-b3.0", num_blocks: int = 48, e_index: int = 5, sink_blocks: int = 1,
                 classes: list[str] | None = None) -> None:
        self.preset = get_preset(preset)
        self.lays = budget.layouts(self.preset, D, torch.float32)
        low = self.lays["low"]
        self.e = low.share_choices()[e_index]
        classes = classes or budget.page_classes(self.preset, LAYERS, D)
        self.tensors = [torch.zeros(num_blocks, H, G, self.lays[c].c0 + self.e, dtype=torch.uint8) for c in classes]
        n_slots = PageGeometry(low, H, self.e).fp_slots(num_blocks)
        self.table = SlotTable(n_slots, G, sink_blocks)
        self.names = [f"layer{i}" for i in range(LAYERS)]
        self.bud = budget.BudgetState(self.preset, self.names, self.tensors, D, self.e, torch.float32, self.table)
        self.table.keep_sinks, self.table.on_full = True, self.bud.decide_unscored
        self.sink_blocks = sink_blocks
        self.free = list(range(1, num_blocks))
        self.blocks: dict[str, list[int]] = {}
        self.hist: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # (rid, layer)
        self.energy = [torch.zeros(H, D, dtype=torch.float64) for _ in range(LAYERS)]
        self.count = 0
        self.tile_weight: dict[tuple[str, int, int], torch.Tensor] = {}  # (rid, layer, block)
        self.tile_step: dict[tuple[str, int], int] = {}  # (rid, block) -> the step that completed it
        self.step_no = 0
        self.decision_step: int | None = None
        self.scale = [torch.ones(D) for _ in range(LAYERS)]
        for i in range(LAYERS):  # a heavy key channel whose size differs by layer: distinct gains
            self.scale[i][3 + i] = 2.0 + 3 * i

    def add(self, rid: str, shared_from: tuple[str, int] | None = None) -> None:
        self.blocks[rid] = []
        for i in range(LAYERS):
            self.hist[(rid, i)] = (torch.zeros(0, H, D), torch.zeros(0, H, D), torch.zeros(0, HQ, D))
        if shared_from is not None:
            src, n = shared_from
            self.blocks[rid] = list(self.blocks[src][:n])
            for i in range(LAYERS):
                self.hist[(rid, i)] = tuple(x[:n * G] for x in self.hist[(src, i)])
                self.tile_weight.update({(rid, i, j): self.tile_weight[(src, i, j)] for j in range(n)
                                         if (src, i, j) in self.tile_weight})
            self.tile_step.update({(rid, j): self.tile_step[(src, j)] for j in range(n) if (src, j) in self.tile_step})

    def step(self, work: dict[str, int], gen: torch.Generator) -> dict[tuple[str, int], torch.Tensor]:
        self.step_no += 1
        rows, computed, lengths, block_rows = [], [], [], []
        at = 0
        for rid, t in work.items():
            nc = self.hist[(rid, 0)][0].shape[0]
            while len(self.blocks[rid]) * G < nc + t:
                self.blocks[rid].append(self.free.pop(0))
            rows.append((at, at + t))
            at += t
            computed.append(nc)
            lengths.append(nc + t)
            block_rows.append(list(self.blocks[rid]))
        plan = self.table.plan(rows, computed, lengths, block_rows)
        outs = {}
        self.count += at * (HQ // H)
        for i, name in enumerate(self.names):
            ks, vs, qs = [], [], []
            for rid, t in work.items():
                k = torch.randn(t, H, D, generator=gen) * self.scale[i]
                v, q = torch.randn(t, H, D, generator=gen), torch.randn(t, HQ, D, generator=gen)
                ko, vo, qo = self.hist[(rid, i)]
                self.hist[(rid, i)] = (torch.cat([ko, k]), torch.cat([vo, v]), torch.cat([qo, q]))
                ks.append(k)
                vs.append(v)
                qs.append(q)
            key, value, query = torch.cat(ks), torch.cat(vs), torch.cat(qs)
            self.energy[i] += query.double().square().view(-1, H, HQ // H, D).sum((0, 2))
            for rid, nc, n in zip(work, computed, lengths):
                for j in range(nc // G, n // G):
                    self.tile_weight[(rid, i, j)] = (self.energy[i] / self.count).float()
            out = torch.zeros_like(query)
            budget.step_layer(self.bud, name, plan, query, key, value, out, D ** -0.5, None)
            for rid, (r0, r1) in zip(work, rows):
                outs[(rid, i)] = out[r0:r1]
        for rid, nc, n in zip(work, computed, lengths):
            for j in range(nc // G, n // G):
                self.tile_step[(rid, j)] = self.step_no
        if self.bud.decided and self.decision_step is None:
            self.decision_step = self.step_no
        return outs

    def key_quantizer(self, layer: int):
        return self.lays[self.bud.width(layer)].key_q if self.bud.decided else None

    def oracle(self, rid: str, layer: int, first: int) -> torch.Tensor:
        k, v, q = (x.double() for x in self.hist[(rid, layer)])
        t = k.shape[0]
        kd, vd = k.clone(), v.clone()
        vq = self.lays["low"].value_q
        for j in range(self.sink_blocks, t // G):
            sl = slice(j * G, (j + 1) * G)
            vd[sl] = vq.decode(vq.encode(v[sl].transpose(0, 1).float())).double().transpose(0, 1)
            if self.tile_step[(rid, j)] == self.step_no == self.decision_step:
                continue  # held aside exact in the deciding step
            kq = self.key_quantizer(layer)
            w = self.tile_weight[(rid, layer, j)]
            kd[sl] = kq.decode(kq.encode(k[sl].transpose(0, 1).float(), w)).double().transpose(0, 1)
        out = torch.zeros(t - first, HQ, D, dtype=torch.float64)
        for p in range(first, t):
            j = p // G
            keys = torch.cat([kd[:j * G], k[j * G:p + 1]])
            vals = torch.cat([vd[:j * G], v[j * G:p + 1]])
            for hq in range(HQ):
                h = hq // (HQ // H)
                out[p - first, hq] = torch.softmax(keys[:, h] @ q[p, hq] * D ** -0.5, 0) @ vals[:, h]
        return out

    def check(self, outs: dict[tuple[str, int], torch.Tensor]) -> None:
        for (rid, layer), o in outs.items():
            t = self.hist[(rid, layer)][0].shape[0]
            ref = self.oracle(rid, layer, t - o.shape[0])
            torch.testing.assert_close(o.double(), ref, rtol=1e-4, atol=1e-4, msg=f"request {rid}, layer {layer}")


@pytest.mark.parametrize("kernel", ["torch", "cpu"])
def test_budget_allocation_scores_binds_and_matches_oracle(kernel: str, monkeypatch) -> None:
    """Both read paths (KVARN_KERNEL, as the single-layer tests): the batched C++ decode and fused pieces, or
    PyTorch; the deciding step's pieces that read held keys take PyTorch under both."""
    from kvarn.integrations.vllm import paged

    if kernel == "cpu" and not paged.kernel.available():
        pytest.skip("the CPU kernel cannot be built here")
    monkeypatch.setenv("KVARN_KERNEL", kernel)
    calls: list[int] = []  # the fused kernel's calls (pieces and batched decode rows), by key code width
    for name in ("decode_attention", "decode_rows"):
        real = getattr(paged.kernel, name)
        monkeypatch.setattr(paged.kernel, name, lambda q, kf, *a, _real=real, **k: calls.append(
            kf.bits) or _real(q, kf, *a, **k))
    # pages of all three classes (as sized for the most high layers), so the decision can use every key width; the
    # sizing vLLM gets (`budget.sized_split`: the most promoted layers, (1, 3) here) is test_page_classes_...'s
    eng = BudgetEngine(classes=["high", "high", "mid", "low"])
    gen = torch.Generator().manual_seed(0)
    eng.add("a")
    eng.add("b")
    eng.check(eng.step({"a": 126, "b": 200}, gen))  # b's sink block completes: values stored, keys wait
    assert not eng.bud.decided and eng.table.keep_sinks and eng.bud.report()["key_bits"] is None
    eng.check(eng.step({"a": 1, "b": 1}, gen))
    eng.check(eng.step({"a": 1, "b": 199}, gen))  # b completes blocks 1 and 2: the deciding step; a's sink
    assert eng.decision_step == 3 and eng.bud.settled and not eng.table.keep_sinks
    # the scores: the "output" rule on b's block 1 with that block's queries, keys exact, values as stored
    a = eng.bud.allocation
    for i in range(LAYERS):
        k, v, q = eng.hist[("b", i)]
        end = 2 * G
        vq = eng.lays["low"].value_q
        vs = v[:end].clone()
        vs[G:end] = vq.decode(vq.encode(v[G:end].transpose(0, 1))).transpose(0, 1)
        w = eng.tile_weight[("b", i, 1)][None]
        qs = (eng.lays["high"].key_q, eng.lays["mid"].key_q)
        want = output_gains(q[end - OUTPUT_ROWS:end].transpose(0, 1)[None], k[:end].transpose(0, 1)[None],
                            vs.transpose(0, 1)[None], G, w, eng.lays["low"].key_q, qs)
        assert a.scores[i] == pytest.approx(want[0], rel=1e-3, abs=1e-7)
        assert a.mid_scores[i] == pytest.approx(want[1], rel=1e-3, abs=1e-7)
    ref = KeyAllocation(range(LAYERS), 0, a.low, a.high, "output", a.mid, 0, "best", sorted(a.splits))
    for i in range(LAYERS):
        ref.report(i, a.scores[i], a.mid_scores[i])
    assert (ref.promoted, ref.middle) == (a.promoted, a.middle)
    assert len(a.promoted) + len(a.middle) > 0  # the budget is spent
    # each layer on its own tensor, of a class that holds its width
    rank = {c: r for r, c in enumerate(budget.CLASSES)}
    assert sorted(eng.bud.bound) == list(range(LAYERS))
    for i, t in enumerate(eng.bud.bound):
        assert rank[eng.bud.page_class[t]] <= rank[eng.bud.width(i)]
        assert eng.bud.pools[eng.names[i]].layout.key_q.config == eng.lays[eng.bud.width(i)].key_q.config
    bits = {"high": 4, "mid": 3, "low": 2}
    assert eng.bud.report() == {"key_bits": [bits[eng.bud.width(i)] for i in range(LAYERS)], "key_layers": eng.names}
    eng.check(eng.step({"a": 1, "b": 1}, gen))  # after: the held tiles read as stored at each layer's width
    eng.add("c", shared_from=("b", 1))  # a prefix-cache hit on b's sink block
    eng.check(eng.step({"a": 200, "b": 1, "c": 150}, gen))
    eng.check(eng.step({"a": 1, "b": 1, "c": 1}, gen))
    # under KVARN_KERNEL=cpu the decode rows of every width (2-, 3- and 4-bit key codes) went through the kernel
    widths = {eng.bud.width(i) for i in range(LAYERS)}
    assert len(set(calls)) == (len(widths) if kernel == "cpu" else 0), (calls, widths)


def test_sink_keys_get_packed_copies_when_decided() -> None:
    """Sink blocks completed before the decision are stored with the layer's decided key quantizer from their exact
    slots (their packed copy is what a prefix-cache hit reads after an eviction)."""
    eng = BudgetEngine()
    gen = torch.Generator().manual_seed(1)
    eng.add("a")
    eng.step({"a": 130}, gen)
    eng.add("b")
    eng.step({"a": 1, "b": 260}, gen)
    assert eng.bud.decided
    blk = eng.blocks["a"][0]
    for i, name in enumerate(eng.names):
        pool = eng.bud.pools[name]
        kq = pool.layout.key_q
        got = kq.decode(pool.key_fields.select(torch.tensor([blk])).flatten(2))  # [H, G, D]
        k = eng.hist[("a", i)][0][:G].transpose(0, 1)
        want = kq.decode(kq.encode(k, eng.bud.pools[name].queries.weight()[0]))
        torch.testing.assert_close(got, want)


def test_pool_full_before_any_scoring_request_decides_unscored() -> None:
    """Sinks are not evicted before the allocation; when only they could go, the engine decides without scores
    (ties to the lower layers), with the budget's split, and the sinks become evictable."""
    eng = BudgetEngine(num_blocks=48, e_index=5)
    gen = torch.Generator().manual_seed(2)
    n = 0
    while not eng.bud.decided:
        rid = f"r{n}"
        eng.add(rid)
        eng.step({rid: 140}, gen)  # a sink block and a partial one each, then the request is dropped
        n += 1
        assert n <= eng.table.n_slots
    a = eng.bud.allocation
    assert (len(a.promoted), len(a.middle)) in a.splits and not eng.table.keep_sinks
    assert eng.table.evictions >= 1


def test_page_classes_and_feasible_splits() -> None:
    p = get_preset("kvarn-b2.5")
    assert budget.page_classes(p, 30, 64).count("high") == budget.sized_split(p, 30, 64)[0]
    # sized for the split that promotes the most layers: what the transformers cache chose on every recorded request
    # on Qwen2.5-Coder (24 layers): 8 mid at 2.5 bits, 8 high + 16 mid at 3.0 (docs/tasks/*.samples.jsonl, key_bits)
    assert budget.sized_split(p, 24, 64) == (0, 8)
    assert budget.sized_split(get_preset("kvarn-b3.0-qar"), 24, 64) == (8, 16)
    for name in ("kvarn-b2.5-qar", "kvarn-b3.0"):
        q = get_preset(name)
        splits = budget.splits_of(q, 24, 64)
        h, m = budget.sized_split(q, 24, 64)
        assert all(a + b <= h + m for a, b in splits) and (h, m) in budget.feasible_splits(splits, h, m)
    assert budget.feasible_splits([(0, 0), (1, 0), (0, 2), (0, 3), (2, 0)], 1, 1) == [(0, 0), (1, 0), (0, 2)]
    lay = budget.layouts(p, 64, torch.bfloat16)
    assert lay["low"].c0 < lay["mid"].c0 < lay["high"].c0
    # the value fields lead every class's layout at the same offsets (values stored before the decision stay put)
    offsets = {c: [(f.name, f.offset) for f in x.fields if f.kind == "values"] for c, x in lay.items()}
    assert offsets["low"] == offsets["mid"] == offsets["high"]
    assert min(f.offset for f in lay["high"].fields if f.kind == "keys") >= max(
        f.offset + f.nbytes for f in lay["high"].fields if f.kind == "values")


def test_budget_presets_refuse_pipeline_parallelism() -> None:
    """The allocation spans every kvarn layer of the model; pipeline stages hold some of them each."""
    from types import SimpleNamespace

    from kvarn.integrations.vllm.config import check_engine, parse

    def cfg(pp: int) -> SimpleNamespace:
        return SimpleNamespace(speculative_config=None, kv_transfer_config=None,
                               cache_config=SimpleNamespace(block_size=128),
                               parallel_config=SimpleNamespace(pipeline_parallel_size=pp))

    check_engine(cfg(1), parse({"preset": "kvarn-b2.5-qar"}))
    check_engine(cfg(2), parse({"preset": "kvarn-auto-k2v2-g128"}))  # other presets: not this check's business
    with pytest.raises(ValueError, match="pipeline parallelism"):
        check_engine(cfg(2), parse({"preset": "kvarn-b2.5-qar"}))
