"""`kvarn eval tasks --protocols vllm` end to end on the embedded SmolLM2 (kvarn.eval.tasks.vllm_protocol): two
line-retrieval samples, stock vLLM ("dynamic") and the default preset through the plugin, beside the transformers
serving protocol in this venv (transformers < 5.24 here: the cache keyword `past_key_values`, `cache_kwarg`).

Checked: stock vLLM in float32 answers as the transformers serving protocol on a DynamicCache and gives the same
gold log-probability (the same model and dtype; tolerance 1e-2 nats over the gold's tokens: vLLM's CPU attention
sums in another order); the kvarn engine really ran the plugin (the runner refuses a stock run for a preset); the
records carry the protocol and the engine's KV capacity, and a rerun resumes (nothing run twice).
"""

from __future__ import annotations

import json

import pytest

from .engine_common import record  # noqa: F401 (skips this module where vLLM is not installed)

pytestmark = pytest.mark.model  # two vLLM engines on the embedded model: `make test-vllm-engines`


def test_vllm_protocol_against_serving(tmp_path) -> None:
    from kvarn.cli import main

    out = tmp_path / "tasks"
    args = ["eval", "tasks", "--tasks", "lines", "--lines", "20", "--samples", "2", "--protocols", "vllm,serving",
            "--methods", "dynamic,kvarn-auto-k2v2-g128", "--threads", "1", "--out", str(out)]
    assert main(args) == 0
    recs = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    by = {(r["method"], r["protocol"], r["index"]): r for r in recs}
    assert len(by) == len(recs) == 8
    for i in (0, 1):
        engine, serving = by[("dynamic", "vllm", i)], by[("dynamic", "serving", i)]
        assert engine["answer"] == serving["answer"], (engine["answer"], serving["answer"])
        assert abs(engine["gold_logprob"] - serving["gold_logprob"]) < 1e-2
        kv = by[("kvarn-auto-k2v2-g128", "vllm", i)]
        assert kv["engine"] == "vllm" and kv["generated_tokens"] >= 1 and kv["gold_logprob"] < 0
        assert kv["kv_tokens"] > 3 * engine["kv_tokens"]  # the plugin's pages: several times stock's tokens
    assert main(args) == 0  # resumes: every unit done, nothing appended
    assert len((out / "samples.jsonl").read_text().splitlines()) == 8
    summary = json.loads((out / "tasks.json").read_text())
    assert {r["protocol"] for r in summary["rows"]} == {"vllm", "serving"}
