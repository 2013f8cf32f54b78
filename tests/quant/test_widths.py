"""Key channels at their own widths (issue 20: `kvarn.ops.widths`, `AffineConfig.widths`, the `kvarn-w{bits}`
presets; docs/TASKS.md, "Bits spread over a key tile's channels").

Checked: the allocation against brute force and a float64 dynamic program written anew; the row packing against the
bit-by-bit reference reader; widths, clips, codes, stored scales and the reconstruction against the float64 oracle
(tests/reference/widths.py) in both bases; query-aware rounding keeps the widths and scales and lowers the logit error;
the presets fit their budgets in stored bytes; the packed read path equals decode-then-matmul (the fused CPU decode
kernel: tests/kernels/test_cpu_decode.py; the C++ store: tests/kernels/test_cpu_store.py; the vLLM pages:
tests/integrations/vllm/test_paged.py); which kernels serve the format and which refuse it by name; in a model,
packed reads match reference reads, the bytes held are the format's and a saved cache continues as the original.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from kvarn.ops.hadamard import hadamard_transform
from kvarn.ops.rtn import rtn_targets
from kvarn.ops.widths import (
    CLIPS,
    MAX_WIDTH,
    allocate_widths,
    pack_rows,
    pack_widths,
    unpack_rows,
    unpack_widths,
    width_targets,
)
from kvarn.presets import get_preset
from kvarn.presets.family import widths_preset
from kvarn.quant.affine import AffineConfig, AffineQuantizer, QueryAwareQuantizer
from kvarn.quant.tiles import AffineFormat
from tests.helpers import check_in_a_model, check_packed_key_logits
from tests.reference import widths as ref
from tests.reference.affine import reconstruct_ref
from tests.reference.packing import unpack_row
from tests.reference.rtn import rtn_row
from tests.tolerances import FP16_ETA, FP16_U

G, D = 128, 64
MEAN = 2.34375  # kvarn-w2.5's mean key width


def cfg(rotate: str = "none", mean: float = MEAN) -> AffineConfig:
    return AffineConfig(MAX_WIDTH, "channel", rotate, True, tile=G, col_scale_dtype=torch.float8_e4m3fn, widths=mean)


def test_allocation_is_the_brute_force_optimum() -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(40):
        # errors not convex in the width (a first bit that buys little), which a greedy allocation gets wrong
        err = torch.rand(3, 4, 5, generator=g, dtype=torch.float64).sort(-1, descending=True).values
        err = err * torch.rand(3, 4, 1, generator=g, dtype=torch.float64) * 10
        w = allocate_widths(err, 8)
        assert (w.sum(-1) == 8).all() and w.min() >= 0 and w.max() <= 4
        for n in range(3):
            best = min(sum(float(err[n, r, c[r]]) for r in range(4))
                       for c in itertools.product(range(5), repeat=4) if sum(c) == 8)
            got = sum(float(err[n, r, w[n, r]]) for r in range(4))
            assert got == pytest.approx(best, rel=1e-12, abs=1e-12)
    with pytest.raises(ValueError, match="cannot be spread"):
        allocate_widths(err, 17)


def test_allocation_equals_the_reference_program(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    err = torch.rand(2, 24, 5, generator=g, dtype=torch.float64).sort(-1, descending=True).values
    err = err * torch.rand(2, 24, 1, generator=g, dtype=torch.float64).square() * 100
    w = allocate_widths(err, 50)
    for n in range(2):
        want, least = ref.allocate(err[n].tolist(), 50)
        assert w[n].tolist() == want
        assert float(err[n].gather(1, w[n, :, None]).sum()) == pytest.approx(least, rel=1e-12)


@pytest.mark.parametrize("cols", [64, 128])
def test_rows_packed_at_their_widths(cols: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    n, r, total = 3, 16, 37
    widths = torch.zeros(n, r, dtype=torch.long)
    for i in range(n):  # random widths summing to at most total (the last tile: fewer, as a zeroed tile's)
        left = total if i < n - 1 else 20
        for j in torch.randperm(r, generator=g).tolist():
            widths[i, j] = w = min(int(torch.randint(0, MAX_WIDTH + 1, (1,), generator=g)), left)
            left -= w
    codes = (torch.rand(n, r, cols, generator=g) * (1 << widths)[..., None]).floor().to(torch.uint8)
    packed = pack_rows(codes, widths, total)
    assert packed.shape == (n, total * cols // 8)
    for i in range(n):
        assert ref.unpack_rows(packed[i].tolist(), widths[i].tolist(), cols) == codes[i].tolist()
    assert torch.equal(unpack_rows(packed, widths, cols), codes)
    assert torch.equal(unpack_rows(packed.view(1, n, -1), widths.view(1, n, r), cols, torch.float32),
                       codes.view(1, n, r, cols).float())
    stored = pack_widths(widths)
    assert stored.shape == (n, 3 * r // 8) and torch.equal(unpack_widths(stored), widths)
    assert [unpack_row(row, 3) for row in stored.tolist()] == widths.tolist()
    with pytest.raises(ValueError, match="sum past"):
        pack_rows(codes, widths + 1, total)


def _weighted_error(table: list[list[tuple[float, float | None]]], widths: list[int]) -> float:
    return sum(table[r][w][0] for r, w in enumerate(widths))


@pytest.mark.parametrize("rotate", ["none", "hadamard"])
def test_against_float64_oracle(rotate: str, seed: int) -> None:
    """Widths, clips, codes and stored scales against the float64 oracle on the library's balanced rows (VarN has its
    own oracle tests), the reconstruction formula with the stored fields. The rotated basis weighs every row 1."""
    gen = torch.Generator().manual_seed(seed)
    n = 2
    x = torch.randn(n, G, D, generator=gen) * torch.linspace(0.2, 3.0, D) + torch.randn(1, 1, D, generator=gen)
    weight = torch.rand(n, D, generator=gen) * 4 + 0.01
    q = AffineQuantizer(cfg(rotate))
    p = q.encode(x, weight)
    w = x.double() if rotate == "none" else hadamard_transform(x.double())
    b, s_col, s_row = q._normalized(w.float().transpose(-1, -2))
    widths = unpack_widths(p.row_widths)
    assert (widths.sum(-1) == round(MEAN * D)).all()
    dec = q.decode(p, torch.float64)
    for i in range(n):
        bi, sc, sr = b[i].double().tolist(), s_col[i].double().tolist(), s_row[i].double().tolist()
        gain = weight[i].double().tolist() if rotate == "none" else [1.0] * D
        table = ref.width_table(bi, sc, sr, gain, CLIPS, MAX_WIDTH)
        want, least = ref.allocate([[e for e, _ in row] for row in table], round(MEAN * D))
        got = widths[i].tolist()
        # float32 against float64 errors: only allocations within 1e-5 of the least may swap
        assert _weighted_error(table, got) <= least * (1 + 1e-5)
        assert sum(a != c for a, c in zip(got, want)) <= 2
        codes = ref.unpack_rows(p.codes[i].tolist(), got, G)
        a, z = p.row_scale[i].double(), p.row_zero[i].double()
        mismatches = 0
        for r, wr in enumerate(got):
            if wr == 0:
                want_codes, step, lo = [0] * G, max(bi[r]) - min(bi[r]), sum(bi[r]) / G
                positions = [0.0] * G
            else:
                want_codes, step, lo, positions = rtn_row(bi[r], wr, table[r][wr][1])
            for c, (gc, wc) in enumerate(zip(codes[r], want_codes)):
                if gc != wc:  # float32 positions on a half step may round the other way
                    pos = positions[c]
                    assert abs(gc - wc) == 1 and abs(pos - math.floor(pos) - 0.5) < 1e-3, (i, r, c, pos)
                    mismatches += 1
            tol = 2 * FP16_U + 1e-5
            assert abs(a[r] - step * sr[r]) <= abs(step * sr[r]) * tol + FP16_ETA, (i, r)
            assert abs(z[r] - lo * sr[r]) <= abs(lo * sr[r]) * tol + FP16_ETA, (i, r)
        assert mismatches <= G * D // 100
        recon = reconstruct_ref(codes, a.tolist(), z.tolist(), p.col_scale[i].double().tolist(), "channel",
                                rotate == "hadamard")
        assert torch.allclose(dec[i], recon, rtol=1e-5, atol=1e-5 * recon.abs().max().item())


def test_query_aware_keeps_widths_and_lowers_the_logit_error() -> None:
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(4, G, D, generator=gen) * torch.linspace(0.3, 3.0, D)
    a = torch.randn(4, D, 6, generator=gen)
    sigma = a @ a.transpose(-1, -2) + 0.05 * torch.eye(D)
    qa, near = QueryAwareQuantizer(cfg()), AffineQuantizer(cfg())
    pa, pn = qa.encode(x, sigma), near.encode(x, sigma.diagonal(dim1=-2, dim2=-1))
    assert torch.equal(pa.row_widths, pn.row_widths) and torch.equal(pa.row_scale, pn.row_scale)

    def logit_error(p) -> float:
        e = qa.decode(p) - x
        return float(torch.einsum("ngd,nde,nge->", e, sigma, e))

    assert logit_error(pa) < 0.8 * logit_error(pn)


def test_widths_follow_the_query_energy() -> None:
    """The channels the queries weigh most get the most bits; a uniform weight spreads them by the keys alone."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, G, D, generator=gen)
    w = torch.full((2, D), 1e-3)
    w[:, :8] = 1e3
    widths = unpack_widths(AffineQuantizer(cfg()).encode(x, w).row_widths)
    assert (widths[:, :8] == MAX_WIDTH).all() and widths[:, 8:].float().mean() < MEAN


@pytest.mark.parametrize("budget", [2.5, 3.0])
def test_presets_fit_their_budget(budget: float) -> None:
    p = get_preset(f"kvarn-w{budget}")
    k, v = p.quantizers(128)
    x = torch.randn(2, G, 128)
    measured = (k.encode(x).nbytes + v.encode(x).nbytes) * 8 / (2 * x.numel())
    assert measured == (k.bits_per_element(128) + v.bits_per_element(128)) / 2
    assert budget - 0.05 < measured <= budget  # the budget spent, not exceeded
    more = AffineQuantizer(AffineConfig(**{**k.config.__dict__, "widths": k.config.widths + 1 / 128}))
    assert (more.bits_per_element(128) + v.bits_per_element(128)) / 2 > budget  # one bit a column more would not fit
    assert k.format(64).widths == round(k.config.widths * 64)
    # the stored bytes: the 2-bit tile's, plus (mean - 2) bits of codes and 3 bits a row for the widths
    two = get_preset("kvarn-auto-k2v2-g128-qar-clip").key(128)
    assert k.bits_per_element(128) == pytest.approx(two.bits_per_element(128) + k.config.widths - 2 + 3 / G)


def test_widths_beat_two_bits_at_the_same_mean() -> None:
    g = torch.Generator().manual_seed(1)
    spread = torch.linspace(0.1, 3.0, D)
    x = torch.randn(4, G, D, generator=g) * spread
    sigma = torch.diag(spread).expand(4, D, D).contiguous()
    kq = widths_preset(mean=2.0).key(D)
    base = get_preset("kvarn-auto-k2v2-g128-qar-clip").key(D)
    err = (kq.decode(kq.encode(x, sigma)) - x).square().sum()
    assert err < 0.8 * (base.decode(base.encode(x, sigma)) - x).square().sum()


def test_clip_sets_per_width() -> None:
    """width_targets' clips argument: the library's sets given explicitly change nothing; one clip per width puts every
    row of that width on rtn_targets' grid at that clip, and a wider set at a width never errs more there."""
    g = torch.Generator().manual_seed(2)
    b = torch.randn(3, D, G, generator=g)
    s_col = torch.rand(3, G, generator=g) + 0.5
    s_row = torch.logspace(-1.5, 1.0, D)[torch.randperm(D, generator=g)].expand(3, D)  # rows at every width
    total = round(MEAN * D)
    base = width_targets(b, s_col, s_row, None, total)
    for x, y in zip(base, width_targets(b, s_col, s_row, None, total, (CLIPS,) * MAX_WIDTH)):
        assert torch.equal(x, y)
    one = (0.45, 0.6, 0.85, 1.0)
    u, delta, lo, _, w = width_targets(b, s_col, s_row, None, total, tuple((c,) for c in one))
    for bits, c in enumerate(one, 1):
        rows = w == bits
        assert rows.any()
        t = rtn_targets(b, bits, c)
        assert torch.equal(delta[rows], t[1][rows]) and torch.equal(lo[rows], t[2][rows])
        assert torch.equal(u[rows], t[0][rows])

    wt = s_row[..., None].square() * s_col[..., None, :].square()

    def grid_error(c: float) -> torch.Tensor:  # each row's error on the 1-bit grid at clip c
        t = rtn_targets(b, 1, c)
        return ((torch.round(t[0]).clamp(0, 1) * t[1] + t[2] - b).square() * wt).sum(-1)

    u, delta, lo, _, w = width_targets(b, s_col, s_row, None, total, ((0.1, 0.2, 0.3, *CLIPS),) + (CLIPS,) * 3)
    rows = w == 1
    assert rows.any()
    chosen = ((torch.round(u).clamp(0, 1) * delta + lo - b).square() * wt).sum(-1)
    best_default = torch.stack([grid_error(c) for c in CLIPS]).amin(0)
    assert (chosen[rows] <= best_default[rows]).all() and (chosen[rows] < best_default[rows]).any()


def test_packed_read_equals_decoded_matmul() -> None:
    """The read path that folds scales into the query (`kvarn.attention.packed`) reads rows at their widths as
    decode does: logits of packed tiles equal q @ decode(K)^T (rotation chosen per tile)."""
    check_packed_key_logits(AffineQuantizer(cfg("auto")))


def test_which_kernels_serve_the_format(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvarn.attention.fused import unsupported_quantizers
    from kvarn.integrations.vllm.config import check_preset
    from kvarn.quant.affine import decode_kernel

    p = get_preset("kvarn-w2.5")
    k, v = p.quantizers(64)
    assert unsupported_quantizers(k, v) is None  # the CPU decode kernel reads rows at their widths
    monkeypatch.setenv("KVARN_KERNEL", "cpu")
    tiles = k.encode(torch.randn(1, G, 64))  # the C++ store encodes them (tests/kernels/test_cpu_store.py)
    with pytest.raises(Exception, match="own widths"):
        decode_kernel(tiles, torch.float32)
    mse = QueryAwareQuantizer(k.config, "mse")
    with pytest.raises(Exception, match="row widths with a rotation policy"):
        mse.encode(torch.randn(1, G, 64), torch.rand(1, 64))
    check_preset(p)  # the plugin serves them (tests/integrations/vllm/test_paged.py)
    with pytest.raises(ValueError, match="row widths"):
        AffineQuantizer(AffineConfig(2, "channel", widths=2.0))
    with pytest.raises(ValueError, match="row widths"):
        AffineQuantizer(AffineConfig(4, "token", widths=2.0))
    with pytest.raises(ValueError, match="row widths"):
        AffineQuantizer(AffineConfig(4, "channel", varn=False, widths=2.0))
    with pytest.raises(ValueError, match="row widths"):
        AffineFormat(4, "channel", "none", G, 60, torch.float16, torch.float16, None, widths=120)
    with pytest.raises(ValueError, match="a budget"):
        widths_preset()


def test_in_a_model(tmp_path, seed: int) -> None:
    """kvarn-w2.5 in a 2-layer model: packed reads match reference reads (1e-3 relative, as
    tests/integrations/test_transformers.py), the bytes held are the format's, and a saved cache continues as the
    original."""
    check_in_a_model(get_preset("kvarn-w2.5"), tmp_path, seed, "row_widths")
