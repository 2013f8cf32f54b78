"""The `vllm` protocol of `kvarn eval tasks`: each method served by a vLLM engine, as a serving user runs it.

    dynamic        stock vLLM (its own full-precision pages, the model's dtype)
    a kvarn preset vLLM with the plugin: `additional_config={"kvarn": {"preset": name}}` (`kvarn.integrations.vllm`)

One engine per method, in its own process (`vllm_worker`), all of the method's samples submitted at once; prompts
are fed in chunks of `chunk` tokens (`max_num_batched_tokens`, the serving protocol's chunk: later chunks read the
quantized past), greedy answers, the gold answer's log-probability from vLLM's prompt_logprobs. Runs where vLLM is
importable (`.venv-vllm`: `make vllm-venv`). A kvarn method whose engine did not run the plugin is an error, never
a silent stock run.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvarn.eval.tasks.protocol import ANCHORS, FULL_PRECISION, Output

VLLM = "vllm"
TIMEOUT_S = 3 * 3600


def missing() -> str | None:
    """Why the protocol cannot run in this interpreter (None: it can)."""
    from kvarn.integrations.vllm import unavailable

    why = unavailable("kvarn eval tasks --protocols vllm ...")
    return None if why is None else f"the vllm protocol needs vLLM: {why}"


def engine_kwargs(model_path: str, method: str, *, chunk: int, max_len: int, seqs: int, dtype: str,
                  sink: int | None, kv_bytes: int) -> dict[str, Any]:
    """The LLM(...) arguments of one method's engine; kv_bytes: the KV budget (`kv_budget`), the same for every
    method, so that no engine preempts."""
    if method in ANCHORS or "+exact:" in method:
        raise ValueError(f"method {method!r} is a transformers cache; the vllm protocol runs 'dynamic' (stock vLLM) "
                         "and kvarn presets")
    llm: dict[str, Any] = {"model": model_path, "dtype": dtype, "max_model_len": max_len, "max_num_seqs": seqs,
                           "max_num_batched_tokens": max(chunk, seqs), "enable_chunked_prefill": True,
                           "enforce_eager": True, "seed": 0, "enable_prefix_caching": False,
                           "kv_cache_memory_bytes": kv_bytes}
    if method != FULL_PRECISION:
        kv: dict[str, Any] = {"preset": method}
        if sink is not None:
            kv["sink"] = sink
        llm["additional_config"] = {"kvarn": kv}
    return llm


def kv_budget(config: Any, dtype_bytes: int, tokens: int) -> int:
    """Bytes of full-precision K/V for `tokens` tokens of a model (every layer, K and V), with a quarter to spare and
    64 MiB at least: what lets stock vLLM hold every request of the run at once."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    per_token = c.num_hidden_layers * 2 * heads * head_dim * dtype_bytes
    return max(int(per_token * tokens * 1.25), 64 << 20)


def run_engine(method: str, llm: dict[str, Any], requests: list[dict[str, Any]], eos: list[int]
               ) -> list[Output]:
    """One engine process over `requests` ({prompt, max_tokens, stop, gold}); an Output per request, in order."""
    from kvarn.integrations.vllm import cpu_engine_env

    with tempfile.TemporaryDirectory(prefix="kvarn-eval-vllm-") as tmp:
        job, out = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job.write_text(json.dumps({"llm": llm, "requests": requests, "eos": eos}))
        proc = subprocess.run([sys.executable, "-m", "kvarn.eval.tasks.vllm_worker", str(job), str(out)],
                              env=cpu_engine_env(in_process=True), capture_output=True, text=True, timeout=TIMEOUT_S)
        answers = json.loads(out.read_text())["answers"] if proc.returncode == 0 else None
    log = proc.stdout + proc.stderr
    if answers is None:
        raise RuntimeError(f"vllm protocol: the engine of {method} failed (exit {proc.returncode}):\n{log[-4000:]}")
    active = "kvarn: preset" in log  # the plugin's page report
    if (method != FULL_PRECISION) != active:
        raise RuntimeError(f"vllm protocol: the engine of {method} {'did not run' if not active else 'ran'} the kvarn "
                           f"plugin:\n{log[-2000:]}")
    m = re.search(r"KV cache size: ([\d,]+) tokens", log)
    held = {"engine": "vllm", "kv_tokens": int(m.group(1).replace(",", "")) if m else None}
    return [Output(a["text"], len(a["tokens"]), a["gold_logprob"], len(r["gold"] or ()), held, a["seconds"])
            for a, r in zip(answers, requests, strict=True)]
