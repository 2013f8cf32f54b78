"""`kvarn bench vllm`: throughput of stock vLLM vs vLLM with the kvarn plugin, on the CPU, as ratios in one run.

Each engine runs in its own process, one after another, with the same settings (`vllm_run`): a batch of
`requests` concurrent requests (prompts of `prompt_tokens` tokens of the default text, each from its own offset),
`new_tokens` greedy tokens each (ignore_eos), submitted together so vLLM batches them continuously. Reported per
engine: generated tokens/s and requests/s over the timed batch (engine start and one warm-up request excluded),
and the KV capacity vLLM reports ("KV cache size: N tokens", same VLLM_CPU_KVCACHE_SPACE); ratios vs stock.
"Stock" is vLLM with kvarn installed but not enabled, which the engine tests show is exactly stock vLLM.

Needs vLLM (`make vllm-venv`, then `.venv-vllm/bin/kvarn bench vllm`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

RUN_TIMEOUT = 3600


def missing() -> str | None:
    """Why this section cannot run here (None: it can)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return (f"vLLM is not importable from {sys.executable}: run `make vllm-venv`, then "
                "`.venv-vllm/bin/kvarn bench vllm`")
    return None


def _env(kv_gib: int) -> dict:
    n = os.cpu_count() or 1
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "VLLM_CPU_OMP_THREADS_BIND": f"0-{n - 1}",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def _engine(name: str, llm: dict, prompts: list[list[int]], new_tokens: int, kv_gib: int) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix=f"kvarn-bench-vllm-{name}-"))
    job, out = tmp / "job.json", tmp / "out.json"
    job.write_text(json.dumps({"llm": llm, "prompts": prompts, "max_tokens": new_tokens}))
    proc = subprocess.run([sys.executable, "-m", "kvarn.bench.vllm_run", str(job), str(out)], env=_env(kv_gib),
                          capture_output=True, text=True, timeout=RUN_TIMEOUT)
    log = proc.stdout + proc.stderr
    if proc.returncode:
        raise RuntimeError(f"kvarn bench vllm: engine {name} failed (exit {proc.returncode}):\n{log[-4000:]}")
    r = json.loads(out.read_text())
    m = re.search(r"KV cache size: ([\d,]+) tokens", log)
    r["kv_tokens"] = int(m.group(1).replace(",", "")) if m else None
    r["tokens_per_s"] = r["generated_tokens"] / r["wall_s"]
    r["requests_per_s"] = r["requests"] / r["wall_s"]
    return r


def bench_vllm(model: str, load_ids, presets: list[str], requests: int, prompt_tokens: int, new_tokens: int,
               kv_gib: int, max_num_seqs: int) -> dict:
    """The section's figures (module docstring); load_ids(n, offset_chars) -> token ids [1, n]."""
    from kvarn.models import resolve

    path = str(resolve(model))
    prompts = [load_ids(prompt_tokens, 4000 * i)[0].tolist() for i in range(requests)]
    base = {"model": path, "dtype": "bfloat16", "max_model_len": prompt_tokens + new_tokens + 16,
            "max_num_seqs": max_num_seqs, "enforce_eager": True, "seed": 0}
    rows = []
    for name in ("stock", *presets):
        llm = base if name == "stock" else {**base, "additional_config": {"kvarn": {"preset": name}}}
        print(f"kvarn bench vllm: {name} ...", file=sys.stderr, flush=True)
        rows.append({"engine": name, **_engine(name, llm, prompts, new_tokens, kv_gib)})
    stock = rows[0]
    for r in rows:
        r["tokens_per_s_vs_stock"] = r["tokens_per_s"] / stock["tokens_per_s"]
        r["kv_tokens_vs_stock"] = (r["kv_tokens"] / stock["kv_tokens"]) if r["kv_tokens"] and stock["kv_tokens"] \
            else None
    import vllm

    return {"vllm": vllm.__version__, "model": model, "dtype": "bfloat16", "requests": requests,
            "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "kv_gib": kv_gib, "max_num_seqs": max_num_seqs,
            "kernel": os.environ.get("KVARN_KERNEL", "auto"), "rows": rows}
