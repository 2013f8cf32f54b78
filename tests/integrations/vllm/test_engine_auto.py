"""kvarn's default preset, kvarn-auto-k2v2-g128, served by vLLM's `LLM` (SmolLM2-135M, CPU, in engine_common's
DTYPE: bf16 where the CPU computes it natively).

One run (`engine_common.engine("auto")`: the stock run's prompts and settings, one batch of 4 prompts of 150 to 520
tokens, 32 greedy tokens each), then:
  * agreement with kvarn's transformers cache at the same preset, teacher forced on vLLM's own sequences: the cache
    (fed one block at a time, as the paged backend shows each query its past) predicts each of vLLM's tokens from the
    tokens before it; beside it, stock vLLM vs stock transformers on stock's sequences (what the two engines' bf16
    kernels alone cause). The two kvarn-auto engines need not choose every tile's rotation alike: vLLM keeps one
    running query energy per layer for the whole engine (all requests pooled, `kvarn.integrations.vllm.paged`), the
    transformers cache one per sequence, fed 128 tokens at a time;
  * capacity: vLLM's "KV cache size" line equals what kvarn's layout computes for the budget (flags included);
  * the generate call's time beside stock's (recorded, not asserted: the machine is shared).
"""

from __future__ import annotations

import pytest

from .engine_common import (  # skips this module where vLLM is not installed
    AUTO,
    AUTO_QAR,
    AUTO_QAR_CLIP,
    BUDGET,
    DTYPE,
    KV_GIB,
    LENGTHS,
    MAX_NEW,
    WIDTHS,
    agreement,
    capacity,
    engine,
    prompts,
    record,
    stock_sequences,
    transformers_top1,
)

pytestmark = [pytest.mark.model, pytest.mark.timeout(3600)]  # vLLM starts take minutes on 2 cores

# Lower bound on the teacher-forced agreement with the transformers cache at kvarn-auto-k2v2: measured 0.945 (121/128
# tokens) on the 2-core VM, 0.953 (122/128) at git 76c05f2 (docs/VLLM.md); the margin leaves room for a few more
# rotation choices or near-ties to fall the other way under another batching.
MIN_AGREEMENT = 0.85


def test_auto_preset_agrees_with_transformers_cache() -> None:
    run = engine("auto")
    assert f"kvarn: preset {AUTO}" in run.log
    toks = run.out["tokens"]
    assert all(len(t) == MAX_NEW for t in toks)
    seqs = [p + t for p, t in zip(prompts(), toks)]
    hf_auto = agreement(transformers_top1(seqs, AUTO), toks)
    stock = engine("stock").out["tokens"]
    hf_stock = agreement(transformers_top1(stock_sequences(), None), stock)
    record("top1_agreement_transformers_vs_vllm", {"stock": round(hf_stock, 4), AUTO: round(hf_auto, 4)})
    record("free_running_same_position_vs_stock_vllm", {AUTO: round(agreement(toks, stock), 4)})
    assert hf_auto >= MIN_AGREEMENT, (hf_auto, hf_stock)


@pytest.mark.slow
@pytest.mark.parametrize(("run_name", "preset"), [("auto-qar", AUTO_QAR), ("auto-qar-clip", AUTO_QAR_CLIP)])
def test_query_aware_preset_agrees_with_transformers_cache(run_name: str, preset: str) -> None:
    """kvarn-auto-k2v2-g128-qar (keys rounded with the running E[q q^T]: the engine's per layer, the transformers
    cache's per sequence) and its clipped-grid version: the same teacher-forced agreement as the default preset, its
    capacity the default's (the same page bytes). Slow: one more engine start each (`make test-slow` with the vLLM
    venv, or -m slow)."""
    run = engine(run_name)
    assert f"kvarn: preset {preset}" in run.log
    toks = run.out["tokens"]
    seqs = [p + t for p, t in zip(prompts(), toks)]
    hf = agreement(transformers_top1(seqs, preset), toks)
    stock = engine("stock").out["tokens"]
    record("top1_agreement_transformers_vs_vllm", {preset: round(hf, 4)})
    record("free_running_same_position_vs_stock_vllm", {preset: round(agreement(toks, stock), 4)})
    assert capacity(run.log) == capacity(engine("auto").log)
    assert hf >= MIN_AGREEMENT, hf


# Lower bound on the teacher-forced agreement with the transformers cache at the budget preset: measured 0.977
# (125/128) on the 2-core VM, 0.938 (120/128) at git 76c05f2 (docs/VLLM.md). The engines need not choose the
# same key widths: vLLM makes one allocation for the engine (on the first prompt long enough), the transformers cache
# one per sequence.
MIN_BUDGET_AGREEMENT = 0.85


def test_budget_preset_agrees_and_its_pages_hold_its_bytes() -> None:
    """kvarn-b2.5-qar (`kvarn.integrations.vllm.budget`): the key widths are decided once, on the first request that
    completes a tile past the sink; greedy tokens agree with kvarn's transformers cache at the same preset
    (teacher forced, as above); vLLM's KV capacity is what the page classes cost (h* layers' pages sized for 4-bit
    keys, m* for 3-bit, the rest 2-bit: `budget.page_classes`), up to the one block vLLM holds back."""
    import torch

    from kvarn.integrations.vllm.budget import extra_page_bytes, page_classes
    from kvarn.integrations.vllm.layout import TileLayout, choose_pool, num_blocks_in
    from kvarn.integrations.vllm.pool import fp_slots_for
    from kvarn.presets import get_preset

    run = engine("budget")
    assert f"kvarn: preset {BUDGET}" in run.log and run.log.count("key widths decided") == 1, run.log[-3000:]
    toks = run.out["tokens"]
    assert all(len(t) == MAX_NEW for t in toks)
    seqs = [p + t for p, t in zip(prompts(), toks)]
    hf = agreement(transformers_top1(seqs, BUDGET), toks)
    stock = engine("stock").out["tokens"]
    record("top1_agreement_transformers_vs_vllm", {BUDGET: round(hf, 4)})
    record("free_running_same_position_vs_stock_vllm", {BUDGET: round(agreement(toks, stock), 4)})

    preset = get_preset(BUDGET)
    lay = TileLayout(preset, 64, getattr(torch, DTYPE))
    budget, extra = KV_GIB * 2**30, extra_page_bytes(preset, 30, 3, 64, getattr(torch, DTYPE))
    geo, seqs_held = choose_pool(lay, 3, 30, budget, 8,
                                 lambda n: fp_slots_for(preset.policy.sink // lay.tile, n), extra)
    assert seqs_held == 8
    predicted = num_blocks_in(geo, 30, budget, extra) * lay.tile
    reported = capacity(run.log)
    assert abs(reported - predicted) <= lay.tile, (reported, predicted)
    classes = page_classes(preset, 30, 64)
    record("kv_tokens", {BUDGET: reported})
    record("capacity_ratio", {BUDGET: round(reported / capacity(engine("stock").log), 2)})
    record("budget_page_classes", {c: classes.count(c) for c in ("high", "mid", "low")})
    decided = next(line for line in run.log.splitlines() if "key widths decided" in line)
    record("budget_key_widths", {BUDGET: decided.split("key widths decided, ", 1)[1]})
    assert hf >= MIN_BUDGET_AGREEMENT, hf


@pytest.mark.slow
def test_widths_preset_agrees_and_its_pages_hold_its_bytes() -> None:
    """kvarn-w2.5 (each key channel at its own width, chosen per tile from the engine's running query statistics; the
    store in PyTorch, the decode in the C++ kernel): the same teacher-forced agreement with kvarn's transformers cache
    as the default preset, and vLLM's KV capacity is what its pages cost (`layout.choose_pool`), below the default's
    by their bytes. Slow: one more engine start."""
    import torch

    from kvarn.integrations.vllm.layout import TileLayout, choose_pool, num_blocks_in
    from kvarn.integrations.vllm.pool import fp_slots_for
    from kvarn.presets import get_preset

    run = engine("widths")
    assert f"kvarn: preset {WIDTHS}" in run.log
    toks = run.out["tokens"]
    assert all(len(t) == MAX_NEW for t in toks)
    seqs = [p + t for p, t in zip(prompts(), toks)]
    hf = agreement(transformers_top1(seqs, WIDTHS), toks)
    stock = engine("stock")
    record("top1_agreement_transformers_vs_vllm", {WIDTHS: round(hf, 4)})
    record("free_running_same_position_vs_stock_vllm", {WIDTHS: round(agreement(toks, stock.out["tokens"]), 4)})
    preset = get_preset(WIDTHS)
    lay = TileLayout(preset, 64, getattr(torch, DTYPE))
    budget = KV_GIB * 2**30
    geo, held = choose_pool(lay, 3, 30, budget, 8, lambda n: fp_slots_for(preset.policy.sink // lay.tile, n))
    predicted = num_blocks_in(geo, 30, budget) * lay.tile
    reported = capacity(run.log)
    assert held == 8 and abs(reported - predicted) <= lay.tile, (reported, predicted)
    assert reported < capacity(engine("auto").log)
    record("kv_tokens", {WIDTHS: reported})
    record("capacity_ratio", {WIDTHS: round(reported / capacity(stock.log), 2)})
    assert hf >= MIN_AGREEMENT, hf


def test_auto_capacity_is_the_layouts() -> None:
    """vLLM's reported KV tokens = kvarn's block count for the budget (`layout.choose_pool` on SmolLM2's 30 layers of
    3 KV heads of 64, DTYPE, max_num_seqs 8) x 128, up to the one block vLLM holds back."""
    import torch

    from kvarn.integrations.vllm.layout import TileLayout, choose_pool, num_blocks_in
    from kvarn.integrations.vllm.pool import fp_slots_for
    from kvarn.presets import get_preset

    preset = get_preset(AUTO)
    lay = TileLayout(preset, 64, getattr(torch, DTYPE))
    budget = KV_GIB * 2**30
    geo, seqs = choose_pool(lay, 3, 30, budget, 8, lambda n: fp_slots_for(preset.policy.sink // lay.tile, n))
    assert seqs == 8
    predicted = num_blocks_in(geo, 30, budget) * lay.tile
    reported, stock = capacity(engine("auto").log), capacity(engine("stock").log)
    assert abs(reported - predicted) <= lay.tile, (reported, predicted)
    record("kv_tokens", {AUTO: reported})
    record("capacity_ratio", {AUTO: round(reported / stock, 2)})


def test_auto_generate_time_recorded() -> None:
    """The generate call's wall time (one batch, engine start excluded) at kvarn-auto and stock, per step (prefill step
    + MAX_NEW - 1 decode steps); recorded for docs/VLLM.md."""
    runs = {f"stock_{DTYPE}": engine("stock"), AUTO: engine("auto")}
    steps = MAX_NEW
    per_step = {k: round(r.out["generate_seconds"] / steps, 3) for k, r in runs.items()}
    record("generate_seconds_per_step", {**per_step, "prompts": list(LENGTHS)})
    assert all(v > 0 for v in per_step.values())
