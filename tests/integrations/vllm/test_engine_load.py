"""Load on the k4v2 OpenAI server (conftest.py's `server`, shared with test_engine_server.py: no extra vLLM start).

Client threads on 127.0.0.1 stream greedy completions of prompts of mixed lengths (`LOAD_LENGTHS`, 50 to 500 tokens,
two sharing a prefix), and close some streams after a few tokens (a cancellation mid-stream: vLLM aborts the
request). Each round submits `requests` requests from `clients` threads; a deadline bounds the whole run (no request
is submitted after it, and any request without an answer by then is lost). Checks, per round:
  * 0 errors: every request not cancelled ends with finish_reason "length" after exactly `new` tokens;
  * 0 lost: every request submitted got its answer or is one of those we cancelled;
  * every completed answer (and every cancelled one, on the tokens it got) equals that prompt's one-at-a-time greedy
    answer from the same server up to the near-tie rule (`engine_common.near_tie_divergence`), and most agree
    throughout;
  * no fp pool slot leaks (`kvarn.integrations.vllm.pool.PoolStats`, the server's KVARN_POOL_STATS file), read with
    the server idle (no step for `IDLE_S`). The backend is not told when a request ends, so the slot of a finished
    request's last partial block stays held until vLLM reuses that block, and vLLM hands new requests never-used
    blocks first (its free queue is LRU): occupancy grows with every request until the pool is full, then the least
    recently used idle slot is evicted. "All returned" therefore means, from one idle point to the next:
      - free + held == slots (a slot that left the free list and no block holds is lost for good);
      - the blocks kept exact are those of the start (none is made here; a kept block has no other exact copy);
      - held grows by at most `owned_slots` summed over the round's requests: per request, its own sink blocks
        (those not full in its prompt: vLLM's prefix cache only shares full prompt blocks, and the one-at-a-time warm-up
        already cached every prompt's full ones) plus its last partial block if that is not a sink; sinks grow by
        at most the own sink blocks. A filling block that completes is released at the next step: were that lost,
        each request whose decode completes a block past the sink (here every completed one of 245, 370 and 500
        tokens) would hold one slot more than the bound. No eviction happens below a full pool (then held <= slots).
  * memory: the engine core's RSS (its pid in the stats file, /proc) sampled every 0.2 s stays within `RSS_MIB` of
    its value at the end of the first round (which pays for the first batched steps' buffers). The KV cache and the
    fp pool are preallocated (1 GiB), so a request's own state is Python objects of kilobytes; the bound leaves room
    for the allocators' arenas. It is a coarse check in the short form (tens of requests), stronger in the long one;
  * the server still answers afterwards.
The short form (`make test-vllm`, about a minute on 2 cores) and the long form (`-m slow`, or KVARN_LOAD_* below) run
the same code; figures go to out/vllm/engine.json under "load" / "load_long".
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

import pytest

from .engine_common import REQUEST_TIMEOUT, Server, near_tie_divergence, prompts, record, top2_gaps

pytestmark = [pytest.mark.model, pytest.mark.timeout(3600)]

LOAD_LENGTHS = (50, 120, 245, 370, 500)  # prompt tokens; 245, 370, 500 complete a block within 16 new tokens
G, SINK_BLOCKS = 128, 1  # kvarn-k4v2-g128: tile and sink blocks
CANCEL_AFTER = 3  # tokens read before a cancelled stream is closed
IDLE_S = 1.0  # no engine step for this long: the server is idle
RSS_MIB = 48


@dataclass
class Load:
    clients: int
    requests: int  # per round
    new: int  # max_tokens
    cancel_every: int  # request i of a round is cancelled when i % cancel_every == cancel_every - 1
    rounds: int
    deadline_s: float


SHORT = Load(clients=8, requests=8, new=16, cancel_every=4, rounds=2, deadline_s=240)


def long_form() -> Load:
    env = os.environ.get
    return Load(clients=int(env("KVARN_LOAD_CLIENTS", 8)), requests=int(env("KVARN_LOAD_REQUESTS", 40)),
                new=int(env("KVARN_LOAD_NEW", 32)), cancel_every=int(env("KVARN_LOAD_CANCEL_EVERY", 5)),
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


def owned_slots(prompt: int, final: int | None) -> int:
    """fp slots a finished request can leave held (module docstring): its sink blocks not full in the prompt, plus its
    last partial block when that is not a sink. final None (cancelled: its length is unknown): the most it can be."""
    own_sinks = sum(1 for j in range(SINK_BLOCKS) if (j + 1) * G > prompt and (final is None or j * G < final))
    last = final is None or (final % G != 0 and (final - 1) // G >= SINK_BLOCKS)
    return own_sinks + last


def own_sinks(prompt: int) -> int:
    return sum(1 for j in range(SINK_BLOCKS) if (j + 1) * G > prompt)


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


def idle_stats(server: Server, timeout: float = 60) -> dict:
    """The pool stats once no engine step has run for IDLE_S."""
    end = time.time() + timeout
    st = server.pool()
    while time.time() < end:
        time.sleep(IDLE_S)
        now = server.pool()
        if now["step"] == st["step"]:
            return now
        st = now
    raise AssertionError(f"the server did not go idle within {timeout} s")


class Sampler(threading.Thread):
    """RSS of one process every 0.2 s, until stopped."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.samples, self.stop = pid, [], threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.2):
            self.samples.append(rss_mib(self.pid))


def run_load(server: Server, load: Load, key: str) -> None:
    t0 = time.time()
    deadline = t0 + load.deadline_s
    ps = prompts(LOAD_LENGTHS)
    reference = [server.greedy(p, load.new) for p in ps]  # one at a time (also the warm-up: prompts cached)
    assert all(len(t) == load.new for t, _ in reference)
    start = idle_stats(server)
    pid = start["pid"]
    sampler = Sampler(pid)
    sampler.start()
    rss_start = rss_mib(pid)
    before, after_first = start, None
    totals = {"requests": 0, "completed": 0, "cancelled": 0, "errors": 0, "lost": 0, "not_submitted": 0,
              "diverged_at_near_tie": 0}
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
                after_first = (st, rss_mib(pid), len(sampler.samples))
            bound = sum(owned_slots(LOAD_LENGTHS[p], None if c else LOAD_LENGTHS[p] + load.new)
                        for (p, c), _ in submitted)
            check_pool(before, st, bound, sum(own_sinks(LOAD_LENGTHS[p]) for (p, _), _ in submitted), rnd)
            before = st
            totals["requests"] += len(submitted)
            totals["not_submitted"] += len(jobs) - len(submitted)
            totals["cancelled"] += sum(a.cancelled for _, a in submitted)
            totals["completed"] += sum(not a.cancelled for _, a in submitted)
            totals["diverged_at_near_tie"] += len(diverged)
    finally:
        sampler.stop.set()
        sampler.join()
    end_rss = rss_mib(pid)
    base_rss = after_first[1]
    later = [*sampler.samples[after_first[2]:], end_rss]
    assert max(later) - base_rss <= RSS_MIB, (f"engine core RSS grew from {base_rss:.0f} MiB (end of round 1) to "
                                              f"{max(later):.0f} MiB (bound {RSS_MIB} MiB)")
    assert server.greedy(ps[0], load.new)[0] == reference[0][0], "the server answers differently after the load"
    record(key, {**totals, "clients": load.clients, "rounds": load.rounds, "new_tokens": load.new,
                 "prompt_tokens": list(LOAD_LENGTHS), "pool_start": start, "pool_end": before,
                 "rss_mib": {"start": round(rss_start, 1), "after_round_1": round(base_rss, 1),
                             "max_after_round_1": round(max(later), 1), "end": round(end_rss, 1)},
                 "wall_s": round(time.time() - t0, 1)})


def check_pool(before: dict, after: dict, bound: int, sink_bound: int, rnd: int) -> None:
    """The no-leak invariant of the module docstring, from one idle point to the next."""
    where = f"round {rnd}: pool {before} -> {after}"
    assert after["free"] + after["held"] == after["slots"], f"{where}: slots neither free nor held"
    assert after["exact"] == before["exact"], where
    assert after["lost_sink_reads"] == before["lost_sink_reads"], where
    if after["evictions"] == before["evictions"]:  # below a full pool nothing is evicted: every slot accounted
        assert after["held"] - before["held"] <= bound, f"{where}: held grew by more than {bound}"
        assert after["sinks"] - before["sinks"] <= sink_bound, f"{where}: sinks grew by more than {sink_bound}"
    assert after["held"] <= after["slots"], where


def test_load_short(server) -> None:
    run_load(server, SHORT, "load")


@pytest.mark.slow
def test_load_long(server) -> None:
    run_load(server, long_form(), "load_long")
