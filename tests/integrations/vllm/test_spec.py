"""The kvarn page spec as vLLM's engine core handles it (needs vLLM; no engine start).

vLLM merges the layer specs of a KV cache group into one spec (`type(specs[0]).merge(specs)`,
vllm/v1/core/kv_cache_utils.py) before it sizes the cache and builds the scheduler; for a uniform model that is every
layer. The merged spec must still cap the scheduler's max_num_seqs at what kvarn's fp pool holds, or the engine core
schedules more sequences than the pool has slots for and the worker stops with "all N full-precision blocks are in
use" (found by `kvarn bench vllm --quick`: 12 requests in 64 MiB, a pool of 9 slots for 3 sequences, 8 scheduled).
"""

from __future__ import annotations

import contextlib
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
