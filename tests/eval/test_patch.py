"""The outlier-replacement mechanism (kvarn.eval.patch) and the end-to-end outlier experiment."""

from __future__ import annotations

import pytest
import torch

from kvarn.eval.engine import RunSpec, run_blocks
from kvarn.eval.outliers import fixed_share
from kvarn.eval.patch import PatchedQuantizer, patched_preset
from kvarn.presets import get_preset
from tests.helpers import make_tiny_model

G, D = 64, 64


def _tiles(seed: int, n: int = 6) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # heavy-tailed token scales, so the worst tokens are well separated from the rest
    return torch.randn(n, G, D, generator=g) * torch.rand(n, G, 1, generator=g).pow(3).mul(8).add(0.2)


def _inner(kind: str = "key"):
    k, v = get_preset("rtn-k2v2-g64").quantizers(D)
    return k if kind == "key" else v


@pytest.mark.parametrize("granularity", ["token", "element"])
def test_selection_counts_and_complement(seed, granularity):
    x = _tiles(seed)
    inner = _inner()
    xh = inner.roundtrip(x)
    worst = PatchedQuantizer(inner, 0.05, granularity, "worst").selected(x, xh)
    rest = PatchedQuantizer(inner, 0.05, granularity, "rest").selected(x, xh)
    assert torch.equal(worst, ~rest)
    per_tile = worst.flatten(1).sum(1)
    count = G if granularity == "token" else G * D
    expect = round(0.05 * count) * (D if granularity == "token" else 1)
    assert (per_tile == expect).all()
    assert fixed_share(0.05, granularity, "worst", G, D) == pytest.approx(round(0.05 * count) / count)
    # the selected entries are the largest errors of their tile
    err = (x - xh).pow(2) if granularity == "element" else (x - xh).pow(2).sum(-1, keepdim=True).expand_as(x)
    for n in range(x.shape[0]):
        assert err[n][worst[n]].min() >= err[n][~worst[n]].max()


@pytest.mark.parametrize("granularity", ["token", "element"])
def test_patched_decode(seed, granularity):
    x = _tiles(seed)
    inner = _inner("value")
    base_err = (inner.roundtrip(x) - x).pow(2).sum()
    for which, frac in (("worst", 1.0), ("rest", 0.0)):  # both mean: every entry exact
        q = PatchedQuantizer(inner, frac, granularity, which)
        assert torch.equal(q.roundtrip(x), x)
    worst = PatchedQuantizer(inner, 0.05, granularity, "worst")
    y = worst.roundtrip(x)
    mask = worst.selected(x, inner.roundtrip(x))
    assert torch.equal(y[mask], x[mask])  # fixed entries bit for bit
    assert torch.equal(y[~mask], inner.roundtrip(x)[~mask])  # the others exactly as the method stores them
    assert (y - x).pow(2).sum() < base_err


def test_patched_preset_and_bad_input():
    p = patched_preset(get_preset("rtn-k2v2-g64"), 0.05, "token", "worst")
    assert p.tile == 64 and p.sink == 128 and "exact-worst" in p.name
    k, v = p.quantizers(D)
    assert isinstance(k, PatchedQuantizer) and k.inner.config.axis == "channel"
    assert isinstance(v, PatchedQuantizer) and v.inner.config.axis == "token"
    with pytest.raises(ValueError, match="does not quantize"):
        patched_preset(get_preset("fp16"), 0.05)
    with pytest.raises(ValueError, match="fraction"):
        PatchedQuantizer(_inner(), 1.5)
    with pytest.raises(ValueError, match="granularity"):
        PatchedQuantizer(_inner(), 0.1, "channel")


def test_fixing_all_errors_gives_zero_kl(seed):
    """End to end in cumulative mode: with every quantized entry replaced by its exact value the run is
    the reference (KL 0 within 1e-9: same values, same kernels); fixing none leaves a real error."""
    model = make_tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=64, hidden=128, vocab=256)
    ids = torch.randint(3, 256, (1, 256), generator=torch.Generator().manual_seed(seed))
    base = get_preset("rtn-k2v2-g64")
    specs = [RunSpec("base", base), RunSpec("all-worst", patched_preset(base, 1.0, "token", "worst")),
             RunSpec("all-rest", patched_preset(base, 0.0, "element", "rest")),
             RunSpec("worst5", patched_preset(base, 0.05, "token", "worst"))]
    _, (b, w, r, w5) = run_blocks(model, ids, specs, 32, sink=0, show_progress=False)
    assert b.positions("kl").mean() > 1e-6
    assert w.positions("kl").abs().max() <= 1e-9 and r.positions("kl").abs().max() <= 1e-9
    assert w.per_block("mae").max() <= 1e-6
    assert not torch.equal(w5.positions("kl"), b.positions("kl"))
