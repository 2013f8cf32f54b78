"""The KVarN-family quantizer (kvarn.quant.affine) against the float64 reference of docs/SPEC.md §3, its error
bound, its byte accounting and its refusals."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvarn.presets import get_preset
from kvarn.quant.affine import AffineConfig, AffineQuantizer
from kvarn.quant.tiles import AffineTiles
from tests.helpers import check_against_reference, stored_codes
from tests.reference.data import heavy_tailed, real_tiles
from tests.reference.hadamard import hadamard_reference
from tests.tolerances import FP16_ETA, FP16_U

# (rotate, varn) of the four families: RTN, Hadamard only, VarN only, KVarN
FAMILIES = {"rtn": ("none", False), "hadamard": ("hadamard", False), "varn": ("none", True),
            "kvarn": ("hadamard", True)}


def quantizer(family: str, bits: int, axis: str, tile: int, scale_dtype=torch.float16) -> AffineQuantizer:
    rotate, use_varn = FAMILIES[family]
    return AffineQuantizer(AffineConfig(bits, axis, rotate, use_varn, tile=tile, scale_dtype=scale_dtype))


def tiles_of_kind(kind: str, g: torch.Generator, n: int, tile: int, d: int) -> torch.Tensor:
    """float64 tiles [n, tile, d]: gaussian, heavy-tailed, or with outlier tokens of extreme norm."""
    if kind == "gauss":
        return torch.randn(n, tile, d, generator=g, dtype=torch.float64)
    x = heavy_tailed(n, tile, d, generator=g)
    if kind == "outlier_tokens":
        x[:, 1] *= 40.0
        x[:, tile // 2] *= 0.02
    return x


# --- against the reference --------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("axis", ["channel", "token"])
@pytest.mark.parametrize("bits", [2, 4])
def test_matches_reference_random(family, axis, bits, seed):
    g = torch.Generator().manual_seed(seed)
    q = quantizer(family, bits, axis, tile=16)
    for kind in ("gauss", "heavy", "outlier_tokens"):
        check_against_reference(q, tiles_of_kind(kind, g, 2, 16, 32).float())


@pytest.mark.parametrize("family", ["kvarn", "hadamard"])
def test_matches_reference_fallback_head_dim(family, seed):
    g = torch.Generator().manual_seed(seed)
    for axis in ("channel", "token"):
        check_against_reference(quantizer(family, 2, axis, tile=8), heavy_tailed(1, 8, 80, generator=g).float())


@pytest.mark.model
@pytest.mark.parametrize("kind,axis", [("keys", "channel"), ("values", "token")])
def test_matches_reference_real_activations(kind, axis):
    x = real_tiles(32, kind)  # [N, 32, 64] from layers 1, 14, 28
    for family in FAMILIES:
        check_against_reference(quantizer(family, 2, axis, tile=32), x[[0, len(x) // 2, -1]])


def test_reconstruction_formula_both_orientations(seed):
    # the two written forms: K^[d, g] = (q a_d + z_d) t_g (rows = channels) and
    # V^[g, d] = (q a'_g + z'_g) c_d (rows = tokens), evaluated by hand on one tile, no rotation
    g = torch.Generator().manual_seed(seed)
    x = heavy_tailed(1, 8, 16, generator=g).float()
    for axis in ("channel", "token"):
        q = quantizer("varn", 2, axis, tile=8)
        p = q.encode(x)
        codes = stored_codes(p, 0, 2)
        a, z, t = p.row_scale[0].double(), p.row_zero[0].double(), p.col_scale[0].double()
        dec = q.decode(p)[0].double()  # token-major [G, D]
        for tok in range(8):
            for ch in range(16):
                if axis == "channel":  # keys: rows d, cols g
                    want = (codes[ch][tok] * a[ch] + z[ch]) * t[tok]
                else:  # values: rows g, cols d
                    want = (codes[tok][ch] * a[tok] + z[tok]) * t[ch]
                assert abs(dec[tok, ch].item() - want.item()) <= 1e-6 * abs(want.item()) + 1e-30


# --- error bound (hypothesis) -----------------------------------------------------------------------------
#
# Derivation. In the rows layout of the (rotated) tile, VarN gives X = B s_r s_c and RTN gives
# |B - (q delta + lo)| <= delta / 2 (B lies in [lo, hi]). With a = s_r delta, z = s_r lo, t = s_c:
#     |X - (q a + z) t| <= a t / 2.
# The stored scales A, Z, T are a, z, t rounded to fp16: |a - A| <= u |A| + eta (u = 2^-11, eta = 2^-25
# for subnormals), likewise for z and t. Decoding computes (q A + Z) T, so
#     |X - X^| <= A' T' / 2 + (q e_A + e_Z) T' + |q A + Z| e_T,   A' = |A| + e_A, T' = |T| + e_T
# plus float32 arithmetic (the quantizer computes in float32): 1e-5 of the tile's max |X|.
# Rotated tiles: x - x^ = (X - X^)^T H per token, H orthonormal, so the per-token L2 error is bounded by
# the L2 norm of the per-element bounds of that token.


def error_bound(packed: AffineTiles, i: int, bits: int, axis: str, rows_x: torch.Tensor) -> torch.Tensor:
    """Per-element bound [G, D] (token-major) on |X - X^| in the rows domain of tile i."""
    codes = torch.tensor(stored_codes(packed, i, bits), dtype=torch.float64)  # [R, C]
    a = packed.row_scale[i].double().unsqueeze(-1)
    z = packed.row_zero[i].double().unsqueeze(-1)
    col = packed.col_scale
    t = col[i].double().unsqueeze(-2) if col is not None else torch.ones(1, codes.shape[1], dtype=torch.float64)
    e_a, e_z = FP16_U * a.abs() + FP16_ETA, FP16_U * z.abs() + FP16_ETA
    e_t = (FP16_U * t.abs() + FP16_ETA) if col is not None else torch.zeros_like(t)
    a1, t1 = a.abs() + e_a, t.abs() + e_t
    bound = a1 * t1 / 2 + (codes * e_a + e_z) * t1 + (codes * a + z).abs() * e_t
    bound = bound + 1e-5 * rows_x.abs().max()
    return bound.T if axis == "channel" else bound


STRUCTURES = ["gauss", "heavy", "const_channel", "const_token", "huge_token", "tiny_token"]


def make_tile(structure: str, n: int, tile: int, d: int, magnitude: float, seed: int) -> torch.Tensor:
    """float64 [n, tile, d] with max |x| = magnitude."""
    g = torch.Generator().manual_seed(seed)
    x = heavy_tailed(n, tile, d, generator=g) if structure != "gauss" else torch.randn(n, tile, d, generator=g,
                                                                                       dtype=torch.float64)
    if structure == "const_channel":  # a channel constant over the tile's tokens (a key row of std 0)
        x[:, :, 1] = x[:, :1, 1]
    elif structure == "const_token":  # a token with every channel equal (a value row of std 0)
        x[:, 2, :] = 1.5
    elif structure == "huge_token":
        x[:, 0] *= 1e3
    elif structure == "tiny_token":
        x[:, -1] *= 1e-3
    return x * (magnitude / x.abs().amax(dim=(1, 2), keepdim=True))


@settings(max_examples=40, deadline=None)
@given(family=st.sampled_from([*FAMILIES, "auto"]), axis=st.sampled_from(["channel", "token"]),
       bits=st.sampled_from([1, 2, 3, 4, 8]), tile=st.sampled_from([8, 16, 32, 64]),
       d=st.sampled_from([8, 16, 32, 48, 64, 80, 128]), n=st.integers(1, 3),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       log_mag=st.floats(-4, 4), structure=st.sampled_from(STRUCTURES), seed=st.integers(0, 2**31 - 1))
def test_roundtrip_error_within_derived_bound(family, axis, bits, tile, d, n, dtype, log_mag, structure, seed):
    rotate, use_varn = FAMILIES[family] if family != "auto" else ("auto", True)
    q = AffineQuantizer(AffineConfig(bits, axis, rotate, use_varn, tile=tile))
    x = make_tile(structure, n, tile, d, 10.0**log_mag, seed).to(dtype)
    packed = q.encode(x)
    dec = q.decode(packed, torch.float32)
    assert dec.shape == x.shape and q.decode(packed, dtype).dtype == dtype
    exact = x.double()
    rotated = torch.full((n,), rotate == "hadamard") if rotate != "auto" else packed.rotated.bool()
    finite = packed.finite_tiles()
    for i in range(n):
        w = exact[i] @ hadamard_reference(d) if rotated[i] else exact[i]  # token-major, rotated domain
        rows_x = w.T if axis == "channel" else w
        if not finite[i]:
            # fp16 scales overflow only when |z| or |a| can pass 65504: |z| <= max|X| e^0.3 (t >= e^-0.3),
            # |a| <= 2 max|X| e^0.3 / levels. The cache keeps such tiles exact (tests/test_store.py).
            assert rows_x.abs().max().item() * 2 * math.exp(0.3) > 65504
            continue
        assert torch.isfinite(dec[i]).all()
        assert torch.isfinite(q.decode(packed.select(slice(i, i + 1)), dtype)).all()
        bound = error_bound(packed, i, bits, axis, rows_x)
        err = dec[i].double() - exact[i]
        if rotated[i]:
            assert (err.norm(dim=-1) <= bound.norm(dim=-1) * (1 + 1e-6)).all()
        else:
            assert (err.abs() <= bound).all(), (err.abs() - bound).max()


# --- what the method is for -------------------------------------------------------------------------------


def worst_norm_error(x: torch.Tensor, xh: torch.Tensor) -> float:
    """max over tokens of | ||x^|| - ||x|| | / ||x||."""
    n, nh = x.double().norm(dim=-1), xh.double().norm(dim=-1)
    return ((nh - n).abs() / n).max().item()


@settings(max_examples=30, deadline=None)
@given(tile=st.sampled_from([32, 64, 128]), d=st.sampled_from([32, 64, 128]), bits=st.sampled_from([2, 3, 4]),
       n_out=st.integers(1, 4), factors=st.lists(st.one_of(st.floats(0.02, 0.1), st.floats(10, 50)),
                                                 min_size=4, max_size=4),
       offset=st.sampled_from([0.0, 1.0, 3.0]), seed=st.integers(0, 2**31 - 1))
def test_kvarn_worst_token_norm_error_below_rtn_on_keys(tile, d, bits, n_out, factors, offset, seed):
    # keys are quantized per channel over the tile's tokens, so a token far shorter or longer than the
    # others gets a step sized for the others: RTN's magnitude error concentrates there and VarN's token
    # scales t_g remove it. (Values are quantized per token, which is already scale-invariant per token:
    # there the claim is not made.)
    g = torch.Generator().manual_seed(seed)
    ch_scale = (0.5 * torch.randn(1, 1, d, generator=g)).exp()
    x = torch.randn(1, tile, d, generator=g) * ch_scale + offset * torch.randn(1, 1, d, generator=g)
    for i, f in zip(torch.randperm(tile, generator=g)[:n_out].tolist(), factors):
        x[0, i] *= f
    kv = quantizer("kvarn", bits, "channel", tile)
    rtn = quantizer("rtn", bits, "channel", tile)
    assert worst_norm_error(x, kv.roundtrip(x)) < worst_norm_error(x, rtn.roundtrip(x))


@pytest.mark.model
def test_kvarn_token_norm_error_below_rtn_on_real_keys():
    # the same claim on real SmolLM2 keys (layers 1, 14, 28, all KV heads; 64-token tiles)
    x = real_tiles(64, "keys")
    kv, rtn = quantizer("kvarn", 2, "channel", 64), quantizer("rtn", 2, "channel", 64)
    assert worst_norm_error(x, kv.roundtrip(x)) < worst_norm_error(x, rtn.roundtrip(x))


# --- byte accounting --------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_field_bytes(family, scale_dtype, seed):
    # every stored field, its shape and dtype: codes R*C*b/8 bytes, two row vectors, one column vector with
    # VarN; the zero point stays fp16 when the scales are fp8
    g = torch.Generator().manual_seed(seed)
    d, tile, bits = 64, 32, 2
    for axis, (r, c) in (("channel", (d, tile)), ("token", (tile, d))):
        q = quantizer(family, bits, axis, tile, scale_dtype)
        p = q.encode(torch.randn(3, tile, d, generator=g))
        zero_dtype = torch.float16 if scale_dtype == torch.float8_e4m3fn else scale_dtype
        assert p.codes.shape == (3, r, c * bits // 8) and p.codes.dtype == torch.uint8
        assert p.row_scale.shape == (3, r) and p.row_scale.dtype == scale_dtype
        assert p.row_zero.shape == (3, r) and p.row_zero.dtype == zero_dtype
        has_col = FAMILIES[family][1]
        assert ("col_scale" in p.names()) == has_col
        if has_col:
            assert p.col_scale.shape == (3, c) and p.col_scale.dtype == scale_dtype
        sb, zb = scale_dtype.itemsize, zero_dtype.itemsize
        want = 3 * (r * c * bits // 8 + r * (sb + zb) + (c * sb if has_col else 0))
        assert p.nbytes == want == sum(t.numel() * t.element_size() for _, t in p.items())


@pytest.mark.parametrize("d,tile", [(128, 128), (64, 128), (128, 64), (64, 64), (96, 128)])
def test_fp8_scale_bits_per_element(d, tile):
    # e4m3 a and t (8 bits), fp16 z: keys (24 D + 8 G) bits per tile, values (24 G + 8 D); their mean over
    # D G elements is 16 (D + G) / (D G): 2.25 for k2v2 at D = G = 128, the paper's "2.3"
    for bits in (2, 4):
        k = quantizer("kvarn", bits, "channel", tile, torch.float8_e4m3fn).bits_per_element(d)
        v = quantizer("kvarn", bits, "token", tile, torch.float8_e4m3fn).bits_per_element(d)
        assert math.isclose(k, bits + (24 * d + 8 * tile) / (d * tile), rel_tol=1e-12)
        assert math.isclose(v, bits + (24 * tile + 8 * d) / (d * tile), rel_tol=1e-12)
        assert math.isclose((k + v) / 2, bits + 16 * (d + tile) / (d * tile), rel_tol=1e-12)


def test_fp8_scales_error_and_overflow(seed):
    # fp8 scales: 3 mantissa bits, so a and t carry up to 2^-4 relative error; the round trip stays within
    # 4x the fp16-scale error here, and out-of-range scales (> 448) flag the tile instead of saturating
    g = torch.Generator().manual_seed(seed)
    x = heavy_tailed(4, 64, 64, generator=g).float()
    x = x / x.abs().max() * 20
    q8 = quantizer("kvarn", 2, "channel", 64, torch.float8_e4m3fn)
    q16 = quantizer("kvarn", 2, "channel", 64)
    e8 = ((q8.roundtrip(x) - x) ** 2).sum().item()
    e16 = ((q16.roundtrip(x) - x) ** 2).sum().item()
    assert q8.encode(x).finite_tiles().all() and e8 < 4 * e16
    big = x.clone()
    big[1] *= 2000.0  # row scales of tile 1 pass 448
    flags = quantizer("rtn", 2, "channel", 64, torch.float8_e4m3fn).encode(big).finite_tiles()
    assert flags.tolist() == [True, False, True, True]


# --- refusals ---------------------------------------------------------------------------------------------


def test_bad_input_is_a_clear_value_error():
    q = quantizer("kvarn", 2, "channel", 16)
    with pytest.raises(ValueError, match="rank 3"):
        q.encode(torch.randn(16, 32))
    with pytest.raises(ValueError, match="G=16"):
        q.encode(torch.randn(2, 8, 32))
    with pytest.raises(ValueError, match="floating"):
        q.encode(torch.ones(2, 16, 32, dtype=torch.int64))
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.randn(2, 16, 32)
        x[1, 3, 4] = bad
        with pytest.raises(ValueError, match="NaN or Inf"):
            q.encode(x)
    with pytest.raises(ValueError, match="unsupported bit width"):
        AffineQuantizer(AffineConfig(bits=5))
    with pytest.raises(ValueError, match="axis"):
        AffineQuantizer(AffineConfig(axis="row"))
    with pytest.raises(ValueError, match="rotate"):
        AffineQuantizer(AffineConfig(rotate="random"))
    kq, _ = get_preset("kvarn-k2v2-g128").quantizers(64)  # a preset's quantizer takes its own tile only
    with pytest.raises(ValueError, match="G=128"):
        kq.encode(torch.randn(1, 64, 64))
    with pytest.raises(ValueError, match="multiple of 4"):
        quantizer("rtn", 2, "token", 16).encode(torch.randn(1, 16, 30))  # 2-bit codes of 30 channels


def test_auto_rotation_decodes_each_tile_its_own_way(seed):
    # rotate="auto" stores a per-tile flag; each tile must decode as the fixed-rotation quantizer would
    g = torch.Generator().manual_seed(seed)
    x = torch.cat([heavy_tailed(3, 32, 64, generator=g), torch.randn(3, 32, 64, generator=g, dtype=torch.float64)])
    x[:3, :, :2] *= 30  # two dominant channels: where the rotation tends to hurt per-channel keys
    x = x.float()
    auto = AffineQuantizer(AffineConfig(2, "channel", "auto", True, tile=32))
    p = auto.encode(x)
    flags = p.rotated.bool()
    rot, plain = quantizer("kvarn", 2, "channel", 32).roundtrip(x), quantizer("varn", 2, "channel", 32).roundtrip(x)
    want = torch.where(flags.view(-1, 1, 1), rot, plain)
    assert torch.equal(auto.decode(p), want)


@pytest.mark.parametrize("rotate", ["hadamard", "auto", "none"])
@pytest.mark.parametrize("d", [64, 96])
def test_dense_rotation_decode_matches_the_butterfly(rotate, d, seed):
    """decode_tiles(dense=True) (attention's many-tile read: one matmul with H, rotated tiles only) is the same
    product as the reference butterfly: equal up to float32 rounding of a length-D dot product (~D eps32 |x|),
    and each tile decodes its own way under "auto" (both kinds present)."""
    from kvarn.quant.affine import decode_tiles

    g = torch.Generator().manual_seed(seed)
    x = torch.cat([heavy_tailed(3, 32, d, generator=g), torch.randn(3, 32, d, generator=g, dtype=torch.float64)])
    x[:3, :, :2] *= 30
    p = AffineQuantizer(AffineConfig(2, "channel", rotate, True, tile=32)).encode(x.float())
    if rotate == "auto":
        assert p.rotated.bool().any() and not p.rotated.bool().all()
    ref = decode_tiles(p)
    dense = decode_tiles(p, dense=True)
    scale = float(ref.abs().max())
    assert (dense - ref).abs().max().item() <= 4 * d * torch.finfo(torch.float32).eps * scale
    if rotate == "none":
        assert torch.equal(dense, ref)
