"""The kvarn page spec as vLLM's engine core handles it (needs vLLM; no engine start).

vLLM merges the layer specs of a KV cache group into one spec (`type(specs[0]).merge(specs)`,
vllm/v1/core/kv_cache_utils.py) before it sizes the cache and builds the scheduler; for a uniform model that is every
layer. The merged spec must still cap the scheduler's max_num_seqs at what kvarn's fp pool holds, or the engine core
schedules more sequences than the pool has slots for and the worker stops with "all N full-precision blocks are in
use" (found by `kvarn bench vllm --quick`: 12 requests in 64 MiB, a pool of 9 slots for 3 sequences, 8 scheduled).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed: the kvarn page spec is not tested")

from vllm.v1.kv_cache_interface import FullAttentionSpec

from kvarn.integrations.vllm.backend import KVarNAttentionSpec


def _spec(cap: int | None) -> KVarNAttentionSpec:
    return KVarNAttentionSpec(block_size=128, num_kv_heads=3, head_size=64, dtype=torch.uint8,
                              state_content_bytes=73, kvarn_max_num_seqs=cap)


def test_merged_spec_keeps_the_sequence_cap_and_caps_the_scheduler() -> None:
    specs = [_spec(3) for _ in range(30)]
    merged = type(specs[0]).merge(specs)  # what vLLM's grouping does
    assert isinstance(merged, KVarNAttentionSpec) and merged.kvarn_max_num_seqs == 3
    assert type(specs[0]).merge([_spec(5), _spec(3), _spec(4)]).kvarn_max_num_seqs == 3  # the smallest
    assert type(specs[0]).merge([_spec(None), _spec(None)]).kvarn_max_num_seqs is None
    base = FullAttentionSpec.merge([FullAttentionSpec(block_size=128, num_kv_heads=3, head_size=64,
                                                      dtype=torch.uint8, state_content_bytes=73)])
    assert not hasattr(base, "kvarn_max_num_seqs")  # why the override exists: vLLM rebuilds from base fields
    cfg = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=8))
    with contextlib.suppress(AttributeError):  # the engine core's sizing call: the cap comes first, the rest of
        merged.max_memory_usage_bytes(cfg)  # the computation needs the parts of vLLM's config this stub lacks
    assert cfg.scheduler_config.max_num_seqs == 3


def test_budget_page_classes_form_one_group_that_still_caps_the_scheduler() -> None:
    """A budget preset's kvarn layers have pages of several sizes (`budget.class_spec_bytes`): vLLM must still hold
    them in ONE KV cache group (`UniformTypeKVCacheSpecs`: one block table, per-layer page sizes, the sum counted
    per block), and its sizing call must still reach each layer's cap."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    from kvarn.integrations.vllm.budget import class_spec_bytes, page_classes
    from kvarn.presets import get_preset

    preset = get_preset("kvarn-b2.5-qar")
    names = [f"model.layers.{i}.self_attn.attn" for i in range(30)]
    base = {n: _spec(3) for n in names}
    sizes = class_spec_bytes(base, preset, 12, torch.bfloat16)
    specs = {n: replace(s, state_content_bytes=sizes[n]) for n, s in base.items()}
    classes = page_classes(preset, 30, 64)
    # sized for the split that promotes the most layers (`budget.sized_split`): 11 layers of 3-bit keys, 19 of 2-bit
    assert len(set(sizes.values())) == 2 and [sizes[n] for n in names] == sorted(sizes.values(), reverse=True)
    assert classes.count("high") == 0 and classes.count("mid") == 11
    uniform = UniformTypeKVCacheSpecs.from_specs(specs)
    assert uniform is not None and list(uniform.kv_cache_specs) == names
    assert uniform.page_size_bytes == sum(s.page_size_bytes for s in specs.values())
    cfg = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=8))
    with contextlib.suppress(AttributeError):
        uniform.max_memory_usage_bytes(cfg)
    assert cfg.scheduler_config.max_num_seqs == 3


def test_new_blocks_are_zeroed_in_vllms_layers_only() -> None:
    """A hybrid model's cache mixes precisions (kvarn's uint8 pages, the sliding-window layers' model dtype), so vLLM
    zeroes every newly allocated block, slab kv[block] of each full-attention layer's tensor. A kvarn page tensor is
    not one slab per block (`pool.page_regions`): the guard leaves the kvarn layers out, in the same group or not,
    and still zeroes vLLM's own layers."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    from kvarn.integrations.vllm.backend import KVarNAttentionImpl, install_zeroing_guard

    install_zeroing_guard()
    install_zeroing_guard()  # once per process, however many layers call it
    assert getattr(CPUModelRunner._zero_block_ids, "kvarn_hook", False)
    window = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.float32)
    layers = {"kvarn.0": object.__new__(KVarNAttentionImpl), "window.0": object(), "kvarn.1":
              object.__new__(KVarNAttentionImpl)}
    ctx = {n: SimpleNamespace(impl=impl, kv_cache=torch.ones(4, 2, 8, dtype=torch.uint8)) for n, impl in layers.items()}
    groups = [KVCacheGroupSpec(["kvarn.0", "window.0"], window), KVCacheGroupSpec(["kvarn.1"], _spec(None))]
    cfg = KVCacheConfig(num_blocks=4, kv_cache_tensors=[], kv_cache_groups=groups)
    runner = object.__new__(CPUModelRunner)
    runner.kv_cache_config = cfg
    runner.compilation_config = SimpleNamespace(static_forward_context=ctx)
    runner._zero_block_ids([1, 3])
    assert runner.kv_cache_config is cfg  # restored
    zeroed = ctx["window.0"].kv_cache
    assert not zeroed[[1, 3]].any() and zeroed[[0, 2]].all()
    assert ctx["kvarn.0"].kv_cache.all() and ctx["kvarn.1"].kv_cache.all()
