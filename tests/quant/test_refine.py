"""Refined key channels (issue 20: `AffineConfig.refine`; `kvarn.presets.family.channel_budget_preset`, the lab's
`kvarn-c{bits}` presets of scripts/budget_variants.py).

Checked: codes, stored scales, the refined rows and the reconstruction against the float64 tile oracle
(tests/reference/affine.py) with and without VarN and the rotation; the rows chosen are the largest w_r a_r^2 of the
plain basis (weight 1 in the rotated one); query-aware rounding with per-row grids equals the float64 OBQ reference
on each row's own grid; refinement lowers the error it targets; the presets fit their budgets in stored bytes; the
packed read path (scales folded into the query) equals decode-then-matmul; the kernels and the vLLM plugin refuse
the format by name; in a model, packed reads match reference reads and a saved cache continues as the original.
"""

from __future__ import annotations

import pytest
import torch

from kvarn.ops.rtn import query_aware_coefficients, query_aware_round, rtn_targets
from kvarn.presets.family import channel_budget_preset
from kvarn.quant.affine import AffineConfig, AffineQuantizer, QueryAwareQuantizer, refined_rows
from tests.helpers import check_against_reference, check_in_a_model, check_packed_key_logits
from tests.reference.query_aware import hessian, query_aware_column

G, D = 128, 64
COL = torch.float8_e4m3fn


def cfg(rotate: str = "none", varn: bool = True, refine: float = 0.25, bits: int = 2, col: torch.dtype | None = COL
        ) -> AffineConfig:
    return AffineConfig(bits, "channel", rotate, varn, tile=G, refine=refine, col_scale_dtype=col if varn else None)


@pytest.mark.parametrize("rotate", ["none", "hadamard"])
@pytest.mark.parametrize("varn", [False, True])
@pytest.mark.parametrize("bits", [1, 2])
def test_against_float64_oracle(rotate: str, varn: bool, bits: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, G, D, generator=gen) * torch.rand(1, 1, D, generator=gen) * 3
    # fp16 column scales: the oracle's VarN has no 8-bit relative column scales (kvarn-auto's), which move B
    check_against_reference(AffineQuantizer(cfg(rotate, varn, bits=bits, col=None)), x)


def test_rows_are_the_largest_weighted_errors() -> None:
    step = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.5]])
    assert refined_rows(step, None, 2).tolist() == [[1, 2]]  # 9 > 4 = 4: the tie goes to the lower row
    w = torch.tensor([[10.0, 0.1, 1.0, 1.0, 100.0]])
    assert refined_rows(step, w, 2).tolist() == [[0, 4]]  # 10, 25 beat 4
    assert refined_rows(torch.tensor([[float("nan"), 1.0, 2.0]]), None, 1).tolist() == [[2]]


def test_selection_uses_the_plain_basis_weight() -> None:
    """The same tiles with a weight on channels 0-7: the plain encoding refines those channels, the rotated one
    ignores the weight (it is not in the rotated basis)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, G, D, generator=gen)
    w = torch.full((2, D), 1e-3)
    w[:, :8] = 1e3
    k = AffineQuantizer(cfg("none")).refine_count(D)
    plain = AffineQuantizer(cfg("none")).encode_reference(x, w)
    assert plain.refine_rows[:, :8].tolist() == [list(range(8))] * 2 and k == 16
    rot = AffineQuantizer(cfg("hadamard"))
    assert torch.equal(rot.encode_reference(x, w).refine_rows, rot.encode_reference(x).refine_rows)


def test_refinement_lowers_the_error() -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(8, G, D, generator=gen) * torch.linspace(0.2, 4.0, D)
    errors = []
    for share in (0.0, 0.25, 0.5):
        q = AffineQuantizer(cfg("none", refine=share))
        errors.append(float((q.decode(q.encode(x)) - x).square().sum()))
    assert errors[0] > 1.5 * errors[1] and errors[1] > 1.2 * errors[2]  # more refined channels, less error


@pytest.mark.parametrize("rows", [3, 8])
def test_query_aware_rows_of_two_grids_equal_obq_reference(rows: int) -> None:
    """query_aware_round with row_levels: each row clamped to its own grid, the float64 OBQ reference rounding each
    row at its width (the reference's column rounding, levels per row)."""
    gen = torch.Generator().manual_seed(rows)
    n, c = 2, 10
    x = torch.randn(n, rows, c, generator=gen, dtype=torch.float64)
    u2, d2, _ = rtn_targets(x, 2)
    u4, d4, _ = rtn_targets(x, 4)
    fine = torch.zeros(n, rows, dtype=torch.bool)
    fine[:, ::2] = True
    u = torch.where(fine[..., None], u4, u2)
    step = torch.where(fine, d4.squeeze(-1), d2.squeeze(-1))
    levels = torch.where(fine, 15, 3)
    a = torch.randn(n, rows, 3, generator=gen, dtype=torch.float64)
    sigma = a @ a.transpose(-1, -2) + 0.05 * torch.eye(rows, dtype=torch.float64)
    got = query_aware_round(u, query_aware_coefficients(sigma).double(), step, 2, levels)
    for i in range(n):
        h = hessian(sigma[i], step[i])
        want = [query_aware_column(u[i, :, j].tolist(), h, levels[i].tolist()) for j in range(c)]
        assert got[i].long().T.tolist() == want, i
    with pytest.raises(ValueError, match="row_levels"):
        query_aware_round(u, query_aware_coefficients(sigma).double(), step, 2, levels[:, :2])


def test_query_aware_refined_quantizer() -> None:
    """Same refined rows and scales as nearest rounding; the codes lower the logit error e^T Sigma e."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(4, G, D, generator=gen) * torch.linspace(0.3, 3.0, D)
    a = torch.randn(4, D, 6, generator=gen)
    sigma = a @ a.transpose(-1, -2) + 0.05 * torch.eye(D)
    qa, near = QueryAwareQuantizer(cfg("none")), AffineQuantizer(cfg("none"))
    pa, pn = qa.encode(x, sigma), near.encode(x, sigma.diagonal(dim1=-2, dim2=-1))
    assert torch.equal(pa.refine_rows, pn.refine_rows) and torch.equal(pa.row_scale, pn.row_scale)

    def logit_error(p) -> float:
        e = qa.decode(p) - x
        return float(torch.einsum("ngd,nde,nge->", e, sigma, e))

    assert logit_error(pa) < 0.8 * logit_error(pn)


@pytest.mark.parametrize("budget,rounding", [(2.5, "nearest"), (3.0, "query-aware")])
def test_presets_fit_their_budget(budget: float, rounding: str) -> None:
    p = channel_budget_preset(budget, rounding=rounding)
    k, v = p.quantizers(128)
    x = torch.randn(2, G, 128)
    measured = (k.encode(x).nbytes + v.encode(x).nbytes) * 8 / (2 * x.numel())
    assert measured == (k.bits_per_element(128) + v.bits_per_element(128)) / 2
    assert budget - 0.05 < measured <= budget  # the budget spent, not exceeded
    more = AffineQuantizer(AffineConfig(**{**k.config.__dict__, "refine": k.config.refine + 1 / 128}))
    assert (more.bits_per_element(128) + v.bits_per_element(128)) / 2 > budget  # one channel more would not fit
    assert k.format(64).refine == int(k.config.refine * 64)


def test_packed_read_equals_decoded_matmul() -> None:
    """The read path that folds scales into the query (`kvarn.attention.packed`) merges the refined rows as decode
    does: logits of packed tiles equal q @ decode(K)^T (rotation chosen per tile)."""
    check_packed_key_logits(AffineQuantizer(cfg("auto")))


def test_kernels_and_vllm_refuse_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvarn.attention.fused import unsupported_quantizers
    from kvarn.integrations.vllm.config import check_preset

    p = channel_budget_preset(2.5, rounding="query-aware")
    k, v = p.quantizers(64)
    assert "refined channels" in unsupported_quantizers(k, v)
    monkeypatch.setenv("KVARN_KERNEL", "cpu")
    with pytest.raises(Exception, match="refined channels"):
        k.encode(torch.randn(1, G, 64))
    with pytest.raises(ValueError, match="refined key channels"):
        check_preset(p)
    with pytest.raises(ValueError, match="refine"):
        AffineQuantizer(AffineConfig(2, "token", refine=0.25))
    with pytest.raises(ValueError, match="bit width 5"):
        AffineQuantizer(AffineConfig(3, "channel", refine=0.25))


def test_in_a_model(tmp_path, seed: int) -> None:
    """kvarn-c2.5-qar in a 2-layer model: packed reads match reference reads (1e-3 relative, as
    tests/integrations/test_transformers.py), the bytes held are the format's, and a saved cache continues as the
    original."""
    check_in_a_model(channel_budget_preset(2.5, rounding="query-aware"), tmp_path, seed, "refine_rows")
