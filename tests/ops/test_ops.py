"""kvarn.ops against the plain float64 references in tests/reference (docs/SPEC.md §3 steps 1, 3, 4, 6)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvarn.ops import hadamard_matrix, hadamard_transform, imbalance, pack_codes, rtn_quantize, unpack_codes, varn
from kvarn.ops.hadamard import hadamard_blocks
from kvarn.ops.rtn import rtn_dequantize
from tests.reference.data import heavy_tailed, real_tiles
from tests.reference.hadamard import hadamard_reference, power_of_two_parts, sylvester
from tests.reference.packing import pack_row, unpack_row
from tests.reference.rtn import rtn_row
from tests.reference.varn import imbalance_ref, matching_candidate, varn_ref

POW2 = [1, 2, 4, 8, 16, 32, 64, 128, 256]
FALLBACK = [80, 96, 112, 160, 192]

# --- Hadamard ---------------------------------------------------------------------------------------------


def test_reference_sylvester_is_a_hadamard_matrix():
    # the oracle itself: entries +-1/sqrt(n) and orthonormal, so a mistake in it cannot hide a mistake in kvarn
    for n in POW2:
        h = sylvester(n)
        assert torch.equal(h.abs() * math.sqrt(n), torch.ones(n, n, dtype=torch.float64))
        assert torch.allclose(h @ h.T, torch.eye(n, dtype=torch.float64), atol=1e-12, rtol=0)


@pytest.mark.parametrize("d", POW2 + FALLBACK)
def test_hadamard_matrix_equals_dense_sylvester_reference(d):
    h = hadamard_matrix(d)
    ref = hadamard_reference(d)
    assert hadamard_blocks(d) == power_of_two_parts(d)
    assert (h - ref).abs().max().item() < 1e-12
    eye = torch.eye(d, dtype=torch.float64)
    assert (h @ h.T - eye).abs().max().item() < 1e-12  # orthonormal
    assert (h - h.T).abs().max().item() < 1e-12  # symmetric, hence self-inverse
    assert (h @ h - eye).abs().max().item() < 1e-12


@pytest.mark.parametrize("d", POW2 + FALLBACK)
def test_hadamard_transform_matches_reference_and_inverts(d, seed, device):
    g = torch.Generator().manual_seed(seed)
    x = heavy_tailed(3, 5, d, generator=g)
    ref = x @ hadamard_reference(d)
    y = hadamard_transform(x.to(device)).cpu()
    scale = x.abs().max().item()
    assert y.dtype == torch.float64 and y.shape == x.shape
    assert (y - ref).abs().max().item() < 1e-12 * scale
    assert (hadamard_transform(y) - x).abs().max().item() < 1e-12 * scale
    # norms preserved per vector (orthonormal)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_hadamard_transform_low_precision_keeps_dtype(dtype, tol, seed, device):
    # low precision inputs are transformed in float32 and rounded back once: error ~ the dtype's eps
    g = torch.Generator().manual_seed(seed)
    x = heavy_tailed(4, 96, generator=g).to(dtype)
    y = hadamard_transform(x.to(device)).cpu()
    assert y.dtype == dtype
    ref = x.double() @ hadamard_reference(96)
    assert ((y.double() - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item() < tol


@pytest.mark.model
def test_hadamard_on_real_keys():
    x = real_tiles(64, "keys").double()
    y = hadamard_transform(x)
    assert (y - x @ hadamard_reference(64)).abs().max().item() < 1e-12 * x.abs().max().item()


def test_hadamard_bad_input():
    with pytest.raises(ValueError, match="floating"):
        hadamard_transform(torch.ones(4, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="head_dim must be positive"):
        hadamard_blocks(0)


# --- VarN -------------------------------------------------------------------------------------------------


def _varn_inputs(seed: int) -> list[tuple[str, torch.Tensor]]:
    """Small tiles (the reference is a Python loop) of several kinds, float64 [R, C]."""
    g = torch.Generator().manual_seed(seed)
    r, c = random.Random(seed).choice([(16, 8), (8, 32), (24, 16)])
    gauss = torch.randn(r, c, generator=g, dtype=torch.float64)
    const_row = gauss.clone()
    const_row[2] = 3.5  # std 0: the 1e-3 clamp and the 1e-8 floor
    tiny = gauss * 1e-5  # every std below 1e-3
    huge = gauss * 1e5  # every std above 1e3 and log-scales at the 10 cap
    offset = gauss + 50.0  # large offsets: std, not RMS
    return [("gauss", gauss), ("heavy", heavy_tailed(r, c, generator=g)), ("const_row", const_row),
            ("tiny", tiny), ("huge", huge), ("offset", offset)]


def _check_varn(x: torch.Tensor, iters: int, rtol: float = 1e-6, tie_rtol: float = 1e-12) -> None:
    """varn(x) against the loop reference. Scales equal the reference's best to `rtol`, or those of a
    candidate whose imbalance ties the best within `tie_rtol` (the rounding of the two implementations'
    sums): at a fixed point, consecutive iterations share B and Imb and differ only by a gauge factor
    (s_c k, s_r / k), and the `Imb <= I_best` comparison between them is decided by the last bits."""
    b, s_c, s_r = varn(x, iters)
    ref = varn_ref(x.double().tolist(), iters)
    assert b.dtype == (torch.float64 if x.dtype == torch.float64 else torch.float32)
    cand = matching_candidate(ref, s_c.double().tolist(), s_r.double().tolist(), rtol, tie_rtol)
    assert cand is not None, "scales match no tied candidate of the reference"
    _, cc, cr = cand
    want_b = x.double() / torch.tensor(cc, dtype=torch.float64) / torch.tensor(cr, dtype=torch.float64).unsqueeze(-1)
    assert torch.allclose(b.double(), want_b, rtol=rtol * 3, atol=1e-300)


@pytest.mark.parametrize("iters", [0, 1, 8, 16])
def test_varn_float64_matches_loop_reference(iters, seed):
    for _name, x in _varn_inputs(seed):
        _check_varn(x, iters)


def test_varn_batched_matches_reference_per_tile(seed):
    g = torch.Generator().manual_seed(seed)
    x = heavy_tailed(2, 3, 8, 16, generator=g)
    b, s_c, s_r = varn(x)
    assert s_c.shape == (2, 3, 16) and s_r.shape == (2, 3, 8)
    for i in range(2):
        for j in range(3):
            _check_varn(x[i, j], 8)
    assert torch.allclose(b * s_c.unsqueeze(-2) * s_r.unsqueeze(-1), x, rtol=1e-12)


@pytest.mark.model
def test_varn_on_real_keys_matches_reference():
    # a full 64 x 64 key tile (channels x tokens) of layer 1 and one of layer 28
    x = real_tiles(64, "keys").double()
    for i in (0, len(x) - 1):
        _check_varn(x[i].T.contiguous(), 8)


def test_varn_float32_close_to_reference(seed):
    # float32 statistics drift from float64 by ~1e-7 per step over 8 iterations: scales within 1e-4, and
    # near-ties of the imbalance are decided within 1e-5
    g = torch.Generator().manual_seed(seed)
    _check_varn(heavy_tailed(16, 32, generator=g).float(), 8, rtol=1e-4, tie_rtol=1e-5)


def test_imbalance_matches_reference(seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(3):
        x = heavy_tailed(12, 20, generator=g)
        assert math.isclose(imbalance(x).item(), imbalance_ref(x.tolist()), rel_tol=1e-12)
    assert math.isclose(imbalance(torch.ones(4, 4, dtype=torch.float64)).item(), 0.0)  # 0 / 1e-8 twice


def test_varn_reduces_imbalance(seed):
    g = torch.Generator().manual_seed(seed)
    x = heavy_tailed(32, 64, generator=g)
    b, _, _ = varn(x)
    assert imbalance(b) <= imbalance(x)  # best-so-far starts at Imb(X), so it never gets worse


def test_varn_bad_input():
    with pytest.raises(ValueError, match="R, C >= 2"):
        varn(torch.ones(5))
    with pytest.raises(ValueError, match="R, C >= 2"):
        varn(torch.ones(1, 4))
    with pytest.raises(ValueError, match="iters"):
        varn(torch.ones(4, 4), iters=-1)


# --- RTN --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_rtn_float64_bit_exact_against_scalar_loop(bits, seed, device):
    # float64 in both: the same three operations per element, so codes, delta and lo are identical
    g = torch.Generator().manual_seed(seed)
    x = heavy_tailed(6, 40, generator=g)
    x[1] = 2.0  # constant row: delta at the 1e-10 guard, all codes 0
    x[2, ::2] = 0.0  # exact ties are likely for some widths
    q, delta, lo = (t.cpu() for t in rtn_quantize(x.to(device), bits))
    for r, row in enumerate(x.tolist()):
        rc, rd, rl, _ = rtn_row(row, bits)
        assert q[r].tolist() == rc
        assert delta[r, 0].item() == rd and lo[r, 0].item() == rl


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_rtn_float32_codes_match_except_at_ties(bits, seed):
    # float32 computes (x - lo) / delta with a relative error of a few ulps, so a position within
    # eps = 8 * levels * float32-eps of a half-integer k + 0.5 may round either way; nowhere else.
    g = torch.Generator().manual_seed(seed)
    x = heavy_tailed(32, 64, generator=g).float()
    levels = 2**bits - 1
    eps = 8 * levels * torch.finfo(torch.float32).eps
    q, delta, _ = rtn_quantize(x, bits)
    for r, row in enumerate(x.double().tolist()):
        rc, rd, _, pos = rtn_row(row, bits)
        assert math.isclose(delta[r, 0].item(), rd, rel_tol=1e-6)
        for c, (got, want) in enumerate(zip(q[r].tolist(), rc)):
            if got != want:
                assert abs(got - want) == 1 and abs(pos[c] - math.floor(pos[c]) - 0.5) < eps, (r, c, pos[c])


def test_rtn_error_within_half_step(seed, device):
    g = torch.Generator().manual_seed(seed)
    x = heavy_tailed(16, 64, generator=g).to(device)
    for bits in (2, 4):
        q, delta, lo = rtn_quantize(x, bits)
        err = (rtn_dequantize(q, delta, lo) - x).abs()
        assert (err <= delta / 2 * (1 + 1e-12)).all()


def test_rtn_bad_bits():
    for bits in (0, 5, 16):
        with pytest.raises(ValueError, match="unsupported bit width"):
            rtn_quantize(torch.ones(2, 8), bits)


# --- packing ----------------------------------------------------------------------------------------------

PER_GROUP = {1: 8, 2: 4, 3: 8, 4: 2, 8: 1}


@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from([1, 2, 3, 4, 8]), lead=st.lists(st.integers(1, 4), min_size=0, max_size=3),
       groups=st.integers(1, 12), data=st.data())
def test_pack_roundtrip_and_reference(bits, lead, groups, data, device):
    n = groups * PER_GROUP[bits]
    seed = data.draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (*lead, n), generator=g, dtype=torch.uint8).to(device)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (*lead, n * bits // 8)
    assert torch.equal(unpack_codes(packed, bits), codes)  # bit-exact round trip
    flat_c, flat_p = codes.reshape(-1, n), packed.reshape(-1, n * bits // 8)
    for row_c, row_p in zip(flat_c.tolist(), flat_p.tolist()):
        assert row_p == pack_row(row_c, bits)
        assert unpack_row(row_p, bits) == row_c


def test_pack_bit_layout_by_hand():
    u8 = torch.uint8
    # 1 bit: codes 1,0,0,0,0,0,0,1 -> bits 0 and 7 set -> 0b1000_0001
    assert pack_codes(torch.tensor([1, 0, 0, 0, 0, 0, 0, 1], dtype=u8), 1).tolist() == [0x81]
    # 2 bits: 1 | 2 << 2 | 3 << 4 | 0 << 6 = 1 + 8 + 48 = 57 = 0x39
    assert pack_codes(torch.tensor([1, 2, 3, 0], dtype=u8), 2).tolist() == [0x39]
    # 4 bits, planes of m = 2 bytes: byte 0 holds codes 0 and 2 (0xA, 0x0 -> 0x0A), byte 1 codes 1 and 3 -> 0xF5
    assert pack_codes(torch.tensor([0xA, 0x5, 0x0, 0xF], dtype=u8), 4).tolist() == [0x0A, 0xF5]
    # 2 bits, 8 codes, m = 2: byte 0 = c0 | c2 << 2 | c4 << 4 | c6 << 6 = 1 + 12 + 0 + 128 = 0x8D,
    # byte 1 = c1 | c3 << 2 | c5 << 4 | c7 << 6 = 2 + 0 + 16 + 192 = 0xD2
    assert pack_codes(torch.tensor([1, 2, 3, 0, 0, 1, 2, 3], dtype=u8), 2).tolist() == [0x8D, 0xD2]
    # 3 bits: codes 1..7, 0 at bits 3j: 1 + 2*8 + 3*64 + 4*512 + 5*4096 + 6*32768 + 7*262144 = 2054353
    # = 0x1F58D1, little-endian bytes D1 58 1F
    assert pack_codes(torch.tensor([1, 2, 3, 4, 5, 6, 7, 0], dtype=u8), 3).tolist() == [0xD1, 0x58, 0x1F]
    # 8 bits: unchanged
    assert pack_codes(torch.tensor([7, 200], dtype=u8), 8).tolist() == [7, 200]
    assert unpack_codes(torch.tensor([0x39], dtype=u8), 2).tolist() == [1, 2, 3, 0]


def test_pack_bad_input():
    with pytest.raises(ValueError, match="unsupported bit width"):
        pack_codes(torch.zeros(8, dtype=torch.uint8), 5)
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_codes(torch.zeros(6, dtype=torch.uint8), 2)
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_codes(torch.zeros(12, dtype=torch.uint8), 3)
    with pytest.raises(ValueError, match="uint8"):
        pack_codes(torch.zeros(8, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="below 2\\^2"):
        pack_codes(torch.tensor([0, 4, 1, 1], dtype=torch.uint8), 2)
    with pytest.raises(ValueError, match="uint8"):
        unpack_codes(torch.zeros(2, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="hold 4 codes"):
        unpack_codes(torch.zeros(1, dtype=torch.uint8), 2, n=5)
