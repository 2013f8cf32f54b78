"""tensor_parallel_size=2 with the plugin: KV heads split across ranks, each rank quantizes its own tiles (vLLM's CPU
backend binds one rank per core with VLLM_CPU_OMP_THREADS_BIND="0|1").

Default: a tiny random-weight Llama built offline in a temp folder (4 layers, hidden 256, 4 query and 4 KV heads of
64, fixed seed, SmolLM2's tokenizer; SmolLM2's own 3 KV heads do not split), so the check is fast and needs no
download. Its two-rank greedy tokens equal, by teacher forcing, what kvarn's transformers cache at the same preset
predicts on the same sequences (one engine start, not two: a one-rank run would only repeat that comparison), up
to the near-tie rule (`engine_common.equal_up_to_ties`). Slow (`make test-vllm-tp`): Qwen2.5-Coder-0.5B (2 KV heads,
one per rank), fetched once from PyPI wheels: two ranks give exactly the tokens of one. float32 throughout, so that
the ranks' split matmuls and all-reduce round like the single rank's closely enough for greedy tokens to be equal.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .engine_common import (
    BUDGET,
    PRESET,
    equal_up_to_ties,
    kvarn,
    model_dir,
    prompts,
    record,
    run_llm,
    save_tiny,
    transformers_logits,
)

pytestmark = [pytest.mark.model, pytest.mark.timeout(3600)]  # vLLM starts take minutes on 2 cores

MAX_NEW = 16


def tiny_llama(folder: Path) -> str:
    """A random-weight Llama HF folder with SmolLM2's tokenizer (weights from a fixed seed)."""
    import torch
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    base = AutoConfig.from_pretrained(model_dir())
    cfg = LlamaConfig(vocab_size=base.vocab_size, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=4, head_dim=64, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=base.bos_token_id, eos_token_id=base.eos_token_id,
                      initializer_range=0.05)
    torch.manual_seed(0)
    return save_tiny(LlamaForCausalLM(cfg).to(torch.float32), folder)


def _llm(path: str, preset: str = PRESET) -> dict:
    return {"model": path, "dtype": "float32", "max_model_len": 1024, "max_num_seqs": 4, "enforce_eager": True,
            "seed": 0, "additional_config": kvarn(preset)}


def _two_ranks(name: str, path: str, ps: list[list[int]], preset: str = PRESET):
    return run_llm(f"{name}-tp2", {"prompts": ps, "max_tokens": MAX_NEW,
                                   "llm": {**_llm(path, preset), "tensor_parallel_size": 2}},
                   {"VLLM_CPU_OMP_THREADS_BIND": "0|1"})


def test_two_ranks_agree_with_transformers_cache_tiny(tmp_path) -> None:
    path = tiny_llama(tmp_path / "tiny-llama")
    ps = prompts()[1:3]  # 300 and 400 tokens: sink, packed blocks, a tail
    two = _two_ranks("tiny", path, ps)
    assert two.log.count(f"kvarn: preset {PRESET}") >= 2  # both ranks built kvarn pages (two KV heads each)
    toks = two.out["tokens"]
    assert all(len(t) == MAX_NEW for t in toks)
    logits = transformers_logits(path, [p + t for p, t in zip(ps, toks)], PRESET, MAX_NEW, "float32")
    equal, total = equal_up_to_ties(toks, logits)
    assert equal >= 0.9 * total, (equal, total)
    record("tensor_parallel", {"tiny-llama (4 KV heads)": f"tp=2 tokens vs transformers KVarNCache: {equal}/{total}"})


@pytest.mark.slow
def test_two_ranks_give_the_tokens_of_one_qwen() -> None:
    import pydoc_data.topics

    from transformers import AutoTokenizer

    from kvarn.models import resolve

    path = str(resolve("qwen2.5-coder-0.5b"))
    tok = AutoTokenizer.from_pretrained(path)
    ps = [tok(pydoc_data.topics.topics[k])["input_ids"][:n] for k, n in (("exceptions", 300), ("naming", 200))]
    job = {"prompts": ps, "max_tokens": MAX_NEW, "llm": _llm(path)}
    one = run_llm("qwen-tp1", job, {"VLLM_CPU_OMP_THREADS_BIND": "0-1"})
    two = _two_ranks("qwen", path, ps)
    assert two.log.count(f"kvarn: preset {PRESET}") >= 2  # both ranks built kvarn pages (one KV head each)
    assert two.out["tokens"] == one.out["tokens"]
    record("tensor_parallel", {"qwen2.5-coder-0.5b (2 KV heads)": "tp=2 tokens == tp=1 tokens"})


@pytest.mark.slow
def test_two_ranks_budget_preset_tiny(tmp_path) -> None:
    """kvarn-b2.5-qar at tensor_parallel_size=2: each rank chooses its layers' key widths on its own KV heads (one
    allocation per rank, `kvarn.integrations.vllm.budget`), and the tokens still agree with kvarn's transformers cache
    at the same preset (which decides per sequence on all heads) up to the near-tie rule on most positions."""
    path = tiny_llama(tmp_path / "tiny-llama")
    ps = prompts()[1:3]
    two = _two_ranks("tiny-budget", path, ps, BUDGET)
    assert two.log.count("key widths decided") == 2, two.log[-3000:]  # one allocation per rank
    toks = two.out["tokens"]
    logits = transformers_logits(path, [p + t for p, t in zip(ps, toks)], BUDGET, MAX_NEW, "float32")
    equal, total = equal_up_to_ties(toks, logits)
    record("tensor_parallel", {f"tiny-llama {BUDGET}": f"tp=2 tokens vs transformers KVarNCache: {equal}/{total}"})
    assert equal >= 0.8 * total, (equal, total)
