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


def test_a_high_quantizer_of_another_statistics_kind_is_refused():
    """A query-aware preset's stores keep E[q q^T]; a swapped-in quantizer that takes the query energy would be fed
    the covariance at its first tile. The swap itself says so (`--high kvarn-auto-k4v4-g128-qar` fits)."""
    cfg = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      hidden_size=256, vocab_size=64)
    with pytest.raises(ValueError, match="other running query statistics"):
        promote(KVarNCache(cfg, "kvarn-auto-k2v2-g128-qar-clip"), "keys@0",
                get_preset("kvarn-auto-k4v4-g128").quantizers(64))
    cache = KVarNCache(cfg, "kvarn-auto-k2v2-g128-qar-clip")
    high = get_preset("kvarn-auto-k4v4-g128-qar").quantizers(64)
    promote(cache, "keys@1", high)
    assert cache.layers[1].store.keys.quantizer is high[0]


def test_exact_mixes_recover_against_their_own_control():
    """Exact-row mixes read through the reference path, so their recovery is against `exact:keys:none` (the same
    path, nothing exact), and the other variants' against the preset's packed reads."""
    rec = [{"index": 0, "variant": v, "gold_logprob": lp} for v, lp in [
        ("full", -1.0), ("base", -5.0), ("exact:keys:none", -6.0), ("exact:keys:head0", -2.0), ("keys", -3.0)]]
    rows = {r["variant"]: r for r in summarize(rec, [], [])["rows"]}
    assert rows["exact:keys:head0"]["recovered"] == pytest.approx(4.0)
    assert rows["exact:keys:head0"]["share_of_gap"] == pytest.approx(0.8) and rows["exact:keys:head0"]["against"] \
        == "exact:keys:none"
    assert rows["keys"]["recovered"] == pytest.approx(2.0) and rows["keys"]["against"] == "base"
