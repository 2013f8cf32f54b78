"""`kvarn bench vllm`: throughput of stock vLLM vs vLLM with the kvarn plugin, on the CPU, as ratios in one run.

Each engine runs in its own process, one after another, with the same settings (`vllm_run`), in two kinds of runs:

    equal batch   R concurrent requests of P prompt tokens (the default text, each from its own offset) + N greedy
                  tokens (ignore_eos), max_num_seqs = R, a KV budget that holds the whole batch for every engine: what
                  the kernels and the bookkeeping cost when memory is not the limit;
    memory-bound  R requests queued at once in a KV budget of M MiB (`kv_cache_memory_bytes`) that holds only a few
                  of stock's sequences, max_num_seqs S: what kvarn's capacity buys when memory is the limit.

Reported per engine: generated tokens/s and requests/s over the timed batch (engine start and one warm-up request
excluded), mean TTFT and TPOT (vLLM's own per-request stats), preemptions (vLLM's counter), the KV capacity vLLM
reports ("KV cache size: N tokens") and the concurrency kvarn's pool allows (its "max_num_seqs lowered" line);
ratios vs stock. "Stock" is vLLM with kvarn installed but not enabled, which the engine tests show is exactly stock
vLLM.

Needs vLLM (`make vllm-venv`, then `.venv-vllm/bin/kvarn bench vllm`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

RUN_TIMEOUT = 3600
MIB = 2**20


@dataclass(frozen=True)
class Scenario:
    kind: str  # "equal" or "memory"
    requests: int
    prompt_tokens: int
    new_tokens: int
    kv_bytes: int
    max_num_seqs: int

    @property
    def label(self) -> str:
        return (f"{self.kind}: {self.requests} x ({self.prompt_tokens} + {self.new_tokens}), KV "
                f"{self.kv_bytes / MIB:g} MiB, max_num_seqs {self.max_num_seqs}")


def missing() -> str | None:
    """Why this section cannot run here (None: it can)."""
    from kvarn.integrations.vllm import unavailable

    return unavailable("kvarn bench vllm")


def _engine(name: str, llm: dict, prompts: list[list[int]], new_tokens: int) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix=f"kvarn-bench-vllm-{name}-"))
    job, out = tmp / "job.json", tmp / "out.json"
    job.write_text(json.dumps({"llm": llm, "prompts": prompts, "max_tokens": new_tokens}))
    from kvarn.integrations.vllm import cpu_engine_env

    proc = subprocess.run([sys.executable, "-m", "kvarn.bench.vllm_run", str(job), str(out)], env=cpu_engine_env(),
                          capture_output=True, text=True, timeout=RUN_TIMEOUT)
    log = proc.stdout + proc.stderr
    if proc.returncode:
        raise RuntimeError(f"kvarn bench vllm: engine {name} failed (exit {proc.returncode}):\n{log[-4000:]}")
    r = json.loads(out.read_text())
    m = re.search(r"KV cache size: ([\d,]+) tokens", log)
    r["kv_tokens"] = int(m.group(1).replace(",", "")) if m else None
    m = re.search(r"max_num_seqs lowered from \d+ to (\d+)", log)
    r["max_num_seqs"] = int(m.group(1)) if m else llm["max_num_seqs"]
    r["kvarn_active"] = "kvarn: preset" in log  # the plugin's page report: kvarn really served this engine
    r["tokens_per_s"] = r["generated_tokens"] / r["wall_s"]
    r["requests_per_s"] = r["requests"] / r["wall_s"]
    return r


def scenarios(requests: list[int], prompt_tokens: list[int], new_tokens: int, kv_gib: float, mem_requests: int,
              mem_prompt_tokens: int, mem_new_tokens: int, mem_kv_mib: list[float], mem_max_num_seqs: int,
              ) -> list[Scenario]:
    """The equal-batch grid (requests x prompt lengths) and the memory-bound runs (one per KV budget; none when
    mem_requests is 0)."""
    out = [Scenario("equal", r, p, new_tokens, int(kv_gib * 2**30), r) for p in prompt_tokens for r in requests]
    if mem_requests:
        out += [Scenario("memory", mem_requests, mem_prompt_tokens, mem_new_tokens, int(m * MIB), mem_max_num_seqs)
                for m in mem_kv_mib]
    return out


DTYPES = ("auto", "bfloat16", "float16", "float32")


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"kvarn bench vllm: dtype {dtype!r} is not one of {', '.join(DTYPES)}")


def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX: the test vLLM's CPU platform makes too). Without
    it torch's bf16 matmuls run several times slower than float32 (stock's prefill 5x slower on the 2-core AVX2 VM:
    docs/VLLM.md, "The engines' dtype")."""
    import torch

    return bool(torch.cpu._is_avx512_bf16_supported())


def resolve_dtype(dtype: str) -> str:
    """"auto": bfloat16 where the CPU has native bf16, else float32, the dtype a user serves on that CPU."""
    check_dtype(dtype)
    if dtype != "auto":
        return dtype
    return "bfloat16" if native_bf16() else "float32"


def mem_budget_scale(dtype: str) -> float:
    """The factor on the memory-bound runs' default KV budgets (set for 16-bit engines): a float32 engine gets twice
    the bytes, so that stock holds the same few sequences whatever the dtype."""
    return 2.0 if dtype == "float32" else 1.0


def check_rounds(rounds: int) -> None:
    if rounds < 1:
        raise ValueError(f"kvarn bench vllm: rounds must be at least 1, got {rounds}")


ROUND_FIGURES = ("tokens_per_s", "requests_per_s", "tokens_per_s_vs_stock", "requests_per_s_vs_stock", "ttft_mean_s",
                 "tpot_mean_s", "wall_s", "preemptions")


def _with_ratios(rows: list[dict]) -> list[dict]:
    """One round's rows (stock first) with their ratios to stock's."""
    stock = rows[0]
    for r in rows:
        r["tokens_per_s_vs_stock"] = r["tokens_per_s"] / stock["tokens_per_s"]
        r["requests_per_s_vs_stock"] = r["requests_per_s"] / stock["requests_per_s"]
        r["kv_tokens_vs_stock"] = (r["kv_tokens"] / stock["kv_tokens"]) if r["kv_tokens"] and stock["kv_tokens"] \
            else None
    return rows


def _median_row(rounds: list[dict]) -> dict:
    """An engine's row over its rounds: the round of median tokens/s (lower median), each ratio to stock the median
    of the rounds' own ratios (each round's engines ran one after another, so a ratio pairs runs close in time), and
    every round's figures under "rounds"."""
    if len(rounds) == 1:
        return rounds[0]
    mid = (len(rounds) - 1) // 2
    row = dict(sorted(rounds, key=lambda r: r["tokens_per_s"])[mid])
    for k in ("tokens_per_s_vs_stock", "requests_per_s_vs_stock"):
        row[k] = sorted(r[k] for r in rounds)[mid]
    row["rounds"] = [{k: r.get(k) for k in ROUND_FIGURES} for r in rounds]
    return row


def bench_vllm(model: str, load_ids, presets: list[str], runs: list[Scenario], dtype: str = "bfloat16",
               rounds: int = 1) -> dict:
    """The section's figures (module docstring); load_ids(n, offset_chars) -> token ids [1, n]. dtype: the model's
    dtype in every engine ("auto": bfloat16 on CPUs with native bf16, float32 where the CPU lacks it, `resolve_dtype`).
    rounds: every engine of a run that many times, in rounds (stock, the presets, stock, ...), each engine in a fresh
    process; the ratios reported are the medians of the rounds' own (a machine whose speed drifts over minutes moves
    one run's ratio by tens of percent: docs/VLLM.md)."""
    from kvarn.models import resolve

    requested, dtype = dtype, resolve_dtype(dtype)
    check_rounds(rounds)
    path = str(resolve(model))
    out_runs = []
    for sc in runs:
        prompts = [load_ids(sc.prompt_tokens, 4000 * i)[0].tolist() for i in range(sc.requests)]
        base = {"model": path, "dtype": dtype, "max_model_len": sc.prompt_tokens + sc.new_tokens + 16,
                "max_num_seqs": sc.max_num_seqs, "enforce_eager": True, "seed": 0, "kv_cache_memory_bytes": sc.kv_bytes}
        names = ("stock", *presets)
        done: list[list[dict]] = []  # [round][engine]
        for k in range(rounds):
            rows = []
            for name in names:
                llm = base if name == "stock" else {**base, "additional_config": {"kvarn": {"preset": name}}}
                at = f" (round {k + 1} of {rounds})" if rounds > 1 else ""
                print(f"kvarn bench vllm: {sc.label}: {name}{at} ...", file=sys.stderr, flush=True)
                rows.append({"engine": name, **_engine(name, llm, prompts, sc.new_tokens)})
            done.append(_with_ratios(rows))
        out_runs.append({**asdict(sc), "rounds": rounds,
                         "rows": [_median_row([rnd[e] for rnd in done]) for e in range(len(names))]})
    import vllm

    return {"vllm": vllm.__version__, "model": model, "dtype": dtype, "dtype_requested": requested,
            "native_bf16": native_bf16(), "kernel": os.environ.get("KVARN_KERNEL", "auto"), "runs": out_runs}
