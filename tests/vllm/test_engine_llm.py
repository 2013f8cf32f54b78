"""vLLM's `LLM` with and without the plugin, on the embedded SmolLM2-135M (bf16, 1 GiB KV budget, CPU).

Four engine runs (each its own process, `run_llm.py`), shared by the tests of this module:
    stock      VLLM_PLUGINS="" (no plugin loaded at all)
    disabled   the plugin installed and loaded, not enabled
    k4v2, k2v2 additional_config={"kvarn": {"preset": ...}}

Agreement is measured by teacher forcing (SPEC §8's top-1 agreement): each engine predicts every token of stock
vLLM's greedy continuation from the tokens before it, so one early divergence does not decide the whole sequence.
The kvarn engine's prefill equals its token-by-token decode (`kvarn.integrations.vllm.paged`), so its prompt
logprobs are what decoding would give. kvarn's transformers cache is fed the same sequences one block (G tokens) at a
time, which gives it the same view (blocks before the current one as stored, the current one exact).

Figures are written to out/vllm/engine.json (with the command, machine and versions) and printed.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from engine_common import ENV, LENGTHS, MAX_NEW, PRESET, model_dir, prompts

pytestmark = [pytest.mark.model, pytest.mark.timeout(3600)]  # vLLM starts take minutes on 2 cores

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
RUN_TIMEOUT = 1800


def llm_kwargs(extra: dict | None = None) -> dict:
    kw = {"model": model_dir(), "dtype": "bfloat16", "max_model_len": 1024, "max_num_seqs": 8,
          "enforce_eager": True, "seed": 0}
    if extra is not None:
        kw["additional_config"] = extra
    return kw


def run_llm(tmp: Path, name: str, job: dict, env: dict | None = None) -> tuple[dict, str, float]:
    """(output, vLLM's log, seconds) of one `run_llm.py` process."""
    job_file, out_file = tmp / f"{name}.job.json", tmp / f"{name}.out.json"
    job_file.write_text(json.dumps(job))
    t = time.time()
    proc = subprocess.run([sys.executable, str(HERE / "run_llm.py"), str(job_file), str(out_file)],
                          env={**os.environ, **ENV, **(env or {})}, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT)
    log = proc.stdout + proc.stderr
    if proc.returncode:
        raise AssertionError(f"{name}: vLLM run failed (exit {proc.returncode}):\n{log[-6000:]}")
    return json.loads(out_file.read_text()), log, time.time() - t


def capacity(log: str) -> int:
    """Tokens of KV cache that vLLM reports."""
    m = re.search(r"KV cache size: ([\d,]+) tokens", log)
    assert m, "vLLM's log has no KV cache size line"
    return int(m.group(1).replace(",", ""))


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(x == y for x, y in pairs) / len(pairs)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("vllm")
    ps = prompts()
    base = {"prompts": ps, "max_tokens": MAX_NEW}
    res: dict = {"prompts": ps}
    res["stock"] = run_llm(tmp, "stock", {**base, "llm": llm_kwargs()}, {"VLLM_PLUGINS": ""})
    res["disabled"] = run_llm(tmp, "disabled", {**base, "llm": llm_kwargs()})
    seqs = [p + t for p, t in zip(ps, res["stock"][0]["tokens"])]
    res["sequences"] = seqs
    for preset in ("kvarn-k4v2-g128", "kvarn-k2v2-g128"):
        job = {**base, "llm": llm_kwargs({"kvarn": {"preset": preset}}), "score": seqs, "score_last": MAX_NEW}
        res[preset] = run_llm(tmp, preset, job)
    return res


@pytest.fixture(scope="module")
def report(runs) -> dict:
    rep = {"command": "make test-vllm", "machine": f"{platform.machine()}, {os.cpu_count()} cores",
           "torch": torch.__version__, "vllm": __import__("vllm").__version__, "model": "smollm2-135m-instruct",
           "dtype": "bfloat16", "VLLM_CPU_KVCACHE_SPACE_GiB": 1, "max_num_seqs": 8, "prompt_tokens": list(LENGTHS),
           "new_tokens": MAX_NEW, "seconds": {k: round(runs[k][2], 1) for k in ("stock", "disabled", PRESET,
                                                                                  "kvarn-k2v2-g128")}}
    yield rep
    out = ROOT / "out" / "vllm"
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine.json").write_text(json.dumps(rep, indent=2) + "\n")
    print(json.dumps(rep, indent=2))


def test_installed_but_disabled_is_stock(runs, report) -> None:
    stock, disabled = runs["stock"], runs["disabled"]
    assert disabled[0]["tokens"] == stock[0]["tokens"]
    assert capacity(disabled[1]) == capacity(stock[1])
    assert "kvarn:" not in disabled[1] and "kvarn: preset" in runs[PRESET][1]
    report["disabled_equals_stock"] = True


def test_capacity_ratios_from_vllm_report(runs, report) -> None:
    """vLLM's own "KV cache size: N tokens" line, same 1 GiB budget; kvarn's count includes its fp pool's bytes."""
    stock = capacity(runs["stock"][1])
    ratios = {p: capacity(runs[p][1]) / stock for p in (PRESET, "kvarn-k2v2-g128")}
    report["kv_tokens"] = {"stock_bf16": stock, **{p: capacity(runs[p][1]) for p in ratios}}
    report["capacity_ratio"] = {p: round(r, 2) for p, r in ratios.items()}
    assert ratios["kvarn-k2v2-g128"] >= 5.0, ratios
    assert ratios[PRESET] >= 3.5, ratios


def test_agreement_with_stock_vllm(runs, report) -> None:
    """Top-1 agreement with stock vLLM's greedy tokens; k4v2 must agree on most (>= 90%) of them."""
    stock = runs["stock"][0]["tokens"]
    tf = {p: agreement(runs[p][0]["top1"], stock) for p in (PRESET, "kvarn-k2v2-g128")}
    free = {p: agreement(runs[p][0]["tokens"], stock) for p in tf}
    report["top1_agreement_vs_stock_vllm"] = {p: round(a, 4) for p, a in tf.items()}
    report["free_running_same_position_vs_stock_vllm"] = {p: round(a, 4) for p, a in free.items()}
    assert tf[PRESET] >= 0.9, tf


def _transformers_top1(tmp: Path, seqs: list[list[int]], preset: str | None) -> list[list[int]]:
    """kvarn's transformers cache (or none) predicting the last MAX_NEW tokens of each sequence (`hf_top1.py`)."""
    name = preset or "stock"
    job, out = tmp / f"hf-{name}.job.json", tmp / f"hf-{name}.out.json"
    job.write_text(json.dumps({"sequences": seqs, "preset": preset, "last": MAX_NEW}))
    python = os.environ.get("KVARN_HF_PYTHON", sys.executable)
    proc = subprocess.run([python, str(HERE / "hf_top1.py"), str(job), str(out)], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, f"{python} hf_top1.py failed:\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


def test_agreement_with_transformers_cache(runs, report, tmp_path) -> None:
    """Same quantizer in both engines: vLLM+kvarn agrees with transformers+KVarNCache about as well as stock vLLM
    agrees with stock transformers (what the two engines' bf16 kernels alone cause)."""
    seqs, stock = runs["sequences"], runs["stock"][0]["tokens"]
    hf_stock = agreement(_transformers_top1(tmp_path, seqs, None), stock)
    hf_kvarn = agreement(_transformers_top1(tmp_path, seqs, PRESET), runs[PRESET][0]["top1"])
    report["top1_agreement_transformers_vs_vllm"] = {"stock": round(hf_stock, 4), PRESET: round(hf_kvarn, 4)}
    assert hf_kvarn >= 0.9 and hf_kvarn >= hf_stock - 0.05, (hf_kvarn, hf_stock)


def test_resolver_returns_vllm_class_when_not_enabled() -> None:
    """Outside a kvarn-enabled config the registry entry resolves to vLLM's own class object."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from kvarn.integrations.vllm import register

    register()
    register()  # idempotent
    assert AttentionBackendEnum.CPU_ATTN.get_path() == "kvarn.integrations.vllm.select.CPU_ATTN"
    assert AttentionBackendEnum.CPU_ATTN.get_class() is CPUAttentionBackend
