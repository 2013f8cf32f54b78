"""CPU time of one layer of the vLLM backend's decode step, without vLLM: `write_step` + `attend_step` for 8 decode
rows of SmolLM2-135M's geometry (3 KV heads, 9 query heads, D = 64, bf16, G = 128, one sink block, contexts of
--context to --context + 49 tokens, 512 by default) over a page pool of real packed tiles.

    PYTHONPATH=$PWD .venv/bin/python scripts/vllm_layer_step.py [PRESET] [--profile] [--repeat N] [--rounds N]
        [--layers N] [--threads N] [--parts] [--rows-layout] [--context N]

Prints the CPU time (`time.process_time`, so a shared machine's load does not enter; 1 thread unless --threads) per
layer of each
call and x 30 layers, and of the prompts' store (8 prompts of ~540 tokens: 32 completed blocks encoded in one call,
kvarn-auto's query statistics updated first, as the backend's forward does); --profile adds cProfile's top lines
(wall time) of 10 layer-steps; --rounds N times N rounds of 30 steps and reports the median (min and max
beside it); --repeat N runs N more attend calls after the timing, for a sampling profiler
(`perf record -o /tmp/p.data ... --repeat 3000`, then `perf report -i /tmp/p.data --dsos kvarn_cpu_decode.so
--sort symbol`: where the C++ kernel spends its time); --layers N gives each of N layers its own pool and times the
step over all of them, so that, as in the engine, a layer's rows are no longer in the cache when it is read again
(`--layers 30 --threads 2`: what the engine's decode meets); --threads N: N threads (wall time as well as CPU time);
--context N: the first request's context (default 512; the others 7 tokens more each);
--parts times the decode kernel call alone (1 pool, 1 thread, CPU time, best of 7 rounds) with its work cut down:
whole, packed tiles only, dense rows (sinks and current blocks) only, neither: the fixed cost per call, and what a
packed token and a dense row cost above it; then the same dense rows gathered into one contiguous segment, bf16 and
float32 (what the row ids cost; whether the bytes read bound the rows); --rows-layout (with --layers N, --rounds N,
--threads N) times the decode kernel call of every layer with the sink and current-block rows read in place from the
pool's fp slots (`LayerPool.rows`: a head's rows of a slot in one run) and from a copy of the same rows laid out
contiguously per request (the same bits, checked): what reading them through row ids costs. Used for docs/VLLM.md.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pstats
import time

import torch

from kvarn.attention import launch as kernel
from kvarn.integrations.vllm import paged
from kvarn.integrations.vllm.layout import TileLayout, choose_geometry
from kvarn.integrations.vllm.pool import LayerPool, SlotTable
from kvarn.ops.decode import indexed_rows
from kvarn.presets import get_preset

H, HQ, D, G, R, LAYERS = 3, 9, 64, 128, 8, 30


@dataclasses.dataclass
class Prefilled:
    pools: list[LayerPool]  # one per layer, the prompts stored
    table: SlotTable
    blocks: list[list[int]]  # per request, its block ids
    lens: list[int]  # per request, the tokens stored
    observe_ms: float  # CPU time of the first pool's prompt store: the query statistics ...
    store_ms: float  # ... and all of it


def prefilled(preset: str, layers: int = 1, context: int = 512) -> Prefilled:
    """R prompts of `context` + 7 r tokens stored in `layers` page pools (seed 0): packed tiles, sinks and filling
    blocks, as the backend's prefill leaves them."""
    torch.manual_seed(0)
    lay = TileLayout(get_preset(preset), D, torch.bfloat16)
    geo = choose_geometry(lay, H, LAYERS, 2**30, slots=3 * 16)
    pools = [LayerPool(torch.zeros(2000, H, G, geo.c, dtype=torch.uint8), geo) for _ in range(layers)]
    table = SlotTable(pools[0].n_slots, G, 1)
    nb = -(-(context + 7 * R + 64) // G)  # blocks per request: its context and the decode steps timed
    blocks = [list(range(1 + nb * r, 1 + nb * (r + 1))) for r in range(R)]
    lens = [context + 7 * r for r in range(R)]
    starts = [sum(lens[:r]) for r in range(R)]
    plan = table.plan([(s, s + n) for s, n in zip(starts, lens)], [0] * R, lens,
                      [b[:-(-n // G)] for b, n in zip(blocks, lens)])
    for q_ in (lay.key_q, lay.value_q):  # load the store kernel before timing
        q_.encode_tiles(torch.randn(2, G, D), torch.ones(2, D) if q_.takes_weight else None)
    queries = torch.randn(sum(lens), HQ, D).bfloat16()
    for p in reversed(pools):  # the first pool last: its times are the ones kept
        t0 = time.process_time()
        paged.observe_queries(p, queries)  # kvarn-auto: before the store
        observe = (time.process_time() - t0) * 1e3
        paged.write_step(p, plan, torch.randn(sum(lens), H, D).bfloat16(), torch.randn(sum(lens), H, D).bfloat16(),
                         "bench")  # the prompts: packed tiles, sinks and filling blocks
        store = (time.process_time() - t0) * 1e3
    return Prefilled(pools, table, blocks, lens, observe, store)


def decode_plan(table: SlotTable, blocks: list[list[int]], lens: list[int], new: list[int]):
    """The step plan of one decode token per request, from `lens` to `new` tokens."""
    return table.plan([(i, i + 1) for i in range(R)], list(lens), list(new),
                      [b[:-(-x // G)] for b, x in zip(blocks, new)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("preset", nargs="?", default="kvarn-k2v2-g128")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--repeat", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--parts", action="store_true")
    ap.add_argument("--rows-layout", action="store_true")
    ap.add_argument("--context", type=int, default=512, help="tokens of context of the first request (default 512)")
    args = ap.parse_args()
    preset = args.preset
    torch.set_num_threads(args.threads)
    b = prefilled(preset, args.layers, args.context)
    pools, table, blocks, lens = b.pools, b.table, b.blocks, b.lens
    pool = pools[0]

    def step(n: int) -> tuple[float, float, float]:
        plan = decode_plan(table, blocks, lens, [x + 1 for x in lens])
        lens[:] = [x + 1 for x in lens]
        q, k, v = (torch.randn(R, h, D).bfloat16() for h in (HQ, H, H))
        out = torch.zeros_like(q)
        t0 = time.process_time()
        for _ in range(n):
            for p in pools:
                paged.observe_queries(p, q)
                exact = paged.write_step(p, plan, k, v, "bench")  # the same rows for every layer
        t1 = time.process_time()
        w1 = time.perf_counter()
        for _ in range(n):
            for p in pools:
                paged.attend_step(p, plan, q, out, exact, D ** -0.5, None, "bench")
        wall = (time.perf_counter() - w1) / (n * len(pools)) * 1e3
        return (time.process_time() - t1) / (n * len(pools)) * 1e3, (t1 - t0) / (n * len(pools)) * 1e3, wall

    step(3)
    rounds = args.rounds
    times = sorted(step(30) for _ in range(rounds))  # by attend time
    attend, write, wall = times[len(times) // 2]  # the median round: a loaded machine's outliers left out
    if rounds > 1:
        print(f"attend per layer over {rounds} rounds of 30: min {times[0][0]:.3f}, median {attend:.3f}, "
              f"max {times[-1][0]:.3f} ms")
    print(f"{preset}, {args.layers} layer pool(s), {args.threads} thread(s): attend {wall:.3f} ms per layer (wall "
          f"time)")
    print(f"{preset}: per layer write {write:.3f} ms, attend {attend:.3f} ms (CPU time); x{LAYERS} layers = "
          f"{LAYERS * (write + attend):.1f} ms per step; the prompts' store {b.store_ms:.1f} ms per layer "
          f"({LAYERS * b.store_ms:.0f} ms x{LAYERS}), of which the query statistics {b.observe_ms:.1f} ms")
    if args.repeat:
        step(args.repeat)
    if args.profile:
        prof = cProfile.Profile()
        prof.runcall(step, 10)
        pstats.Stats(prof).sort_stats("tottime").print_stats(8)
    if args.parts:
        parts(pool, decode_plan(table, blocks, [x - 1 for x in lens], lens))
    if args.rows_layout:
        rows_layout(pools, decode_plan(table, blocks, [x - 1 for x in lens], lens), rounds)


def parts(pool: LayerPool, plan) -> None:
    """The decode kernel call of `paged.batched_decode` timed with its work cut down (module docstring)."""
    torch.set_num_threads(1)
    batch = paged.decode_batch(plan, pool)
    q = torch.randn(R, HQ, D).bfloat16()
    no_tiles = {"n_blocks": torch.zeros_like(batch.n_blocks)}
    one_row = {"dense_index": batch.dense_index[:, :, :1].contiguous(),  # a single dense row, always allowed
               "bias": batch.bias[..., :batch.tiles_len + 1].contiguous()}
    cases = {"whole": {}, "tiles only": one_row, "dense only": no_tiles, "neither": {**no_tiles, **one_row}}
    ms = {}
    for name, cut in cases.items():
        b = dataclasses.replace(batch, **cut)
        ms[name] = _best_ms(lambda b=b: paged.batched_decode(pool, b, q, D ** -0.5, None))
        print(f"kernel call, {name}: {ms[name]:.3f} ms (CPU time, 1 thread, best of 7 rounds of 200)")
    tokens = int(batch.n_blocks.sum()) * G * H  # packed (token, KV head) pairs of the call
    rows = int((batch.bias[:, 0, 0, batch.tiles_len:] == 0).sum()) * H  # dense (row, KV head) pairs the mask allows
    print(f"fixed cost per call {ms['neither'] * 1e3:.0f} us; a packed token and KV head "
          f"{(ms['tiles only'] - ms['neither']) * 1e6 / tokens:.1f} ns; a dense row and KV head "
          f"{(ms['dense only'] - ms['neither']) * 1e6 / rows:.1f} ns ({tokens} and {rows} in the call)")
    # the same dense rows gathered into one contiguous segment [B, H, t, D] (the transformers cache's form), in the
    # pool's bf16 and in float32: what reading them through row ids costs, and whether the bytes read bound them
    k, v = indexed_rows(pool.rows, batch.dense_index)
    none = dataclasses.replace(batch, **no_tiles)
    for dtype in (torch.bfloat16, torch.float32):
        kd, vd = k.to(dtype).contiguous(), v.to(dtype).contiguous()

        def call(kd: torch.Tensor = kd, vd: torch.Tensor = vd) -> torch.Tensor:
            return kernel.decode_attention(q.float()[:, :, None], *pool.tiles, none.table, none.n_blocks, G,
                                           scaling=D ** -0.5, bias=none.bias, validate=False,
                                           dense=[(kd, vd, none.tiles_len)])

        assert dtype != torch.bfloat16 or torch.equal(call()[:, :, 0], paged.batched_decode(pool, none, q, D ** -0.5,
                                                                                              None))
        t = _best_ms(call)
        print(f"dense only, the rows as one contiguous {str(dtype).removeprefix('torch.')} segment: {t:.3f} ms "
              f"({(t - ms['neither']) * 1e6 / rows:.1f} ns a row and KV head)")


def rows_layout(pools: list[LayerPool], plan, rounds: int) -> None:
    """The decode kernel call of every pool, its dense rows read in place or from per-request contiguous copies."""
    batch = paged.decode_batch(plan, pools[0])
    b, _, t = batch.dense_index.shape
    q = torch.randn(b, HQ, D).bfloat16().float().view(b, H, HQ // H, D)
    index = torch.stack([torch.arange(b)[:, None] * 2 * t + torch.arange(t),
                         torch.arange(b)[:, None] * 2 * t + t + torch.arange(t)], 1).contiguous()  # [B, 2, t]
    copies = [torch.cat(indexed_rows(p.rows, batch.dense_index), 2).contiguous() for p in pools]  # [B, H, 2t, D]

    def call(p: LayerPool, rows: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return kernel.decode_rows(q, *p.tiles, batch.table, batch.n_blocks, G, (rows, idx, batch.tiles_len),
                                  batch.bias, D ** -0.5)

    assert all(torch.equal(call(p, p.rows, batch.dense_index), call(p, c, index)) for p, c in zip(pools, copies))
    ms = {"in place": [], "contiguous copy": []}
    for _ in range(max(rounds, 3)):
        for name, args in (("in place", [(p, p.rows, batch.dense_index) for p in pools]),
                           ("contiguous copy", [(p, c, index) for p, c in zip(pools, copies)])):
            t0 = time.perf_counter()
            for a in args:
                call(*a)
            ms[name].append((time.perf_counter() - t0) / len(pools) * 1e3)
    for name, xs in ms.items():
        print(f"decode kernel call, rows {name}: median {sorted(xs)[len(xs) // 2]:.3f} ms per layer (wall time, "
              f"{len(pools)} layer pools, {torch.get_num_threads()} threads, {len(xs)} rounds)")


def _best_ms(f, rounds: int = 7, calls: int = 200) -> float:
    """CPU ms of one call of f: after one untimed call, the best of `rounds` rounds of `calls` calls."""
    f()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.process_time()
        for _ in range(calls):
            f()
        best = min(best, (time.process_time() - t0) / calls * 1e3)
    return best


if __name__ == "__main__":
    main()
