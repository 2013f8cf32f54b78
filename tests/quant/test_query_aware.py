"""Query-aware rounding of keys (issue 20's lever: `kvarn.ops.rtn.query_aware_round`,
`kvarn.quant.affine.QueryAwareQuantizer`, `kvarn.quant.policy.QueryCovariance`; the `-qar` presets of
`kvarn.presets.family`).

Checked: its unrounded codes are RTN's bit for bit; a diagonal Sigma gives nearest rounding bit for bit; the codes
equal a float64 OBQ reference (tests/reference/query_aware.py) and lower r^T H r against nearest rounding; the
quantizer keeps every field but the codes, equals `AffineQuantizer` without a covariance (or with the identity),
lowers the logit error e^T Sigma e of real decodes in each basis; the fused CPU store kernel's fields equal the
reference's bit for bit (every rotation, with and without VarN, 2/3/4 bits, bf16 input, non-finite tiles); the cache
feeds it the running E[q q^T] of each KV head.
"""

from __future__ import annotations

import pytest
import torch

from kvarn.cache.store import LayerStore
from kvarn.kernels.cpu.build import load
from kvarn.ops.rtn import query_aware_coefficients, query_aware_round, rtn_quantize, rtn_targets
from kvarn.presets import get_preset
from kvarn.quant.affine import AffineConfig, AffineQuantizer, QueryAwareQuantizer
from kvarn.quant.policy import QueryCovariance, QueryEnergy
from tests.reference.query_aware import hessian, query_aware_tile

G, D = 128, 64
COL = torch.float8_e4m3fn  # kvarn-auto's relative column scales


def correlated_sigma(n: int, d: int, gen: torch.Generator, rank: int = 8) -> torch.Tensor:
    """[n, d, d] second moments with strong off-diagonal structure (a few dominant query directions) plus a floor."""
    a = torch.randn(n, d, rank, generator=gen, dtype=torch.float64)
    return a @ a.transpose(-1, -2) + 0.05 * torch.eye(d, dtype=torch.float64)


def form(r: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """sum over columns of r^T H r: r [N, R, C], H [N, R, R] -> [N] (float64)."""
    r = r.double()
    return torch.einsum("nrc,nrs,nsc->n", r, h.double(), r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_targets_round_to_rtn_codes(dtype: torch.dtype, bits: int) -> None:
    x = torch.randn(5, 16, 40, dtype=dtype) * torch.rand(5, 16, 1, dtype=dtype) * 4
    u, delta, lo = rtn_targets(x, bits)
    q, d2, l2 = rtn_quantize(x, bits)
    assert torch.equal(torch.round(u).clamp(0, 2**bits - 1).to(torch.uint8), q)
    assert torch.equal(delta, d2) and torch.equal(lo, l2)


def qa_round(u: torch.Tensor, sigma: torch.Tensor, step: torch.Tensor, bits: int) -> torch.Tensor:
    return query_aware_round(u, query_aware_coefficients(sigma), step, bits)


@pytest.mark.parametrize("bits", [2, 4])
def test_diagonal_sigma_is_nearest_rounding(bits: int) -> None:
    x = torch.randn(6, D, G)
    u, delta, _ = rtn_targets(x, bits)
    q, _, _ = rtn_quantize(x, bits)
    step = delta.squeeze(-1)
    eye = torch.eye(D).expand(6, D, D)
    assert torch.equal(qa_round(u, eye, step, bits), q)
    diag = torch.diag_embed(torch.rand(6, D) + 0.1)  # any diagonal: no coupling, nothing to push
    assert torch.equal(qa_round(u, diag, step, bits), q)
    assert torch.equal(qa_round(u, torch.zeros(6, D, D), step, bits), q)  # no query yet: the damping alone


def test_coefficients_of_repeated_matrices() -> None:
    gen = torch.Generator().manual_seed(4)
    s = correlated_sigma(3, D, gen).float()
    many = s[torch.tensor([0, 1, 0, 2, 2, 1])]
    c = query_aware_coefficients(many)
    assert c.dtype == torch.float32 and torch.equal(c, query_aware_coefficients(s)[torch.tensor([0, 1, 0, 2, 2, 1])])
    assert torch.equal(c.diagonal(dim1=-2, dim2=-1), torch.ones(6, D))
    assert torch.equal(c.tril(-1), torch.zeros(6, D, D))


def test_non_finite_or_indefinite_sigma_rounds_to_nearest() -> None:
    """A Sigma with NaN/inf (a model whose queries blew up) or one that stays indefinite under the damping gives the
    identity coefficients, nearest rounding, never an error in the middle of a store; the others are unchanged."""
    gen = torch.Generator().manual_seed(6)
    good = correlated_sigma(1, D, gen)[0]
    nan, inf = good.clone(), good.clone()
    nan[3, 4] = float("nan")
    inf[0, 0] = float("inf")
    indefinite = -100 * torch.eye(D, dtype=torch.float64)  # negative definite: no damping makes it positive
    c = query_aware_coefficients(torch.stack([good, nan, inf, indefinite, good]))
    eye = torch.eye(D)
    assert all(torch.equal(c[i], eye) for i in (1, 2, 3))
    assert torch.equal(c[0], query_aware_coefficients(good[None])[0]) and torch.equal(c[4], c[0])
    assert not torch.equal(c[0], eye)


@pytest.mark.parametrize("bits", [2, 3])
def test_equals_float64_obq_reference(bits: int) -> None:
    gen = torch.Generator().manual_seed(1)
    n, r, c = 3, 16, 12
    x = torch.randn(n, r, c, generator=gen, dtype=torch.float64) * torch.rand(n, r, 1, generator=gen) * 3
    u, delta, _ = rtn_targets(x, bits)
    step = delta.squeeze(-1)  # rows of unequal steps: the coefficients' a_r / a_j matters
    s = correlated_sigma(n, r, gen, rank=3)
    q = query_aware_round(u, query_aware_coefficients(s).double(), step, bits)
    for i in range(n):
        assert torch.equal(q[i].long(), query_aware_tile(u[i], s[i], step[i], bits)), i


def test_lowers_the_quadratic_form() -> None:
    gen = torch.Generator().manual_seed(2)
    n = 16
    x = torch.randn(n, D, G, generator=gen) * torch.rand(n, D, 1, generator=gen)
    u, delta, _ = rtn_targets(x, 2)
    q0, _, _ = rtn_quantize(x, 2)
    step = delta.squeeze(-1)
    s = correlated_sigma(n, D, gen)
    q1 = qa_round(u, s, step, 2)
    h = torch.stack([hessian(s[i], step[i]) for i in range(n)])
    e0, e1 = form(q0.double() - u.double(), h), form(q1.double() - u.double(), h)
    assert (e1 < e0).all()
    assert float(e1.sum() / e0.sum()) < 0.7  # strong correlation: a large cut, not a marginal one
    with pytest.raises(ValueError, match="coef"):
        query_aware_round(u, query_aware_coefficients(s)[:, :8, :8], step, 2)


def configs() -> list[AffineConfig]:
    return [AffineConfig(2, "channel", rot, varn, tile=G, col_scale_dtype=COL if varn else None)
            for rot in ("none", "hadamard", "auto") for varn in (False, True)]


@pytest.mark.parametrize("cfg", configs(), ids=lambda c: f"{c.rotate}-varn{int(c.varn)}")
def test_quantizer_without_covariance_is_affine(cfg: AffineConfig) -> None:
    """No weight, a query energy [N, D], or Sigma = identity: the codes of `AffineQuantizer`, bit for bit."""
    x = torch.randn(4, G, D) * torch.linspace(0.1, 4, D)
    base, qa = AffineQuantizer(cfg), QueryAwareQuantizer(cfg)
    w = torch.rand(4, D) + 0.1
    for a, b in ((base.encode_reference(x), qa.encode(x)),
                 (base.encode_reference(x, w), qa.encode(x, w)),
                 (base.encode_reference(x, torch.ones(4, D)), qa.encode(x, torch.eye(D).expand(4, D, D)))):
        ta, tb = a.tensors(), b.tensors()
        assert ta.keys() == tb.keys()
        for k in ta:
            assert torch.equal(ta[k], tb[k]), k


@pytest.mark.parametrize("cfg", configs(), ids=lambda c: f"{c.rotate}-varn{int(c.varn)}")
def test_quantizer_lowers_logit_error(cfg: AffineConfig) -> None:
    """Same scales, zero points and bytes; only the codes move, and e^T Sigma e of the decoded tile drops."""
    gen = torch.Generator().manual_seed(3)
    n = 8
    x = torch.randn(n, G, D, generator=gen) * torch.linspace(0.2, 3, D)
    sigma = correlated_sigma(n, D, gen).float()
    base, qa = AffineQuantizer(cfg), QueryAwareQuantizer(cfg)
    diag = sigma.diagonal(dim1=-2, dim2=-1)
    a, b = base.encode_reference(x, diag), qa.encode(x, sigma)
    assert a.nbytes == b.nbytes
    if cfg.rotate != "auto":  # auto may pick the other basis per tile; its scales then differ
        for k in ("row_scale", "row_zero", "col_scale"):
            va, vb = getattr(a, k), getattr(b, k)
            assert (va is None and vb is None) or torch.equal(va, vb), k
        assert not torch.equal(a.codes, b.codes)

    def err(p) -> torch.Tensor:
        e = (base.decode(p, torch.float64) - x.double()).transpose(1, 2)  # [N, D, G]
        return form(e, sigma)

    assert float(err(b).sum()) < 0.8 * float(err(a).sum())


def test_quantizer_is_keys_only() -> None:
    with pytest.raises(ValueError, match="keys"):
        QueryAwareQuantizer(AffineConfig(2, "token", "auto", True, tile=G))
    qa = QueryAwareQuantizer(AffineConfig(2, "channel", "auto", True, tile=G, col_scale_dtype=COL))
    assert qa.takes_weight and qa.takes_covariance and qa.name.endswith("-qar")
    with pytest.raises(ValueError, match="weight"):
        qa.encode(torch.randn(2, G, D), torch.ones(2, D, 3))


def kernel_configs() -> list[AffineConfig]:
    return [*configs(), AffineConfig(3, "channel", "auto", True, tile=G, col_scale_dtype=COL),
            AffineConfig(4, "channel", "auto", True, tile=G, col_scale_dtype=COL),
            AffineConfig(2, "channel", "hadamard", True, tile=64, scale_dtype=torch.bfloat16),
            AffineConfig(2, "channel", "auto", True, tile=G, col_scale_dtype=COL, clip=0.8)]


@pytest.mark.skipif(load() is None, reason="the CPU extension could not be built")
@pytest.mark.parametrize("cfg", kernel_configs(),
                         ids=lambda c: f"{c.bits}b-{c.rotate}-varn{int(c.varn)}-g{c.tile}-clip{c.clip:g}")
def test_store_kernel_equals_reference(cfg: AffineConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused CPU store rounds query-aware as the reference does: every field bit for bit, bf16 input and a
    non-finite tile (encoded as zeros, flagged) included; the kernel is the path `encode_tiles` takes. The kernel path
    also takes its coefficients from the C++ seat, the reference from LAPACK (within one float32 ulp of each other,
    tests/ops/test_seats.py): on these tiles no code moves."""
    gen = torch.Generator().manual_seed(5)
    n = 6
    x = (torch.randn(n, cfg.tile, D, generator=gen) * torch.linspace(0.2, 3, D)).to(torch.bfloat16)
    x[3, 7, 5] = float("nan")
    sigma = correlated_sigma(n, D, gen).float()
    qa = QueryAwareQuantizer(cfg)
    monkeypatch.setenv("KVARN_KERNEL", "cpu")
    got, fin, ok = qa.encode_tiles(x, sigma)
    monkeypatch.setenv("KVARN_KERNEL", "torch")
    want, fin_r, ok_r = qa.encode_tiles(x, sigma)
    assert torch.equal(fin, fin_r) and torch.equal(ok, ok_r) and not bool(fin[3])
    tg, tw = got.tensors(), want.tensors()
    assert tg.keys() == tw.keys()
    for k in tw:
        assert torch.equal(tg[k], tw[k]), k
    plain = AffineQuantizer(cfg).encode_reference(x.float(), sigma.diagonal(dim1=-2, dim2=-1))
    assert not torch.equal(got.codes, plain.codes)  # the kernel did round query-aware


def test_query_covariance_statistics() -> None:
    q = torch.randn(2, 6, 9, D)  # 6 query heads over 2 KV heads
    e, c = QueryEnergy(), QueryCovariance()
    for part in (q[:, :, :4], q[:, :, 4:]):
        e.update(part, 2)
        c.update(part, 2)
    assert c.count == e.count
    torch.testing.assert_close(c.weight(), e.weight())
    g = q.double().reshape(2, 2, 27, D)
    torch.testing.assert_close(c.covariance().double(), g.transpose(-1, -2) @ g / 27, rtol=1e-5, atol=1e-6)
    assert c.sum.shape == (2, 2, D * (D + 1) // 2)  # held as the upper triangle
    torch.testing.assert_close(QueryCovariance.unpack(QueryCovariance.pack(c.covariance())), c.covariance(), rtol=0,
                               atol=0)
    with pytest.raises(ValueError, match="do not match"):
        c.update(torch.randn(2, 6, 1, D // 2), 2)
    c.index_batch(torch.tensor([1, 1, 0]))
    assert c.covariance().shape == (3, 2, D, D)
    assert QueryCovariance().covariance() is None


def test_store_feeds_the_covariance() -> None:
    """A LayerStore over the variant keeps E[q q^T] and its key tiles get it ([B, H, D, D] -> one per tile); the
    registered presets keep `QueryEnergy`."""
    base = get_preset("kvarn-auto-k2v2-g128")
    qa_preset = base.replace(name="qar", key=lambda d: QueryAwareQuantizer(base.key(d).config))
    st, ref = LayerStore.from_preset(qa_preset, D), LayerStore.from_preset(base, D)
    assert type(st.queries) is QueryCovariance and type(ref.queries) is QueryEnergy
    seen = []
    encode = QueryAwareQuantizer.encode_tiles

    def spy(self, x, weight=None):
        seen.append(None if weight is None else tuple(weight.shape))
        return encode(self, x, weight)

    k, v = torch.randn(2, 2, 2 * G + 3, D), torch.randn(2, 2, 2 * G + 3, D)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(QueryAwareQuantizer, "encode_tiles", spy)
        st.append(k, v, defer_keys=True)
        st.observe_queries(torch.randn(2, 14, 2 * G + 3, D))
    assert seen == [(2 * 2 * 1, D, D)]  # sink 128, then one tile per (row, head)
    assert st.keys.n_tiles == 1
    assert st.nbytes().policy == 2 * 2 * D * (D + 1) // 2 * 4  # the upper triangle, float32


@pytest.mark.parametrize("name", ["kvarn-auto-k2v2-g64-qar", "kvarn-b3.0-qar"])
def test_registered_presets_in_a_model(name: str, tmp_path, monkeypatch: pytest.MonkeyPatch, seed) -> None:
    """The registered query-aware presets in a 2-layer model: packed reads match reference reads (1e-3 relative, as
    tests/integrations/test_transformers.py), the fused store stores the PyTorch store's key tiles bit for bit, and a
    saved cache restores E[q q^T] bit for bit and continues as the original."""
    from kvarn.integrations.serialize import load_cache, save_cache
    from kvarn.integrations.transformers import KVarNCache
    from tests.helpers import close, forward_steps, make_tiny_model

    model = make_tiny_model("llama", head_dim=64)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 256, (1, 158), generator=gen)
    preset = get_preset(name)
    assert preset.params["rounding"] == "query-aware" and name.endswith("-qar")
    ref = forward_steps(model, ids, KVarNCache(model.config, preset, sink=8, attention="reference"), [150, 5, 1])
    cache = KVarNCache(model.config, preset, sink=8)
    got = forward_steps(model, ids, cache, [150, 5, 1])
    assert close(got, ref, rel=1e-3), f"max diff {(got - ref).abs().max()}"
    monkeypatch.setenv("KVARN_KERNEL", "torch")
    slow = KVarNCache(model.config, preset, sink=8)
    forward_steps(model, ids, slow, [150, 5, 1])
    monkeypatch.delenv("KVARN_KERNEL")
    for a, b in zip(cache.layers, slow.layers, strict=True):
        assert a.store.keys.n_tiles >= 1
        ta, tb = a.store.keys.packed.tensors(), b.store.keys.packed.tensors()
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    sigma = [layer.store.queries.covariance() for layer in cache.layers]
    assert all(s is not None and s.shape[-2:] == (64, 64) for s in sigma)
    save_cache(cache, tmp_path / "c.safetensors")
    back = load_cache(tmp_path / "c.safetensors", model.config, preset=preset)
    for s, b in zip(sigma, [layer.store.queries.covariance() for layer in back.layers], strict=True):
        assert torch.equal(s, b)
    more = ids[:, 156:]
    assert torch.equal(forward_steps(model, more, cache, [1, 1]), forward_steps(model, more, back, [1, 1]))
