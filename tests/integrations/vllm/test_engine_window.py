"""A hybrid model with sliding-window layers served with the plugin: a tiny random-weight Gemma-3-like model (5
sliding-window layers of window 128, then 1 full-attention layer; hidden 256, 4 query and 2 KV heads of 64, fixed
seed, float32, SmolLM2's tokenizer), built offline.

One engine start (`run_llm.py`), with vLLM's default max_num_seqs (256) and the tests' 1 GiB KV budget,
`disable_hybrid_kv_cache_manager=True` (kvarn needs it for hybrids, `kvarn.integrations.vllm.backend`), serves
several checks:
  * the sliding-window layers stay vLLM's (its CPU attention over its own pages) and the full-attention layer is
    packed: vLLM's reported KV capacity is the block count kvarn's layout predicts for that mix (the number of
    blocks of `layout.choose_pool` with the window layers' model-dtype pages beside the kvarn page);
  * the pool is sized from the budget: max_num_seqs is lowered (below 256) in the engine core, the process that
    builds vLLM's scheduler, instead of the start being refused;
  * its greedy tokens equal, by teacher forcing, what kvarn's transformers cache at the same preset predicts on the
    same sequences (fed one block at a time, so each query sees what the paged backend shows it; transformers keeps
    the sliding-window layers exact as vLLM does), except where the transformers run's top two logits lie within
    TIE = 0.3 nats (the near-tie rule of test_engine_server.py); float32 in both engines.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from .engine_common import (
    KV_GIB,
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
WINDOW = 128


def tiny_gemma3(folder: Path) -> str:
    """A random-weight Gemma-3-like HF folder: 5 sliding-window layers then 1 full one (weights from a fixed seed)."""
    import torch
    from transformers import AutoConfig, Gemma3ForCausalLM, Gemma3TextConfig

    base = AutoConfig.from_pretrained(model_dir())
    cfg = Gemma3TextConfig(vocab_size=base.vocab_size, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=WINDOW,
                           layer_types=["sliding_attention"] * 5 + ["full_attention"], max_position_embeddings=2048,
                           query_pre_attn_scalar=64, tie_word_embeddings=True, bos_token_id=base.bos_token_id,
                           eos_token_id=base.eos_token_id, pad_token_id=base.eos_token_id, initializer_range=0.05)
    torch.manual_seed(0)
    return save_tiny(Gemma3ForCausalLM(cfg).to(torch.float32), folder)


def test_sliding_window_model_serves_with_default_max_num_seqs(tmp_path) -> None:
    import torch

    from kvarn.integrations.vllm.layout import TileLayout, choose_pool, num_blocks_in
    from kvarn.integrations.vllm.pool import fp_slots_for
    from kvarn.presets import get_preset

    path = tiny_gemma3(tmp_path / "tiny-gemma3")
    ps = prompts()[1:3]  # 300 and 400 tokens: beyond the window, a sink, packed blocks, a tail
    llm = {"model": path, "dtype": "float32", "max_model_len": 1024, "enforce_eager": True, "seed": 0,
           "disable_hybrid_kv_cache_manager": True, "additional_config": kvarn()}
    # vLLM's default engine-core process (engine_common.IN_PROCESS off): the lowering must happen there
    run = run_llm("window", {"prompts": ps, "max_tokens": MAX_NEW, "llm": llm}, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    log = run.log

    assert "5 sliding-window layers kept by vLLM" in log
    lowered = re.search(r"\(EngineCore[^)]*\).*max_num_seqs lowered from 256 to (\d+)", log)
    assert lowered, "the engine core did not lower max_num_seqs"
    seqs = int(lowered.group(1))

    # capacity: what kvarn's layout predicts for 1 packed layer beside 5 float32 window layers
    lay = TileLayout(get_preset(PRESET), 64, torch.float32)
    window_bytes = 5 * 2 * 128 * 2 * 64 * 4  # per block: K and V of 2 heads of 64 in float32, 5 layers
    budget = KV_GIB * 2**30
    geo, n = choose_pool(lay, 2, 1, budget, 256, lambda k: fp_slots_for(1, k), window_bytes)
    assert n == seqs
    m = re.search(r"KV cache size: ([\d,]+) tokens", log)
    assert m, "vLLM's log has no KV cache size line"
    reported = int(m.group(1).replace(",", ""))
    predicted = num_blocks_in(geo, 1, budget, window_bytes) * 128
    assert abs(reported - predicted) <= 128, (reported, predicted)  # vLLM holds one block back (its null block)
    stock = budget // (6 * 2 * 2 * 64 * 4)  # every layer in float32 pages, as vLLM without HMA keeps them

    # agreement with kvarn's transformers cache, teacher forced on vLLM's own sequences
    toks = run.out["tokens"]
    assert all(len(t) == MAX_NEW for t in toks)
    logits = transformers_logits(path, [p + t for p, t in zip(ps, toks)], PRESET, MAX_NEW, "float32")
    equal, total = equal_up_to_ties(toks, logits)
    assert equal >= 0.9 * total
    record("sliding_window", {"model": "tiny Gemma-3-like (5 sliding of 128 + 1 full; 2 KV heads of 64; float32)",
                              "max_num_seqs": f"256 lowered to {seqs}", "kv_tokens": reported,
                              "kv_tokens_all_layers_float32": stock, "vs_transformers_kvarn": f"{equal}/{total}"})


@pytest.mark.slow
def test_sliding_window_model_serves_a_budget_preset(tmp_path) -> None:
    """kvarn-b3.0-qar on the same hybrid (`kvarn.integrations.vllm.budget`): the one full-attention layer's page is
    sized for 3-bit keys (the budget's split for one layer), the window layers stay vLLM's; vLLM's capacity is what
    the layout predicts for that mix; the width is decided once; tokens agree with kvarn's transformers cache."""
    import torch

    from kvarn.integrations.vllm.budget import extra_page_bytes
    from kvarn.integrations.vllm.layout import TileLayout, choose_pool, num_blocks_in
    from kvarn.integrations.vllm.pool import fp_slots_for
    from kvarn.presets import get_preset

    name = "kvarn-b3.0-qar"
    path = tiny_gemma3(tmp_path / "tiny-gemma3")
    ps = prompts()[1:3]
    llm = {"model": path, "dtype": "float32", "max_model_len": 1024, "enforce_eager": True, "seed": 0,
           "disable_hybrid_kv_cache_manager": True, "additional_config": kvarn(name)}
    run = run_llm("window-budget", {"prompts": ps, "max_tokens": MAX_NEW, "llm": llm})
    log = run.log
    assert "5 sliding-window layers kept by vLLM" in log and log.count("key widths decided") == 1, log[-3000:]
    preset = get_preset(name)
    lay = TileLayout(preset, 64, torch.float32)
    other = 5 * 2 * 128 * 2 * 64 * 4 + extra_page_bytes(preset, 1, 2, 64, torch.float32)  # window pages + wider keys
    budget = KV_GIB * 2**30
    geo, _ = choose_pool(lay, 2, 1, budget, 256, lambda k: fp_slots_for(1, k), other)
    m = re.search(r"KV cache size: ([\d,]+) tokens", log)
    assert m, "vLLM's log has no KV cache size line"
    reported = int(m.group(1).replace(",", ""))
    predicted = num_blocks_in(geo, 1, budget, other) * 128
    assert abs(reported - predicted) <= 128, (reported, predicted)
    toks = run.out["tokens"]
    logits = transformers_logits(path, [p + t for p, t in zip(ps, toks)], name, MAX_NEW, "float32")
    equal, total = equal_up_to_ties(toks, logits)
    record("sliding_window_budget", {"preset": name, "kv_tokens": reported,
                                     "vs_transformers_kvarn": f"{equal}/{total}"})
    assert equal >= 0.9 * total
