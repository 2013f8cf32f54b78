"""`SlotTable.stats` and `write_stats` (the KVARN_POOL_STATS file) on hand-made block tables, without vLLM.

Tile G = 4, one sink block, 8 slots: each step lists, per request, its token rows, tokens computed before the step,
tokens after it and its physical block ids, as the metadata builder passes them to `SlotTable.plan`.
"""

from __future__ import annotations

import json

from kvarn.integrations.vllm.pool import PoolStats, SlotTable, write_stats

G = 4


def _step(table: SlotTable, reqs: list[tuple[int, int, list[int]]]) -> PoolStats:
    """One step over (computed, length, blocks) per request; the stats after it, checked for conservation."""
    rows, start = [], 0
    for nc, n, _ in reqs:
        rows.append((start, start + n - nc))
        start += n - nc
    table.plan(rows, [r[0] for r in reqs], [r[1] for r in reqs], [r[2] for r in reqs])
    st = table.stats()
    assert st.free + st.held == st.slots, st  # every slot is free or held by exactly one block
    assert st.sinks + st.exact + st.pinned + st.idle >= st.held >= st.idle, st
    return st


def test_stats_follow_the_slot_lifetimes() -> None:
    table = SlotTable(8, G, 1)
    assert table.stats() == PoolStats(step=0, slots=8, free=8, held=0, sinks=0, exact=0, pinned=0, pending=0, idle=0,
                                      evictions=0, lost_sink_reads=0)
    # request A: a 6-token prompt in blocks 10 (sink) and 11 (filling)
    st = _step(table, [(0, 6, [10, 11])])
    assert (st.step, st.held, st.sinks, st.pinned, st.pending, st.idle) == (1, 2, 1, 2, 0, 0)
    _step(table, [(6, 7, [10, 11])])
    st = _step(table, [(7, 8, [10, 11])])  # block 11 completes: read exact this step, freed at the next
    assert (st.held, st.pending) == (2, 1)
    st = _step(table, [(8, 9, [10, 11, 12])])  # 11 freed, 12 filling
    assert (st.held, st.sinks, st.pending, st.free) == (2, 1, 0, 6)
    # A has ended (the backend is not told); request B: 5 tokens in blocks 20 (sink) and 21
    st = _step(table, [(0, 5, [20, 21])])
    assert (st.held, st.sinks, st.pinned, st.idle) == (4, 2, 2, 1)  # A's last partial block 12 is idle
    # a block kept exact in some layer (`take_exact` + the layer's mark) is held, counted, never idle
    plan = table.plan([(0, 4)], [0], [4], [[30]])  # request C: one complete block, a sink
    plan = table.plan([(0, 4)], [4], [8], [[30, 31]])  # block 31 completes in this step
    plan.take_exact(31)
    plan.exact.setdefault(31, set()).add("layer.0")
    st = table.stats()
    assert (st.held, st.exact, st.sinks, st.idle) == (6, 1, 3, 2)  # idle: A's block 12 and B's 21 (B ended too)
    assert table.stats() == st  # a pure read


def test_stats_count_evictions_and_lost_sink_reads() -> None:
    table = SlotTable(3, G, 1)
    _step(table, [(0, 6, [1, 2])])  # A: sink 1, filling 2
    # B: sink 3 takes the last slot; filling 4 evicts a slot of a block B does not touch, a partial block before a
    # sink: A's block 2 (A's sink 1 is as old)
    st = _step(table, [(0, 5, [3, 4])])
    assert (st.held, st.free, st.evictions, st.sinks, st.idle) == (3, 0, 1, 2, 0)
    assert 2 not in table.slot_of and 1 in table.slot_of
    st = _step(table, [(0, 5, [5, 6])])  # C evicts B's block 4 (partial), then the older sink: A's 1
    assert (st.held, st.evictions, st.sinks, st.idle) == (3, 3, 2, 0)
    assert 1 not in table.slot_of and 3 in table.slot_of
    st = _step(table, [(4, 6, [1, 7])])  # a prefix-cache hit on A's sink block 1, evicted: its packed copy is read
    assert st.lost_sink_reads == 1


def test_write_stats_is_atomic_json(tmp_path) -> None:
    table = SlotTable(8, G, 1)
    _step(table, [(0, 6, [10, 11])])
    path = tmp_path / "pool.json"
    path.write_text("stale")
    write_stats(str(path), table.stats())
    got = json.loads(path.read_text())
    assert got.pop("pid") > 0 and got.pop("time") > 0
    assert got == table.stats().as_dict()
    assert [p.name for p in tmp_path.iterdir()] == ["pool.json"]  # the temp file was renamed over it
