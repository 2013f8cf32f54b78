"""Budget presets (kvarn-b2.5, kvarn-b3.0): the online key allocation (kvarn.cache.allocation) — its decision rule,
the promotion gain against a float64 oracle, key tiles waiting exact until every layer has scored, the budget held
in stored bytes, packed reads equal to reference reads in a model, and save/load of the decision.

Tolerances: the "output" gain is float32 attention (softmax over <= 400 keys, outputs summed over 64 channels):
against the float64 oracle on the same tile encodings, 1e-4 relative to the low tile's error.
The "logit" gain is summed in float32 by `weighted_error` over B*H*G*D terms; against the float64 sum that is
a relative error of a few float32 eps times log2(terms) at most: 1e-5 relative. Model logits: as
tests/integrations/test_transformers.py (packed vs reference reads, 1e-3 relative through a 2-layer model).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from kvarn.cache.allocation import (
    RULES,
    KeyAllocation,
    best_split,
    output_gain,
    output_gains,
    promotion_gain,
    promotion_gains,
)
from kvarn.integrations.serialize import load_cache, save_cache
from kvarn.integrations.transformers import KVarNCache, KVarNLayer
from kvarn.presets import get_preset
from kvarn.presets.family import affine_preset, budget_preset
from tests.helpers import close, forward_steps, make_tiny_model

pytestmark = pytest.mark.filterwarnings("ignore:kvarn. key tiles stored before any query:UserWarning")


def quantizers(d: int = 64):
    low = get_preset("kvarn-auto-k2v2-g128").quantizers(d)[0]
    return low, get_preset("kvarn-auto-k4v2-g128").quantizers(d)[0]


def test_decision_ranks_by_gain_ties_to_the_lower_layer():
    low, high = quantizers()
    a = KeyAllocation([0, 2, 3, 5], 2, low, high)
    for layer, score in [(0, 1.0), (2, 3.0), (3, 1.0)]:
        a.report(layer, score)
    assert not a.decided
    a.report(2, -100.0)  # the first report counts
    a.report(5, 0.5)
    assert a.decided and a.promoted == {2, 0}  # 0 and 3 tie at 1.0: the lower layer
    assert a.quantizer(2) is high and a.quantizer(3) is low and a.quantizer(5) is low
    with pytest.raises(ValueError, match="layer 1 is not one"):
        a.report(1, 1.0)
    with pytest.raises(ValueError, match="promotes 2 \\+ 0 distinct layers"):
        a.decide([0])
    with pytest.raises(ValueError, match="cannot promote 5"):
        KeyAllocation([0, 1], 5, low, high)
    a.clear()
    assert not a.decided and not a.scores
    with pytest.raises(RuntimeError, match="not decided"):
        a.quantizer(0)


def test_mid_layers_take_the_next_ranks_and_the_budget_left():
    """The mid quantizer goes to the next `mid_count` layers of the same ranking; a budget preset gives it the key
    bits that rounding its high layers down leaves (Gemma 3 270M: 3 quantized layers, none promoted to 4 bits at
    2.5 bits/element, one to 3 bits), never more than the budget."""
    low, high = quantizers()
    mid = affine_preset("kvarn-auto", 3, 2, 128).quantizers(64)[0]
    a = KeyAllocation([0, 1, 2, 3], 1, low, high, mid=mid, mid_count=2)
    for layer, score in [(0, 0.1), (1, 3.0), (2, 2.0), (3, 2.5)]:
        a.report(layer, score)
    assert a.promoted == {1} and a.middle == {3, 2}
    assert [a.quantizer(i).config.bits for i in range(4)] == [2, 4, 3, 3]
    assert a.report_dict()["middle"] == [2, 3] and a.report_dict()["mid_bits"] == 3
    with pytest.raises(ValueError, match="distinct"):
        a.decide([1], [1, 2])
    with pytest.raises(ValueError, match="needs the mid quantizer"):
        KeyAllocation([0, 1], 0, low, high, mid_count=1)
    with pytest.raises(ValueError, match="must share a tile"):
        KeyAllocation([0, 1], 0, low, high, mid=affine_preset("kvarn-auto", 3, 2, 64).quantizers(64)[0])
    for name, n, want in [("kvarn-b2.5", 3, (0, 1)), ("kvarn-b2.5", 24, (4, 0)), ("kvarn-b2.5", 30, (5, 1)),
                          ("kvarn-b3.0", 3, (2, 0)), ("kvarn-b3.0", 4, (2, 1))]:
        p = get_preset(name)
        assert (p.promoted_layers(n), p.mid_layers(n)) == want, (name, n)
        for d in (64, 128):
            bits = p.bits_per_element(d, n)
            assert bits <= p.bits_per_element(d) + 1e-12 and bits <= float(name[7:]) + 0.1875 * (d == 64) + 1e-9


def test_promotion_gain_matches_the_float64_oracle(seed):
    low, high = quantizers()
    gen = torch.Generator().manual_seed(seed)
    b, h, g, d = 2, 3, 128, 64
    x = torch.randn(b, h, g, d, generator=gen, dtype=torch.float64) * torch.rand(d, generator=gen,
                                                                                   dtype=torch.float64) * 4
    w = torch.rand(b, h, d, generator=gen, dtype=torch.float64) + 0.1
    gain = promotion_gain(x.float(), w.float(), low, high)

    def err(q) -> float:  # the same encodings, summed by hand in float64
        flat, ww = x.float().reshape(b * h, g, d), w.float().reshape(b * h, d)
        x_hat = q.decode(q.encode_tiles(flat, ww)[0], torch.float64).reshape(b, h, g, d)
        total = 0.0
        for i in range(b):
            for j in range(h):
                total += float((w[i, j].float().double() * (x_hat[i, j] - x[i, j].float().double()).square()).sum())
        return total

    oracle = err(low) - err(high)
    assert oracle > 0 and abs(gain - oracle) <= 1e-5 * abs(err(low))


def test_output_gain_matches_the_float64_oracle(seed):
    """Causal attention of the last t queries over L keys (GQA: 4 query heads on 2 KV heads), the key tile at
    [first, first + 128) swapped for its low / high encoding; computed again query by query in float64."""
    low, high = quantizers()
    gen = torch.Generator().manual_seed(seed)
    b, h, hq, n, t, d, first = 1, 2, 4, 300, 40, 64, 128
    k = torch.randn(b, h, n, d, generator=gen) * (torch.rand(d, generator=gen) * 3 + 0.2)
    v = torch.randn(b, h, n, d, generator=gen)
    q = torch.randn(b, hq, t, d, generator=gen) * 2
    w = torch.rand(b, h, d, generator=gen) + 0.1
    gain = output_gain(q, k, v, first, w, low, high)

    def encoded(qz) -> torch.Tensor:
        flat = k[:, :, first:first + 128].reshape(b * h, 128, d)
        return qz.decode(qz.encode_tiles(flat, w.reshape(b * h, d))[0], torch.float64).reshape(b, h, 128, d)

    def outputs(tile: torch.Tensor) -> torch.Tensor:
        kk = k.double().clone()
        kk[:, :, first:first + 128] = tile
        out = torch.zeros(hq, t, d, dtype=torch.float64)
        for j in range(hq):
            kv = j // (hq // h)
            for i in range(t):
                pos = n - t + i  # the query's position: it sees keys 0..pos
                s = kk[0, kv, :pos + 1] @ q[0, j, i].double() / d ** 0.5
                out[j, i] = torch.softmax(s, 0) @ v[0, kv, :pos + 1].double()
        return out

    o = outputs(k[:, :, first:first + 128].double())
    e_low = (outputs(encoded(low)) - o).square().sum()
    oracle = float((e_low - (outputs(encoded(high)) - o).square().sum()) / o.square().sum())
    assert oracle > 0 and abs(gain - oracle) <= 1e-4 * float(e_low / o.square().sum())
    with pytest.raises(ValueError, match="rule must be one of"):
        KeyAllocation([0], 0, low, high, rule="entropy")


def feed(cache: KVarNCache, k: list[torch.Tensor], v: list[torch.Tensor], sl: slice) -> None:
    for i, layer in enumerate(cache.layers):  # layer order, as a forward runs them
        if isinstance(layer, KVarNLayer):
            cache.update(k[i][:, :, sl], v[i][:, :, sl], i)


def test_tiles_wait_exact_then_the_largest_gains_take_four_bits_within_the_budget(seed):
    """Four layers of head_dim 128 (the budgets' head size); kvarn-b3.0 promotes floor(0.687 x 4) = 2 to 4 bits and
    spends the rest (0.75 of a 4-bit layer) on one 3-bit layer. The keys of layers 1 and 3 are ten times larger (so
    are their 2-bit errors): they are promoted to 4 bits. Until every layer has
    scored, key tiles wait exact in the tail; values never wait. The packed region then holds exactly the preset's
    bits per element at 4 layers, under 3.0."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                      hidden_size=512, vocab_size=64)
    preset = get_preset("kvarn-b3.0")
    cache = KVarNCache(cfg, preset, attention="reference")
    gen = torch.Generator().manual_seed(seed)
    k = [torch.randn(1, 2, 400, 128, generator=gen) * (10.0 if i in (1, 3) else 1.0) for i in range(4)]
    v = [torch.randn(1, 2, 400, 128, generator=gen) for _ in range(4)]
    cache.update(k[0][:, :, :300], v[0][:, :, :300], 0)
    s0 = cache.layers[0].store
    assert s0.keys.n_tiles == 0 and s0.values.n_tiles == 1 and not cache.key_allocation.decided
    s0.settle()  # the layer scores its first complete tile; the others have not yet
    assert s0.keys.n_tiles == 0 and set(cache.key_allocation.scores) == {0}
    assert torch.equal(s0.keys.full()[:, :, 128:], k[0][:, :, 128:300])  # waiting tiles read exact (the sink: fp16)
    for i in (1, 2, 3):
        cache.update(k[i][:, :, :300], v[i][:, :, :300], i)
        cache.layers[i].store.settle()
    assert cache.key_allocation.promoted == {1, 3}
    feed(cache, k, v, slice(300, 400))  # the next step: every layer stores its tiles with its bits
    report = cache.allocation()
    assert report["key_bits"][1] == report["key_bits"][3] == 4 and sorted(report["key_bits"]) == [2, 3, 4, 4]
    assert report["value_bits"] == [2, 2, 2, 2]
    assert all(cache.layers[i].store.keys.n_tiles == 2 for i in range(4))
    packed = sum(cache.layers[i].store.keys.nbytes().packed + cache.layers[i].store.values.nbytes().packed
                 for i in range(4))
    elements = 4 * 2 * (2 * 128) * 128 * 2  # layers x heads x tiled tokens x D x (keys, values)
    bits = packed * 8 / elements
    assert bits == pytest.approx(preset.bits_per_element(128, 4), rel=1e-12) and bits <= 3.0
    assert preset.bits_per_element(128) == pytest.approx(3.0, abs=1e-9)
    assert get_preset("kvarn-b2.5").bits_per_element(128) <= 2.5 + 1e-12


@pytest.mark.parametrize(("rule", "high", "budget"), [(r, 4, 3.0) for r in RULES] + [("output", 3, 2.65)])
def test_packed_reads_match_reference_reads_in_a_model(rule, high, budget, seed):
    """A budget preset in a 2-layer model (one layer promoted), under each allocation rule and with 3-bit promotions
    (2.65 bits: one layer of two at 3 bits): a 150-token prefill (one tile past an 8-token sink), a 5-token chunk and
    decode steps give the same logits through packed reads (the fused kernel for every width) as through the model's
    attention on dequantized K/V; and the promoted layer's keys are `high`-bit, the other's 2-bit."""
    model = make_tiny_model("llama", head_dim=64)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 256, (1, 158), generator=gen)
    chunks = [150, 5, 1, 1, 1]
    preset = budget_preset(budget, rule=rule, high=high, mid=3 if high == 4 else None)
    ref_cache = KVarNCache(model.config, preset, sink=8, attention="reference")
    ref = forward_steps(model, ids, ref_cache, chunks)
    cache = KVarNCache(model.config, preset, sink=8)
    got = forward_steps(model, ids, cache, chunks)
    assert close(got, ref, rel=1e-3), f"max diff {(got - ref).abs().max()}"
    bits = cache.allocation()["key_bits"]
    assert sorted(bits) == [2, high] and bits == ref_cache.allocation()["key_bits"]
    assert len(cache.key_allocation.promoted) == 1


def test_save_load_keeps_the_decision(tmp_path, seed):
    """Four layers: kvarn-b3.0 keeps two at 4-bit keys and one at 3 bits; a loaded cache restores both sets."""
    model = make_tiny_model("llama", head_dim=64, layers=4)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 256, (1, 160), generator=gen)
    cache = KVarNCache(model.config, "kvarn-b3.0", sink=8)
    forward_steps(model, ids, cache, [150, 10])
    save_cache(cache, tmp_path / "c.safetensors")
    back = load_cache(tmp_path / "c.safetensors", model.config)
    assert back.key_allocation.promoted == cache.key_allocation.promoted
    assert back.key_allocation.middle == cache.key_allocation.middle and len(cache.key_allocation.middle) == 1
    assert back.allocation()["key_bits"] == cache.allocation()["key_bits"]
    for a, b in zip(cache.layers, back.layers):
        assert torch.equal(a.store.keys.full(), b.store.keys.full())
    more = torch.randint(3, 256, (1, 3), generator=gen)
    assert torch.equal(forward_steps(model, more, cache, [1, 1, 1]), forward_steps(model, more, back, [1, 1, 1]))


def test_output_rule_decides_when_decoding_one_token_at_a_time(seed):
    """Token by token (the decode protocol): each layer keeps the newest queries until its first tile completes
    (position 8 + 128), scores on them, drops them; the next step stores every layer's tile at its bits."""
    model = make_tiny_model("llama", head_dim=64)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 256, (1, 138), generator=gen)
    cache = KVarNCache(model.config, budget_preset(3.0, rule="output"), sink=8)
    forward_steps(model, ids, cache, [1] * 136)
    assert cache.key_allocation.decided and set(cache.key_allocation.scores) == {0, 1}
    held = [la.store._recent_q for la in cache.layers]
    assert held == [None, None]
    forward_steps(model, ids[:, 136:], cache, [1, 1])
    assert sorted(cache.allocation()["key_bits"]) == [2, 4]
    assert all(la.store.keys.n_tiles == 1 for la in cache.layers)



def test_output_rule_scores_the_same_under_every_protocol(seed):
    """The "output" rule's scores do not depend on how the prompt arrives: one forward over 200 tokens (generate),
    chunks ending at the first tile (serving) and token by token (decode) score every layer alike, because the
    queries past the first tile's end (8 + 128) are dropped. Before, one forward scored on its last 128 queries, far
    from that tile, and chose other layers (docs/TASKS.md, "The generate protocol")."""
    model = make_tiny_model("llama", head_dim=64, layers=4)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 256, (1, 200), generator=gen)
    scores = []
    for chunks in ([200], [8, 128, 64], [1] * 136 + [64]):
        cache = KVarNCache(model.config, budget_preset(3.0, rule="output", pick="best"), sink=8)
        forward_steps(model, ids, cache, chunks)
        assert cache.key_allocation.decided
        scores.append(cache.key_allocation.scores)
    for other in scores[1:]:
        assert other.keys() == scores[0].keys()
        for layer, gains in scores[0].items():
            assert torch.allclose(torch.tensor(other[layer]), torch.tensor(gains), rtol=1e-4, atol=1e-7), layer

def mid_quantizer(d: int = 64):
    return affine_preset("kvarn-auto", 3, 2, 128).quantizers(d)[0]


def test_best_split_is_the_exhaustive_optimum(seed):
    """pick "best": over every assignment of six layers to 2/3/4-bit keys whose (h, m) the budget allows, the dynamic
    program's choice reaches the largest summed gain (brute force over 3^6 assignments); concentrated gains buy 4-bit
    layers, spread ones twice as many 3-bit layers."""
    layers = [0, 2, 3, 5, 6, 8]
    splits = budget_preset(3.0, pick="best").key_splits(len(layers))
    assert (4, 0) in splits and (0, 8 - 2) in splits and (2, 4) in splits and (3, 3) not in splits
    gen = torch.Generator().manual_seed(seed)
    for trial in range(20):
        high = {i: float(x) for i, x in zip(layers, torch.randn(6, generator=gen, dtype=torch.float64).exp() - 0.3)}
        mid = {i: high[i] * float(f) for i, f in zip(layers, torch.rand(6, generator=gen, dtype=torch.float64) + 0.2)}
        best = -float("inf")
        for widths in itertools.product((0, 1, 2), repeat=6):  # 0: low, 1: mid, 2: high
            if (widths.count(2), widths.count(1)) in splits:
                best = max(best, sum(high[i] if w == 2 else mid[i] if w == 1 else 0.0 for i, w in zip(layers, widths)))
        hs, ms = best_split(layers, high, mid, splits)
        assert (len(hs), len(ms)) in splits and not set(hs) & set(ms)
        assert sum(high[i] for i in hs) + sum(mid[i] for i in ms) == pytest.approx(best, rel=1e-12, abs=1e-12), trial
    tight = budget_preset(2.5, pick="best").key_splits(len(layers))  # one 4-bit layer or two 3-bit ones
    assert set(tight) == {(0, 0), (0, 1), (0, 2), (1, 0)}
    spread = {i: 1.0 for i in layers}
    assert best_split(layers, spread, {i: 0.8 for i in layers}, tight) == ((), (0, 2))  # ties: the lower layers
    peaked = {**spread, 3: 10.0, 6: 2.0}
    assert best_split(layers, peaked, {i: 0.8 * g for i, g in peaked.items()}, tight) == ((3,), ())


def test_pick_best_reports_both_widths_and_keeps_the_budget():
    """The allocation under pick "best": a layer reports its gains at 4 and 3 bits, the decision is the best split;
    every allowed split spends at most the budget (stored bytes, scales included, heads of 64 and 128), the preset's
    bits count the most it may spend, and a preset without a mid width or splits is refused."""
    low, high, mid = *quantizers(), mid_quantizer()
    p = budget_preset(2.5, pick="best")
    a = KeyAllocation([0, 1, 2, 3], 1, low, high, mid=mid, pick="best", splits=p.key_splits(6, 64))
    assert a.splits == {(0, 0), (0, 1), (0, 2), (1, 0)} and a.scores_mid
    with pytest.raises(ValueError, match="mid width too"):
        a.report(0, 1.0)
    for layer, (g4, g3) in enumerate([(1.0, 0.9), (3.0, 1.2), (0.1, 0.05), (2.0, 1.9)]):
        a.report(layer, g4, g3)
    assert a.promoted == frozenset() and a.middle == {1, 3}  # 1.2 + 1.9 > 3.0, the best single 4-bit layer
    assert a.report_dict()["pick"] == "best" and a.report_dict()["mid_scores"]["3"] == 1.9
    with pytest.raises(ValueError, match="distinct layers"):
        a.decide([1], [0])
    a.decide([1])
    assert [a.quantizer(i).config.bits for i in range(4)] == [2, 4, 2, 2]
    for name in ("kvarn-b2.5", "kvarn-b3.0"):
        rank, best = get_preset(name), budget_preset(float(name[7:]), pick="best")
        for n in (3, 4, 24, 30):
            for d in (64, 128):
                kq, vq = rank.quantizers(d)
                k_lo, v = kq.bits_per_element(d), vq.bits_per_element(d)
                up4, up3 = (f(d).bits_per_element(d) - k_lo for f in (rank.key_high, rank.key_mid))
                splits = best.key_splits(n, d)
                assert (rank.promoted_layers(n), rank.mid_layers(n, d)) in splits
                most = max((k_lo + (h * up4 + m * up3) / n + v) / 2 for h, m in splits)
                assert most <= rank.bits_per_element(d) + 1e-9  # within the budget at the promote share
                assert best.bits_per_element(d, n) == pytest.approx(most, rel=1e-12)
                assert best.bits_per_element(d, n) >= rank.bits_per_element(d, n) - 1e-12
    with pytest.raises(ValueError, match="needs a mid width"):
        budget_preset(2.5, pick="best", mid=None)
    with pytest.raises(ValueError, match="needs splits"):
        KeyAllocation([0, 1], 0, low, high, mid=mid, pick="best")


def test_gains_at_several_widths_are_the_single_gains(seed):
    """One scoring pass for both widths gives the same numbers as one pass per width (the "best" pick reads both)."""
    low, high, mid = *quantizers(), mid_quantizer()
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(1, 2, 300, 64, generator=gen) * (torch.rand(64, generator=gen) * 3 + 0.2)
    v, q = torch.randn(1, 2, 300, 64, generator=gen), torch.randn(1, 4, 40, 64, generator=gen) * 2
    w = torch.rand(1, 2, 64, generator=gen) + 0.1
    assert output_gains(q, k, v, 128, w, low, (high, mid)) == (output_gain(q, k, v, 128, w, low, high),
                                                                output_gain(q, k, v, 128, w, low, mid))
    tile = k[:, :, 128:256]
    assert promotion_gains(tile, w, low, (high, mid)) == (promotion_gain(tile, w, low, high),
                                                         promotion_gain(tile, w, low, mid))
    g4, g3 = output_gains(q, k, v, 128, w, low, (high, mid))
    assert g4 > g3 > 0  # 4-bit keys remove more of the 2-bit error than 3-bit keys


def test_pick_best_in_a_model_reads_packed_as_reference_and_saves(tmp_path, seed):
    """A 2-layer model at 3.0 bits under pick "best": the split is one 4-bit layer or both at 3 bits, whichever sums
    the larger gain; packed reads match reference reads (1e-3 relative) and a saved cache restores the decision and
    both widths' scores."""
    model = make_tiny_model("llama", head_dim=64)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 256, (1, 158), generator=gen)
    preset = budget_preset(3.0, pick="best", name="kvarn-b3.0-best")
    ref_cache = KVarNCache(model.config, preset, sink=8, attention="reference")
    ref = forward_steps(model, ids, ref_cache, [150, 5, 1])
    cache = KVarNCache(model.config, preset, sink=8)
    got = forward_steps(model, ids, cache, [150, 5, 1])
    assert close(got, ref, rel=1e-3), f"max diff {(got - ref).abs().max()}"
    a = cache.key_allocation
    assert a.splits == {(0, 0), (0, 1), (0, 2), (1, 0)}
    want = [4, 2] if max(a.scores.values()) >= sum(a.mid_scores.values()) else [3, 3]
    bits = cache.allocation()["key_bits"]
    assert sorted(bits, reverse=True) == want and bits == ref_cache.allocation()["key_bits"]
    save_cache(cache, tmp_path / "c.safetensors")
    back = load_cache(tmp_path / "c.safetensors", model.config, preset=preset)
    assert back.key_allocation.report_dict() == a.report_dict()
    more = ids[:, 156:]
    assert torch.equal(forward_steps(model, more, cache, [1, 1]), forward_steps(model, more, back, [1, 1]))


def test_budget_with_8bit_scales_buys_more_promotion():
    """budget_preset(scale_dtype=e4m3): every width's row scales are e4m3, the budget still holds at head_dim 128 from
    the quantizers' own byte counts, and the 1/16 bit each element saves buys a larger promoted share (the lever
    measured in docs/TASKS.md, "8-bit scale vectors")."""
    plain = budget_preset(2.5, pick="best")
    fp8 = budget_preset(2.5, pick="best", scale_dtype=torch.float8_e4m3fn)
    d = 128
    for q in (*fp8.quantizers(d), fp8.key_high(d), fp8.key_mid(d)):
        assert q.config.scale_dtype == torch.float8_e4m3fn
    k_lo, v = (q.bits_per_element(d) for q in fp8.quantizers(d))
    k_hi = fp8.key_high(d).bits_per_element(d)
    assert (k_lo + fp8.promote * (k_hi - k_lo) + v) / 2 <= 2.5 + 1e-9
    assert fp8.promote > plain.promote and plain.quantizers(d)[0].config.scale_dtype == torch.float16
