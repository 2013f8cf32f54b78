"""The fp pool's size (`pool.fp_slots_for`) against a scheduler that follows vLLM's rules, without vLLM.

`Scheduler` is vLLM V1's token-budget loop (vllm/v1/core/sched/scheduler.py) cut down to what decides the block
tables: running requests in order, each its remaining prompt or one decode token, cut at the budget (then the budget
is spent), optionally cut at `long_prefill_token_threshold`; then waiting requests admitted while budget and
max_num_seqs allow; finished requests' blocks freed and reused (LIFO, so block ids come back soon). Each step goes
through `SlotTable.plan` as the metadata builder passes it. With exactly `fp_slots_for` slots no step runs out, no
running request loses its block being filled and no sink read falls back to a packed copy; one slot fewer fails
some schedule, and so does one reserve block for the engine under a threshold (so each reserve is needed and the
check can fail).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from kvarn.integrations.vllm.pool import SlotTable, fp_slots_for

G = 8  # tokens per block (vLLM's block = kvarn's tile); small so prompts span many blocks


@dataclass
class Req:
    prompt: int
    new: int
    computed: int = 0
    blocks: list[int] = field(default_factory=list)

    def want(self, budget: int, threshold: int) -> int:
        """Tokens this request writes this step: the rest of its prompt (cut at the threshold, if any) or one decode
        token, cut at the budget."""
        n = self.prompt - self.computed if self.computed < self.prompt else 1
        return min(threshold if 0 < threshold < n else n, budget)

    def done(self) -> bool:
        return self.computed >= self.prompt + self.new - 1  # the last sampled token is never written


@dataclass
class Scheduler:
    seqs: int
    budget: int
    threshold: int = 0
    waiting: list[Req] = field(default_factory=list)
    running: list[Req] = field(default_factory=list)
    free: list[int] = field(default_factory=lambda: list(range(10_000)))

    def step(self, table: SlotTable) -> None:
        sched: list[tuple[Req, int]] = []
        budget = self.budget
        for r in self.running:
            if budget <= 0:  # vLLM's loop stops here: later running requests wait a step
                break
            sched.append((r, r.want(budget, self.threshold)))
            budget -= sched[-1][1]
        while budget > 0 and self.waiting and len(self.running) < self.seqs:
            self.running.append(self.waiting.pop(0))
            sched.append((self.running[-1], self.running[-1].want(budget, self.threshold)))
            budget -= sched[-1][1]
        rows, computed, lengths, tables, start = [], [], [], [], 0
        for r, n in sched:
            while len(r.blocks) * G < r.computed + n:
                r.blocks.append(self.free.pop())
            rows.append((start, start + n))
            start += n
            computed.append(r.computed)
            lengths.append(r.computed + n)
            tables.append(list(r.blocks[:-(-(r.computed + n) // G)]))
        plan = table.plan(rows, computed, lengths, tables)
        g, sb = table.tile, table.sink_blocks
        for p in plan.requests:  # what write_step needs: a slot for every sink and every block left incomplete
            for j in range(p.computed // g, len(p.blocks)):
                if j < sb or (j + 1) * g > p.length:
                    assert p.slots[j] is not None, (p, j)
        for r, n in sched:
            r.computed += n
        for r in [r for r, _ in sched if r.done()]:
            self.running.remove(r)
            self.free.extend(reversed(r.blocks))


def run(seed: int, slack: int = 0, threshold: int = 0, per_sequence: bool | None = None) -> SlotTable:
    """One random schedule through a table of `fp_slots_for` + slack slots, reserving a crossing block per sequence
    when `per_sequence` (default: when a threshold is set, as `backend.crossing_requests` does)."""
    rnd = random.Random(seed)
    seqs, sink = rnd.randint(1, 6), rnd.randint(0, 2)
    budget = rnd.choice([seqs, 2 * G + 3, 5 * G - 1, 11 * G + 5])
    budget = max(budget, seqs)  # vLLM requires max_num_batched_tokens >= max_num_seqs
    crossing = seqs if (bool(threshold) if per_sequence is None else per_sequence) else 1
    table = SlotTable(fp_slots_for(sink, seqs, crossing) + slack, G, sink)
    s = Scheduler(seqs, budget, threshold)
    s.waiting = [Req(rnd.randint(1, 9 * G), rnd.randint(1, 4 * G)) for _ in range(rnd.randint(1, 14))]
    while s.waiting or s.running:
        s.step(table)
    return table


SEEDS = range(300)


@pytest.mark.parametrize("threshold", [0, 5, 2 * G + 1])
def test_pool_holds_every_schedule(threshold: int) -> None:
    for seed in SEEDS:
        table = run(seed, threshold=threshold)
        assert table.lost_sink_reads == 0, seed


def _failures(**kw) -> int:
    failed = 0
    for seed in SEEDS:
        try:
            run(seed, **kw)
        except RuntimeError:  # a full pool, or a running request's block being filled evicted
            failed += 1
    return failed


def test_one_slot_fewer_runs_out() -> None:
    """The reserve is needed: with one slot less than `fp_slots_for`, some schedule stops on a full pool."""
    assert _failures(slack=-1) > 0


@pytest.mark.parametrize("threshold", [5, 2 * G + 1])
def test_threshold_needs_a_reserve_per_sequence(threshold: int) -> None:
    """With `long_prefill_token_threshold` several prefills continue blocks in one step: one reserve block for the
    engine is not enough."""
    assert _failures(threshold=threshold, per_sequence=False) > 0


def test_backend_reserves_per_sequence_with_a_threshold() -> None:
    from types import SimpleNamespace

    pytest.importorskip("vllm")
    from kvarn.integrations.vllm.backend import crossing_requests

    def cfg(t: int) -> SimpleNamespace:
        return SimpleNamespace(scheduler_config=SimpleNamespace(long_prefill_token_threshold=t))

    assert crossing_requests(cfg(0), 16) == 1
    assert crossing_requests(cfg(512), 16) == 16
