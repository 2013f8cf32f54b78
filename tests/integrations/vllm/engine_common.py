"""What the engine tests share: the model folders, the prompts, CPU vLLM runs (each once per session), the report.

Every vLLM engine start costs about a minute on 2 cores, so each configuration runs once per pytest session
(`engine(name)`, memoized) and the tests of all modules read its result:

    stock      vLLM's own attention: the plugin installed and loaded, not enabled (what an installed but unused
               kvarn leaves): greedy tokens, KV capacity. That this is exactly vLLM without the plugin is checked
               against `no-plugin` by a slow test (test_engine_llm.py): one engine start fewer in `make test`
    no-plugin  VLLM_PLUGINS="" (no plugin loaded at all); no-plugin-again: the same, a second time
    auto       the default preset kvarn-auto-k2v2-g128 (`AUTO`), the same job as stock: greedy tokens, KV capacity,
               generate time (test_engine_auto.py)
    auto-qar   the same with query-aware keys (`AUTO_QAR`; a slow test of test_engine_auto.py)
    auto-qar-clip  the same with clipped 2-bit grids (`AUTO_QAR_CLIP`; the same slow test)
    budget     the budget preset `BUDGET` (kvarn-b2.5-qar: key widths per layer, one allocation per engine), the same
               job (test_engine_auto.py)
    widths     the width preset `WIDTHS` (kvarn-w2.5: each key channel at its own width; a slow test of
               test_engine_auto.py)
    (k4v2 runs as the OpenAI server, `start_server` through the session fixture `server` of conftest.py, shared by
    test_engine_server.py and test_engine_load.py; the TP runs on a tiny model, test_engine_tp.py)

Figures go to out/vllm/engine.json (`record`), with the command, machine and versions.
KVARN_VLLM_PREFILL=float32 sets the plugin's `prefill` option for every kvarn engine (unset: its default, "model"),
to measure what the bf16 prefill costs in agreement (docs/VLLM.md).
The engines and the transformers references run in `DTYPE`: bf16 where the CPU computes it natively, float32 elsewhere
(`kvarn bench vllm`'s "auto": without native bf16, torch's bf16 matmuls are several times slower and the engine tests
took 13 minutes of CI on a 2-core AVX2 VM); KVARN_TEST_VLLM_DTYPE=bfloat16|float32 forces one.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

PRESET = "kvarn-k4v2-g128"
AUTO = "kvarn-auto-k2v2-g128"  # kvarn's default preset
AUTO_QAR = AUTO + "-qar"  # its keys rounded query-aware (issue 20)
AUTO_QAR_CLIP = AUTO_QAR + "-clip"  # ... and its 2-bit grids clipped (issue 20)
BUDGET = "kvarn-b2.5-qar"  # the budget preset closest to full precision on the task suite (issue 20)
WIDTHS = "kvarn-w2.5"  # key channels at their own widths within 2.5 bits (issue 20)
MAX_NEW = 32
LENGTHS = (150, 300, 400, 520)  # prompt tokens: the first stays within sink + one block, the others cross blocks
KV_GIB = 1
ENV = {"VLLM_CPU_KVCACHE_SPACE": str(KV_GIB), "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
# `LLM` runs its engine core in run_llm.py's own process: no second interpreter importing torch and vLLM, about half
# of a start here (scripts/vllm_start_time.py); the OpenAI server keeps vLLM's default (its tests read the worker and
# EngineCore processes apart).
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
HERE = Path(__file__).parent
ROOT = HERE.parents[2]
RUN_TIMEOUT = 1200
REPORT = ROOT / "out" / "vllm" / "engine.json"
PREFILL = os.environ.get("KVARN_VLLM_PREFILL")  # additional_config['kvarn']['prefill'] (module docstring)


def _vllm_installed() -> bool:
    # a folder named vllm on sys.path would be an implicit namespace package (no origin): not vLLM itself
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


# The engine tests run where vLLM is installed (.venv-vllm); elsewhere (the main venv's `make test` collection) every
# module importing this one is skipped with this reason. `make test-vllm` sets KVARN_REQUIRE_VLLM=1: never skipped.
if not _vllm_installed():
    if os.environ.get("KVARN_REQUIRE_VLLM") == "1":
        raise RuntimeError(f"KVARN_REQUIRE_VLLM=1 but vLLM is not importable from {sys.executable}: "
                           "run `make vllm-venv`")
    pytest.skip("vLLM is not installed in this venv (the engine tests run in .venv-vllm: `make test-vllm`)",
                allow_module_level=True)


def _dtype() -> tuple[str, int]:
    import torch

    from kvarn.bench.vllm import resolve_dtype

    name = resolve_dtype(os.environ.get("KVARN_TEST_VLLM_DTYPE", "auto"))
    return name, getattr(torch, name).itemsize


DTYPE, DTYPE_BYTES = _dtype()  # the engines' and references' dtype (module docstring); bytes of one K or V element


def model_dir() -> str:
    from kvarn.models import resolve

    return str(resolve("default"))


def prompts(lengths: tuple[int, ...] = LENGTHS) -> list[list[int]]:
    """Token ids of English prose from the standard library's pydoc topics, one text per prompt (cycled past four:
    a later prompt then shares a prefix with an earlier one), truncated to `lengths` tokens."""
    import pydoc_data.topics

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir())
    topics = pydoc_data.topics.topics
    texts = [topics[k] for k in ("assignment", "exceptions", "naming", "integers")]
    return [tok(texts[i % len(texts)])["input_ids"][:n] for i, n in enumerate(lengths)]


def save_tiny(model, folder: Path) -> str:
    """Save a tiny random-weight model to an HF folder with SmolLM2's tokenizer; returns its path."""
    import shutil

    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(model_dir()) / name, folder / name)
    return str(folder)


def llm_kwargs(extra: dict | None = None, **over) -> dict:
    kw = {"model": model_dir(), "dtype": DTYPE, "max_model_len": 1024, "max_num_seqs": 8, "enforce_eager": True,
          "seed": 0, **over}
    if extra is not None:
        kw["additional_config"] = extra
    return kw


def kvarn(preset: str = PRESET) -> dict:
    return {"kvarn": {"preset": preset, **({"prefill": PREFILL} if PREFILL else {})}}


@dataclass
class Run:
    out: dict  # run_llm.py's output: tokens (and top1 when scored)
    log: str  # vLLM's stdout + stderr
    seconds: float


def run_llm(name: str, job: dict, env: dict | None = None) -> Run:
    """One `run_llm.py` process (vLLM's engine started, used, stopped)."""
    tmp = Path(tempfile.mkdtemp(prefix=f"kvarn-vllm-{name}-"))
    job_file, out_file = tmp / "job.json", tmp / "out.json"
    job_file.write_text(json.dumps(job))
    t = time.time()
    proc = subprocess.run([sys.executable, str(HERE / "run_llm.py"), str(job_file), str(out_file)],
                          env={**os.environ, **ENV, **IN_PROCESS, **(env or {})}, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT)
    log = proc.stdout + proc.stderr
    if proc.returncode:
        raise AssertionError(f"{name}: vLLM run failed (exit {proc.returncode}):\n{log[-6000:]}")
    run = Run(json.loads(out_file.read_text()), log, time.time() - t)
    record("seconds", {name: round(run.seconds, 1)})
    return run


_RUNS: dict[str, Run] = {}


def engine(name: str) -> Run:
    """The session's run of one configuration of the module docstring (started on first use)."""
    if name not in _RUNS:
        job = {"prompts": prompts(), "max_tokens": MAX_NEW}
        if name in ("no-plugin", "no-plugin-again"):
            _RUNS[name] = run_llm(name, {**job, "llm": llm_kwargs()}, {"VLLM_PLUGINS": ""})
        elif name == "stock":
            _RUNS[name] = run_llm(name, {**job, "llm": llm_kwargs()})
        elif name in ("auto", "auto-qar", "auto-qar-clip", "budget", "widths"):
            preset = {"auto": AUTO, "auto-qar": AUTO_QAR, "auto-qar-clip": AUTO_QAR_CLIP, "budget": BUDGET,
                      "widths": WIDTHS}[name]
            _RUNS[name] = run_llm(name, {**job, "llm": llm_kwargs(kvarn(preset))})
        else:
            raise KeyError(name)
    return _RUNS[name]


START_TIMEOUT = 600
REQUEST_TIMEOUT = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT) as r:
        return json.loads(r.read())


class Server:
    """The k4v2 OpenAI server on loopback (`start_server`): its URL, log, and the kvarn pool stats file."""

    def __init__(self, base: str, log: Path, stats: Path, pid: int) -> None:
        self.base, self.log, self.stats, self.pid = base, log, stats, pid

    def complete(self, prompt: list[int], max_tokens: int, **extra) -> dict:
        body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
        return post(f"{self.base}/v1/completions", body)["choices"][0]

    def greedy(self, prompt: list[int], max_tokens: int = MAX_NEW) -> tuple[list[int], list[float]]:
        """Greedy tokens and, per step, the gap between the top two logprobs (nats)."""
        c = self.complete(prompt, max_tokens, return_token_ids=True, logprobs=2, return_tokens_as_token_ids=True)
        return c["token_ids"], top2_gaps(c["logprobs"]["top_logprobs"])

    def top1(self, seq: list[int], last: int) -> list[int]:
        """Top-1 prediction of each of the last `last` tokens of seq from the tokens before it."""
        entries = self.complete(seq, 1, prompt_logprobs=1)["prompt_logprobs"][-last:]
        return [int(next(t for t, lp in e.items() if lp["rank"] == 1)) for e in entries]

    def pool(self) -> dict:
        """The kvarn pool stats of the server's model worker (KVARN_POOL_STATS, every step: `pool.PoolStats`)."""
        return json.loads(self.stats.read_text())


def top2_gaps(top_logprobs: list[dict[str, float]]) -> list[float]:
    """Per step, the gap between the top two logprobs (nats) of a completion's `top_logprobs`."""
    tops = [sorted(d.values(), reverse=True) for d in top_logprobs]
    return [t[0] - t[1] if len(t) > 1 else math.inf for t in tops]


# nats: a top-2 logprob gap within which two runs of the same model that sum in another order may pick different
# tokens (batched vs one at a time: vLLM's own CPU kernels are not batch-invariant, test_engine_server.py's module
# docstring; vLLM vs kvarn's transformers cache: other kernels); `near_tie_divergence`, `equal_up_to_ties`
TIE = 0.3


def near_tie_divergence(a: tuple[list[int], list[float]], b: tuple[list[int], list[float]],
                        what: str = "the runs") -> dict | None:
    """The first step at which two greedy runs (tokens, top-2 gaps) of one prompt differ, None if they agree on
    their common length; fails unless that step is a near-tie (min of the two gaps <= TIE): every token before the
    first divergence must be equal, and what follows it is a different context, not compared."""
    (ta, ga), (tb, gb) = a, b
    n = next((j for j, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
    if n is None:
        return None
    assert min(ga[n], gb[n]) <= TIE, (f"{what} diverge at step {n}, where the top-2 gaps are {ga[n]:.3f} and "
                                      f"{gb[n]:.3f} nats (no near-tie)")
    return {"step": n, "gaps": [round(ga[n], 4), round(gb[n], 4)]}


@contextmanager
def start_server(folder: Path) -> Iterator[Server]:
    """The k4v2 OpenAI server on 127.0.0.1 with KVARN_POOL_STATS set, healthy; its process group killed on exit."""
    port = free_port()
    log, stats = folder / "server.log", folder / "pool.json"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir(), "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", "smollm2", "--dtype", DTYPE, "--max-model-len", "1024",
           "--max-num-seqs", "8", "--enforce-eager", "--seed", "0", "--additional-config", json.dumps(kvarn())]
    t = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, **ENV, "KVARN_POOL_STATS": str(stats)}, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + START_TIMEOUT
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"server exited with {proc.returncode}:\n{log.read_text()[-6000:]}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                raise AssertionError(f"server not healthy after {START_TIMEOUT} s:\n{log.read_text()[-6000:]}")
            time.sleep(2)
        record("seconds", {"server_start": round(time.time() - t, 1)})
        yield Server(base, log, stats, proc.pid)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the group this started: server and its engine processes
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        record("seconds", {"server_total": round(time.time() - t, 1)})


def stock_sequences() -> list[list[int]]:
    """Each prompt followed by stock vLLM's greedy continuation: the sequences that every engine is scored on."""
    return [p + t for p, t in zip(prompts(), engine("stock").out["tokens"])]


def capacity(log: str) -> int:
    """Tokens of KV cache that vLLM reports ("KV cache size: N tokens", per rank)."""
    m = re.search(r"KV cache size: ([\d,]+) tokens", log)
    assert m, "vLLM's log has no KV cache size line"
    return int(m.group(1).replace(",", ""))


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    assert pairs, "nothing to compare"
    return sum(x == y for x, y in pairs) / len(pairs)


def transformers_logits(path: str, seqs: list[list[int]], preset: str | None, last: int = MAX_NEW,
                        dtype: str = DTYPE) -> list:
    """The logits (float32 [last, vocab]) with which kvarn's transformers cache (None: no cache) predicts the last
    `last` tokens of each sequence, the model of `path` in `dtype`.

    The cache is fed one block (G tokens) at a time, so each query sees what the paged vLLM backend shows it: blocks
    before its own as stored, its own block exact. Only the positions asked for go through the LM head
    (`logits_to_keep`): bf16 matmuls are slow on CPUs without AVX-512."""
    import torch

    from kvarn.integrations.transformers import KVarNCache

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = _hf_model(path, dtype)
        out = []
        with torch.no_grad():
            for s in seqs:
                ids, first = torch.tensor([s]), len(s) - last - 1  # the first position whose logits are kept
                if preset is None:
                    logits = model(input_ids=ids, logits_to_keep=last + 1).logits[0]
                else:
                    cache = KVarNCache(model.config, preset=preset, exact_dtype=None)
                    g = cache.preset.tile
                    logits = torch.cat([model(input_ids=ids[:, i:i + g], past_key_values=cache, use_cache=True,
                                              logits_to_keep=max(1, min(i + g, len(s)) - max(i, first))
                                              ).logits[0] for i in range(0, len(s), g)])
                out.append(logits[-last - 1:-1].float())
        return out
    finally:
        torch.set_num_threads(threads)


_HF_MODELS: dict[tuple[str, str], object] = {}


def _hf_model(path: str, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    key = (path, dtype)
    if key not in _HF_MODELS:
        _HF_MODELS[key] = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return _HF_MODELS[key]


_TOP1: dict[tuple, list[list[int]]] = {}


def transformers_top1(seqs: list[list[int]], preset: str | None, last: int = MAX_NEW) -> list[list[int]]:
    """`transformers_logits`' top-1 tokens on the default model in DTYPE (once per session for the same arguments:
    the stock reference serves test_engine_auto.py and test_engine_server.py)."""
    key = (tuple(map(tuple, seqs)), preset, last)
    if key not in _TOP1:
        _TOP1[key] = [lg.argmax(-1).tolist() for lg in transformers_logits(model_dir(), seqs, preset, last)]
    return _TOP1[key]


def equal_up_to_ties(tokens: list[list[int]], logits: list) -> tuple[int, int]:
    """(equal, total): how many of an engine's greedy `tokens` are the top-1 of `logits` (teacher forced on the same
    sequences); every other token must sit at a near-tie, a top-2 gap of `logits` under TIE."""
    equal = total = 0
    for t, lg in zip(tokens, logits, strict=True):
        top2 = lg.log_softmax(-1).topk(2, dim=-1).values
        for i, tok in enumerate(t):
            total += 1
            if int(lg[i].argmax()) == tok:
                equal += 1
            else:
                gap = float(top2[i, 0] - top2[i, 1])
                assert gap < TIE, f"the engine's token {tok} at step {i} differs from transformers' at a gap of {gap}"
    return equal, total


def record(key: str, value) -> None:
    """Merge one figure into out/vllm/engine.json (dict values merge one level deep)."""
    import torch

    REPORT.parent.mkdir(parents=True, exist_ok=True)
    rep = json.loads(REPORT.read_text()) if REPORT.exists() else {}
    rep.update({"command": "make test-vllm", "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                "torch": torch.__version__, "vllm": __import__("vllm").__version__, "model": "smollm2-135m-instruct",
                "dtype": DTYPE, "VLLM_CPU_KVCACHE_SPACE_GiB": KV_GIB, "max_num_seqs": 8,
                "prompt_tokens": list(LENGTHS), "new_tokens": MAX_NEW, "prefill": PREFILL or "model"})
    rep[key] = {**rep.get(key, {}), **value} if isinstance(value, dict) and isinstance(rep.get(key), dict) else value
    REPORT.write_text(json.dumps(rep, indent=2) + "\n")
