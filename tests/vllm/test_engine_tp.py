"""tensor_parallel_size=2 with the plugin gives the tokens of one rank (KV heads split across ranks, each rank
quantizes its own tiles), on Qwen2.5-Coder-0.5B (2 KV heads: one per rank; SmolLM2's 3 do not split).

vLLM's CPU backend binds one rank per core with VLLM_CPU_OMP_THREADS_BIND="0|1". float32, so that the ranks' split
matmuls and all-reduce round like the single rank's closely enough for greedy tokens to be equal.
"""

from __future__ import annotations

import pytest
from engine_common import PRESET
from test_engine_llm import run_llm

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(3600)]  # vLLM starts take minutes on 2 cores

LENGTHS = (300, 200)
MAX_NEW = 16


def _qwen() -> tuple[str, list[list[int]]]:
    import pydoc_data.topics

    from transformers import AutoTokenizer

    from kvarn.models import resolve

    path = str(resolve("qwen2.5-coder-0.5b"))
    tok = AutoTokenizer.from_pretrained(path)
    texts = [pydoc_data.topics.topics[k] for k in ("exceptions", "naming")]
    return path, [tok(t)["input_ids"][:n] for t, n in zip(texts, LENGTHS)]


def test_two_ranks_give_the_tokens_of_one(tmp_path) -> None:
    path, prompts = _qwen()
    llm = {"model": path, "dtype": "float32", "max_model_len": 512, "max_num_seqs": 4, "enforce_eager": True,
           "seed": 0, "additional_config": {"kvarn": {"preset": PRESET}}}
    job = {"prompts": prompts, "max_tokens": MAX_NEW}
    one, _, _ = run_llm(tmp_path, "tp1", {**job, "llm": llm}, {"VLLM_CPU_OMP_THREADS_BIND": "0-1"})
    two, log, _ = run_llm(tmp_path, "tp2", {**job, "llm": {**llm, "tensor_parallel_size": 2}},
                          {"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    assert log.count("kvarn: preset") >= 2  # both ranks built kvarn pages (one KV head each)
    assert two["tokens"] == one["tokens"]
