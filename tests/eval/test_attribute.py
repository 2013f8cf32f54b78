"""`kvarn eval attribute` (kvarn/eval/attribute.py): which part of the cache a variant promotes, and the table's
arithmetic (recovery = variant - base on the same samples; share = recovery / (full - base))."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from kvarn.eval.attribute import promote, summarize, variants
from kvarn.integrations.transformers import KVarNCache
from kvarn.presets import get_preset


def test_a_variant_promotes_only_its_part():
    cfg = LlamaConfig(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      hidden_size=256, vocab_size=64)
    high = get_preset("kvarn-auto-k4v4-g128").quantizers(64)
    assert variants([0, 1, 2], ["keys"], ["kvarn-b2.5"]) == ["full", "base", "preset:kvarn-b2.5", "keys", "keys@0",
                                                             "keys@1", "keys@2"]
    for v, keys4, values4 in [("keys@1", [1], []), ("keys", [0, 1, 2], []), ("values@2", [], [2]), ("base", [], [])]:
        cache = KVarNCache(cfg, "kvarn-auto-k2v2-g128")
        promote(cache, v, high)
        assert [i for i, la in enumerate(cache.layers) if la.store.keys.quantizer is high[0]] == keys4, v
        assert [i for i, la in enumerate(cache.layers) if la.store.values.quantizer is high[1]] == values4, v


def test_recovery_and_share_of_the_gap():
    rec = [{"index": i, "variant": v, "gold_logprob": lp} for i, v, lp in [
        (0, "full", -1.0), (0, "base", -3.0), (0, "keys@0", -2.0), (1, "full", -0.5), (1, "base", -1.5),
        (1, "keys@0", -1.5), (0, "keys@1", -3.5)]]
    s = summarize(rec, [0, 1], ["keys"])
    rows = {r["variant"]: r for r in s["rows"]}
    assert s["gap"] == pytest.approx(1.5)  # mean of 2.0 and 1.0
    assert rows["keys@0"]["recovered"] == pytest.approx(0.5) and rows["keys@0"]["share_of_gap"] == pytest.approx(1 / 3)
    assert rows["keys@1"]["samples"] == 1 and rows["keys@1"]["share_of_gap"] == pytest.approx(-0.25)
    assert s["per_layer"]["keys"] == [pytest.approx(0.5), pytest.approx(-0.5)]
