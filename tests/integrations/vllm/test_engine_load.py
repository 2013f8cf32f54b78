"""Load on the k4v2 OpenAI server (conftest.py's `server`, shared with test_engine_server.py: no extra vLLM start).

Client threads on 127.0.0.1 stream greedy completions of prompts of mixed lengths (`EXTRA_LENGTHS` 380/50/250/120
and engine_common.prompts()' 150/300/400/472 tokens; the 380 and the 150, the 250 and the 400 share their first block:
prefix-cache hits on a shared sink) and close some streams after a few tokens (a cancellation mid-stream: vLLM
aborts the request). Each round submits `requests` requests from `clients` threads; a deadline bounds the run (no
request is submitted after it, and a request without an answer by then is lost). Checks, per round:
  * 0 errors: every request not cancelled ends with finish_reason "length" after exactly `new` tokens;
  * 0 lost: every request submitted got its answer or is one of those we cancelled;
  * every answer (a cancelled one on the tokens it got) equals that prompt's one-at-a-time greedy answer from the same
    server (conftest's `sequential`, and the extra prompts' one at a time here) up to the near-tie rule
    (`engine_common.near_tie_divergence`), and most agree throughout;
  * no fp pool slot leaks (`kvarn.integrations.vllm.pool.PoolStats`, the server's KVARN_POOL_STATS file), read with the
    server idle (no request running or waiting, no new step). The backend is not told when a request ends, so the
    slots of a finished request's blocks stay held until vLLM reuses those blocks; vLLM 0.32 hands out the blocks no
    prefix can match (a request's last partial block) first, most recently freed first, and cached full blocks last
    (`BlockPool.free_blocks`), and every round allocates at least one new block per request. So at an idle point:
      - free + held == slots (a slot that left the free list and that no block holds is lost for good);
      - held - sinks - exact <= `nonsink_bound(round)`: at most the last partial blocks of the latest round's requests
        that are not sinks (the earlier rounds' were reused by this one). A block that completes is released at the
        next step: were that lost, the complete blocks of every earlier request that completed one while decoding
        (each 380- and 250-token one, within 4 and 6 tokens, and the warm-up's) would stay held on top;
      - sinks grow from one idle point to the next by at most the round's requests whose prompt is shorter than the
        sink (their sink block is theirs: a block completed while decoding is cached under a hash no prompt matches,
        so it keeps its slot until vLLM recycles it or the pool evicts it), and by none else (the prompts' full sink
        blocks are prefix-cache hits since the warm-up);
      - the blocks kept exact are those of the start (no tile here is unquantizable); no sink read is lost while
        nothing was evicted.
    Once the pool is full (the long form), the least recently used idle slot is evicted: both bounds still hold (an
    eviction only lowers held), and a prefix-cache hit on an evicted sink reads its packed copy (`lost_sink_reads`).
  * memory: the RSS of the process that holds the pool and runs the model (the pid in the stats file: vLLM's CPU
    worker) and of its parent, vLLM's EngineCore (the scheduler, the requests' state), read from /proc every 0.2 s,
    each stays within `RSS_MIB` of its value at the end of the first round (which pays for the first batched steps'
    buffers). The KV cache and the fp pool are preallocated (1 GiB), so a request's own state is Python objects of
    kilobytes; the bound leaves room for the allocators' arenas. A coarse check in the short form (16 requests),
    stronger in the long one;
  * the server still answers afterwards, as before the load.
The short form runs in `make test-vllm`; the long form (`-m slow`, sized by KVARN_LOAD_* below) runs the same code.
Figures go to out/vllm/engine.json under "load" / "load_long".
"""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlparse
from urllib.request import urlopen

import pytest

from .engine_common import REQUEST_TIMEOUT, Server, near_tie_divergence, prompts, record, top2_gaps

pytestmark = [pytest.mark.model, pytest.mark.timeout(3600)]

# prompt tokens besides prompts()': two that complete a block past the sink within 4 and 6 new tokens, one shorter than
# the sink, one whose sink block completes while decoding; in this order, so that no cancelled request is one of the two
EXTRA_LENGTHS = (380, 50, 250, 120)
G, SINK_BLOCKS = 128, 1  # kvarn-k4v2-g128: tile and sink blocks
CANCEL_AFTER = 3  # tokens read before a cancelled stream is closed
RSS_MIB = 48


@dataclass
class Load:
    clients: int
    requests: int  # per round
    new: int  # max_tokens
    cancel_every: int  # request i of a round is cancelled when i % cancel_every == cancel_every - 1
    rounds: int
    deadline_s: float


SHORT = Load(clients=8, requests=8, new=12, cancel_every=4, rounds=2, deadline_s=300)


def long_form() -> Load:
    env = os.environ.get
    return Load(clients=int(env("KVARN_LOAD_CLIENTS", 8)), requests=int(env("KVARN_LOAD_REQUESTS", 40)),
                new=int(env("KVARN_LOAD_NEW", 16)), cancel_every=int(env("KVARN_LOAD_CANCEL_EVERY", 5)),
                rounds=int(env("KVARN_LOAD_ROUNDS", 5)), deadline_s=float(env("KVARN_LOAD_DEADLINE_S", 1800)))


@dataclass
class Answer:
    tokens: list[int] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    finish: str | None = None
    cancelled: bool = False
    error: str | None = None


def stream(server: Server, prompt: list[int], new: int, cancel_after: int | None) -> Answer:
    """One streamed greedy completion; the connection is closed after `cancel_after` tokens when given."""
    url = urlparse(server.base)
    assert url.hostname == "127.0.0.1"
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=REQUEST_TIMEOUT)
    ans = Answer()
    try:
        body = {"model": "smollm2", "prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True,
                "return_token_ids": True, "logprobs": 2, "return_tokens_as_token_ids": True}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            ans.error = f"HTTP {r.status}: {r.read()[:500]!r}"
            return ans
        while True:
            line = r.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            c = json.loads(line[6:])["choices"][0]
            ans.tokens += c.get("token_ids") or []
            if c.get("logprobs"):
                ans.gaps += top2_gaps(c["logprobs"]["top_logprobs"])
            ans.finish = c.get("finish_reason") or ans.finish
            if cancel_after is not None and len(ans.tokens) >= cancel_after and ans.finish is None:
                ans.cancelled = True
                return ans
    except Exception as e:  # every failure is counted and reported
        ans.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    return ans


def last_block_held(prompt: int, new: int) -> int:
    """1 if a finished request's last partial block is not a sink (it then holds a non-sink slot until vLLM reuses
    the block), else 0. The cache ends at prompt + new - 1 tokens (the last token sampled is never written); a
    cancelled request ends somewhere before: counted as if it had run to the end (an upper bound)."""
    return int((prompt + new - 2) // G >= SINK_BLOCKS)


def proc_status(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def rss_mib(pids: dict[str, int]) -> dict[str, float]:
    return {name: proc_status(pid, "VmRSS") / 1024 for name, pid in pids.items()}


def idle_stats(server: Server, timeout: float = 120) -> dict:
    """The pool stats once no request is running or waiting (vLLM's /metrics) and no step ran for 0.5 s."""
    end = time.time() + timeout
    st = server.pool()
    while time.time() < end:
        time.sleep(0.5)
        with urlopen(f"{server.base}/metrics", timeout=30) as r:
            busy = sum(float(line.rsplit(" ", 1)[1]) for line in r.read().decode().splitlines()
                       if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting{")))
        now = server.pool()
        if not busy and now["step"] == st["step"]:
            return now
        st = now
    raise AssertionError(f"the server did not go idle within {timeout} s")


class Sampler(threading.Thread):
    """RSS of some processes every 0.2 s, until stopped."""

    def __init__(self, pids: dict[str, int]) -> None:
        super().__init__(daemon=True)
        self.pids, self.samples, self.stop = pids, [], threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.2):
            self.samples.append(rss_mib(self.pids))


def run_load(server: Server, sequential: list[tuple[list[int], list[float]]], load: Load, key: str) -> None:
    t0 = time.time()
    deadline = t0 + load.deadline_s
    ps = prompts(EXTRA_LENGTHS) + prompts()
    lengths = [len(p) for p in ps]
    # one at a time (with the warm-up of conftest's `sequential`, every prompt's full blocks are cached)
    reference = [server.greedy(p, load.new) for p in ps[:len(EXTRA_LENGTHS)]] + sequential
    assert all(len(t) >= load.new for t, _ in reference)
    t_ref = time.time()
    start = idle_stats(server)
    assert start["free"] + start["held"] == start["slots"], f"slots neither free nor held: {start}"
    pids = {"worker": start["pid"], "engine_core": proc_status(start["pid"], "PPid")}
    sampler = Sampler(pids)
    sampler.start()
    rss_start = rss_mib(pids)
    before, after_first = start, None
    totals = {"requests": 0, "completed": 0, "cancelled": 0, "errors": 0, "lost": 0, "not_submitted": 0,
              "diverged_at_near_tie": 0}
    rounds = []
    try:
        for rnd in range(load.rounds):
            jobs = [(i % len(ps), i % load.cancel_every == load.cancel_every - 1) for i in range(load.requests)]

            def one(job: tuple[int, bool]) -> Answer | None:
                if time.time() > deadline:
                    return None  # not submitted: the run's time is up
                p, cancel = job
                return stream(server, ps[p], load.new, CANCEL_AFTER if cancel else None)

            with ThreadPoolExecutor(load.clients) as ex:
                futures = [ex.submit(one, j) for j in jobs]
                answers = []
                for f in futures:
                    try:
                        answers.append(f.result(timeout=max(1.0, deadline + REQUEST_TIMEOUT - time.time())))
                    except TimeoutError:
                        answers.append(Answer(error="lost: no answer by the deadline"))
            submitted = [(j, a) for j, a in zip(jobs, answers) if a is not None]
            lost = [j for j, a in submitted if not a.cancelled and a.finish is None and not a.error]  # stream ended
            assert not lost, f"round {rnd}: {len(lost)} requests lost (their stream ended without an answer): {lost}"
            errors = [(j, a.error or f"finish {a.finish}, {len(a.tokens)} tokens") for j, a in submitted
                      if a.error or (not a.cancelled and (a.finish != "length" or len(a.tokens) != load.new))]
            assert not errors, f"round {rnd}: {len(errors)} errors: {errors[:5]}"
            assert all(a.cancelled == c for (_, c), a in submitted), "a stream meant to be cancelled completed"
            diverged = [d for (p, _), a in submitted
                        if (d := near_tie_divergence((a.tokens, a.gaps), reference[p],
                                                     f"round {rnd}, prompt {p}: under load and one at a time"))]
            assert len(diverged) <= len(submitted) // 2, f"most answers should agree throughout: {diverged}"
            st = idle_stats(server)
            if after_first is None:
                after_first = (rss_mib(pids), len(sampler.samples))
            nonsink = sum(last_block_held(lengths[p], load.new) for (p, _), _ in submitted)
            own_sinks = sum(lengths[p] < SINK_BLOCKS * G for (p, _), _ in submitted)
            check_pool(before, st, nonsink, own_sinks, rnd)
            rounds.append({k: st[k] for k in ("held", "sinks", "free", "evictions", "lost_sink_reads")}
                          | {"nonsink_bound": nonsink, "seconds": round(time.time() - t0, 1)})
            before = st
            totals["requests"] += len(submitted)
            totals["not_submitted"] += len(jobs) - len(submitted)
            totals["cancelled"] += sum(a.cancelled for _, a in submitted)
            totals["completed"] += sum(not a.cancelled for _, a in submitted)
            totals["diverged_at_near_tie"] += len(diverged)
    finally:
        sampler.stop.set()
        sampler.join()
    end_rss = rss_mib(pids)
    base_rss, first = after_first
    top = {n: max(r[n] for r in [*sampler.samples[first:], end_rss]) for n in pids}
    for n in pids:
        assert top[n] - base_rss[n] <= RSS_MIB, (f"the {n}'s RSS grew from {base_rss[n]:.0f} MiB (end of round 1) to "
                                                 f"{top[n]:.0f} MiB (bound {RSS_MIB} MiB)")
    after = server.greedy(ps[0], load.new)
    assert len(after[0]) == load.new
    near_tie_divergence(after, reference[0], "the server after the load and before it")
    record(key, {**totals, "clients": load.clients, "requests_per_round": load.requests, "rounds": load.rounds,
                 "new_tokens": load.new, "prompt_tokens": lengths, "cancel_after_tokens": CANCEL_AFTER,
                 "pool_start": start, "pool_end": before, "pool_after_each_round": rounds,
                 "rss_mib": {n: {"start": round(rss_start[n], 1), "after_round_1": round(base_rss[n], 1),
                                 "max_after_round_1": round(top[n], 1), "end": round(end_rss[n], 1)} for n in pids},
                 "references_s": round(t_ref - t0, 1), "wall_s": round(time.time() - t0, 1)})


def check_pool(before: dict, after: dict, nonsink_bound: int, own_sinks: int, rnd: int) -> None:
    """The no-leak invariant of the module docstring, at an idle point after a round (`before`: the previous one)."""
    where = f"round {rnd}: pool {before} -> {after}"
    assert after["free"] + after["held"] == after["slots"], f"{where}: slots neither free nor held"
    assert after["exact"] == before["exact"], f"{where}: blocks kept exact changed"
    nonsink = after["held"] - after["sinks"] - after["exact"]
    assert nonsink <= nonsink_bound, (f"{where}: {nonsink} non-sink slots held, more than the {nonsink_bound} last "
                                      "partial blocks of this round's requests")
    assert after["sinks"] - before["sinks"] <= own_sinks, f"{where}: sinks grew by more than {own_sinks}"
    if after["evictions"] == before["evictions"]:
        assert after["lost_sink_reads"] == before["lost_sink_reads"], f"{where}: a sink read lost, none evicted"


def test_load_short(server, sequential) -> None:
    run_load(server, sequential, SHORT, "load")


@pytest.mark.slow
def test_load_long(server, sequential) -> None:
    run_load(server, sequential, long_form(), "load_long")
