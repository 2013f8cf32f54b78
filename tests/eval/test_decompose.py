"""Magnitude/direction decomposition of per-token errors (kvarn.eval.decompose)."""

from __future__ import annotations

import math

import pytest
import torch

from kvarn.cache.store import LayerStore
from kvarn.eval.decompose import FRACTIONS, decompose_errors, layer_errors, norm_rank, run_decomposition, shares
from kvarn.presets import get_preset


def _kv(seed: int, t: int = 300, h: int = 2, d: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(1, h, t, 1, generator=g).pow(4) * 10 + 0.1  # token norms spread over two decades
    return torch.randn(1, h, t, d, generator=g) * scale, torch.randn(1, h, t, d, generator=g) * scale


def test_identity_is_exact_in_float64(seed):
    """E_M + E_D = E_T up to float64 rounding: |diff| <= 1e-12 (||x||^2 + ||x^||^2), i.e. a few ulps of the
    terms being added; a wrong formula (e.g. 1 - cos without the norms) is off by O(1)."""
    k, v = _kv(seed)
    store = LayerStore.from_preset(get_preset("kvarn-k2v2-g64"), 64, sink=16)
    store.append(k, v)
    for x, xh in ((k, store.keys.full()), (v, store.values.full()), (k, torch.randn_like(k))):
        e = decompose_errors(x, xh)
        scale = e["norm"] ** 2 + e["norm_hat"] ** 2
        assert ((e["e_m"] + e["e_d"] - e["e_t"]).abs() <= 1e-12 * scale).all()
        assert (e["e_m"] >= 0).all() and (e["e_d"] >= -1e-12 * scale).all()


def test_pure_magnitude_and_pure_direction(seed):
    x = _kv(seed)[0].flatten(0, 2)  # [N, D]
    c = torch.rand(x.shape[0], 1, dtype=torch.float64) + 0.5
    e = decompose_errors(x, x.double() * c)  # same direction: all magnitude
    s = shares({**e, "rank": torch.rand(x.shape[0])})
    assert s["magnitude_share"] == pytest.approx([1.0] * len(FRACTIONS), abs=1e-9)
    q, _ = torch.linalg.qr(torch.randn(x.shape[1], x.shape[1], dtype=torch.float64))
    e = decompose_errors(x, x.double() @ q)  # same norm, rotated: all direction
    s = shares({**e, "rank": torch.rand(x.shape[0])})
    assert s["magnitude_share"] == pytest.approx([0.0] * len(FRACTIONS), abs=1e-9)


def test_only_quantized_tiles_are_counted(seed):
    k, v = _kv(seed)
    errs = layer_errors(get_preset("rtn-k2v2-g64"), k, v, sink=16)
    n = (300 - 16) // 64 * 64  # complete tiles after the sink; the rest is the exact tail
    for kind, x in (("keys", k), ("values", v)):
        e = errs[kind]
        assert e["e_t"].shape == (2, n)
        store = LayerStore.from_preset(get_preset("rtn-k2v2-g64"), 64, sink=16)
        store.append(k, v)
        full = (store.keys if kind == "keys" else store.values).full()
        ref = (x.double() - full.double()).pow(2).sum(-1)[:, :, 16:16 + n].flatten(0, 1)
        assert torch.allclose(e["e_t"], ref, rtol=1e-10, atol=0)
        assert ((e["rank"] >= 0) & (e["rank"] <= 1)).all()


def test_shares_counts_and_ranges(seed):
    k, v = _kv(seed)
    e = layer_errors(get_preset("kvarn-k2v2-g64"), k, v, sink=0)["keys"]
    s = shares(e)
    n = e["e_t"].numel()
    assert s["top_tokens"] == [max(1, math.ceil(f * n)) for f in FRACTIONS]
    assert all(0 <= x <= 1 for x in s["magnitude_share"] + s["extreme_norm_share"])
    assert s["mean_error"] == sorted(s["mean_error"], reverse=True)  # bigger sets, smaller mean error


def test_norm_rank():
    r = norm_rank(torch.tensor([[3.0, 1.0, 2.0]]))
    assert torch.equal(r, torch.tensor([[1.0, 0.0, 0.5]], dtype=torch.float64))


def test_run_decomposition_pools_layers_and_skips_fp_layers(seed):
    kv = [_kv(seed + i) for i in range(3)]
    records, samples = run_decomposition(kv, [get_preset("rtn-k2v2-g64")], 16, plot_layer=1)
    assert [r["kind"] for r in records] == ["keys", "values"]
    n = (300 - 16) // 64 * 64
    assert records[0]["tokens"] == 3 * 2 * n
    assert records[0]["identity_max_rel_error"] <= 1e-12
    assert set(records[0]["per_layer_magnitude_share"]) == {"0", "1", "2"}
    assert len(samples["keys"]["rtn-k2v2-g64"]["norm"]) == 2 * n
