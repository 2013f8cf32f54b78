"""Clipped ranges (issue 20: `AffineConfig.clip`, `kvarn.ops.rtn.row_range`): each row's grid spans a share of its
range about the midpoint, values outside take the end codes; the stored fields and every read path are unchanged.

Checked: codes, stored scales and the reconstruction against the float64 tile oracle (tests/reference/affine.py,
the clip in tests/reference/rtn.py) on both axes, with and without VarN and the rotation; the op against the float64
row reference; clipping lowers the squared error of Gaussian rows at 2 bits and raises it past the best share;
query-aware rounding keeps the clipped grid and lowers e^T Sigma e; the kernels serve it (the store's bit-exactness:
tests/kernels/test_cpu_store.py); bad shares are refused; in a model, packed reads match reference reads.
"""

from __future__ import annotations

import pytest
import torch

from kvarn.ops.rtn import row_range, rtn_quantize
from kvarn.quant.affine import AffineConfig, AffineQuantizer, QueryAwareQuantizer
from tests.helpers import check_against_reference
from tests.reference.rtn import rtn_row

G, D = 128, 64


@pytest.mark.parametrize("clip", [0.8, 0.55])
@pytest.mark.parametrize("bits", [2, 4])
def test_rtn_against_float64_row_reference(clip: float, bits: int, seed: int) -> None:
    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 3 + 1
    q, delta, lo = rtn_quantize(x, bits, clip)
    for i in range(len(x)):
        codes, d, low, _ = rtn_row(x[i].tolist(), bits, clip)
        assert q[i].tolist() == codes
        assert delta[i].item() == pytest.approx(d, rel=1e-12) and lo[i].item() == pytest.approx(low, rel=1e-12)
    lo1, hi1 = row_range(x, 1.0)
    assert torch.equal(lo1, x.amin(-1, keepdim=True)) and torch.equal(hi1, x.amax(-1, keepdim=True))


@pytest.mark.parametrize("axis", ["channel", "token"])
@pytest.mark.parametrize("rotate", ["none", "hadamard"])
@pytest.mark.parametrize("varn", [False, True])
def test_against_float64_oracle(axis: str, rotate: str, varn: bool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, G, D, generator=gen) * torch.rand(1, 1, D, generator=gen) * 3
    check_against_reference(AffineQuantizer(AffineConfig(2, axis, rotate, varn, tile=G, clip=0.75)), x)


def test_clipping_trades_range_for_resolution() -> None:
    """Gaussian rows of 128 at 2 bits (scripts/clip_share.py gaussian: min-max 0.251 sigma^2, the best share 0.6
    0.122): a grid over 0.75 of the range has less squared error than the full range; one over 0.3 clips too much
    and has more."""
    x = torch.randn(512, G, generator=torch.Generator().manual_seed(3), dtype=torch.float64)

    def mse(clip: float) -> float:
        q, delta, lo = rtn_quantize(x, 2, clip)
        return float((q.double() * delta + lo - x).square().mean())

    full, mild, hard = mse(1.0), mse(0.75), mse(0.3)
    assert mild < 0.75 * full and hard > full, (full, mild, hard)


def test_query_aware_keeps_the_clipped_grid() -> None:
    """QueryAwareQuantizer with clip: the row scales and zeros of nearest rounding with the same clip, and less
    logit error e^T Sigma e over the tile than nearest rounding."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, G, D, generator=gen)
    a = torch.randn(2, D, 8, generator=gen)
    sigma = a @ a.transpose(-1, -2) / 8 + 0.01 * torch.eye(D)
    cfg = AffineConfig(2, "channel", "none", True, tile=G, clip=0.8)
    near, qa = AffineQuantizer(cfg), QueryAwareQuantizer(cfg)
    pn, pq = near.encode_reference(x), qa.encode_reference(x, sigma)
    assert torch.equal(pn.row_scale, pq.row_scale) and torch.equal(pn.row_zero, pq.row_zero)
    assert not torch.equal(pn.codes, pq.codes)

    def logit_error(p) -> float:
        e = near.decode(p).double() - x.double()  # [N, G, D]
        return float(torch.einsum("ngd,nde,nge->", e, sigma.double(), e))

    assert logit_error(pq) < logit_error(pn)


def test_kernels_serve_it_and_bad_shares_are_refused() -> None:
    """The same fields: the fused decode reads them and the store kernel writes them (bit for bit against the
    reference: tests/kernels/test_cpu_store.py::test_clipped_ranges, tests/quant/test_query_aware.py)."""
    from kvarn.attention.fused import unsupported_quantizers

    k = AffineQuantizer(AffineConfig(2, "channel", "auto", True, tile=G, clip=0.8))
    v = AffineQuantizer(AffineConfig(2, "token", "auto", True, tile=G, clip=0.8))
    assert unsupported_quantizers(k, v) is None
    assert "clip0.8" in k.name and k.template(D).nbytes == AffineQuantizer(
        AffineConfig(2, "channel", "auto", True, tile=G)).template(D).nbytes
    for bad in (0.0, 1.5, -0.2):
        with pytest.raises(ValueError, match="clip"):
            AffineQuantizer(AffineConfig(2, "token", clip=bad))


def test_in_a_model(seed: int) -> None:
    """The registered kvarn-auto-k2v2-g128-qar-clip in a 2-layer model: packed (fused) reads match reference reads
    (1e-3 relative, as tests/integrations/test_transformers.py), and the first layer's stored tiles have 0.8x the row
    scales of `-qar`'s on the same inputs (where both chose the same basis: VarN's scales precede the clip; fp16
    rounding of both, 2^-10 each)."""
    from kvarn.integrations.transformers import KVarNCache
    from kvarn.presets import get_preset
    from kvarn.presets.family import CLIP_2BIT
    from tests.helpers import close, forward_steps, make_tiny_model

    model = make_tiny_model("llama", head_dim=64)
    ids = torch.randint(3, 256, (1, 158), generator=torch.Generator().manual_seed(seed))
    preset = get_preset("kvarn-auto-k2v2-g128-qar-clip")
    ref = forward_steps(model, ids, KVarNCache(model.config, preset, sink=8, attention="reference"), [150, 5, 1])
    cache = KVarNCache(model.config, preset, sink=8)
    got = forward_steps(model, ids, cache, [150, 5, 1])
    assert close(got, ref, rel=1e-3), f"max diff {(got - ref).abs().max()}"
    plain = KVarNCache(model.config, get_preset("kvarn-auto-k2v2-g128-qar"), sink=8)
    forward_steps(model, ids, plain, [150, 5, 1])
    compared = 0
    for kind in ("keys", "values"):
        a, b = (getattr(c.layers[0].store, kind).packed for c in (cache, plain))
        same = (a.rotated == b.rotated).reshape(-1)
        ra, rb = (p.row_scale.reshape(len(same), -1)[same].double() for p in (a, b))
        assert torch.allclose(ra, CLIP_2BIT * rb, rtol=3e-3, atol=0), kind
        compared += int(same.sum())
    assert compared >= 1
