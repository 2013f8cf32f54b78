"""The paper's baselines (docs/SPEC.md §5) against plain float64 references (tests/reference/baselines_ref.py), their
byte accounting through LayerStore, their cache policies, error bounds and bad input.

Tolerances, stated once:
- codes: equal to the reference's, except a code may move to its neighbour where the unrounded value lies within
  `tol` code units of a decision boundary (a rounding tie, a bin edge, a midpoint between codebook levels).
  tol = 1e-9 when the implementation computes in float64 (float64 inputs keep float64), 1e-4 when it computes in
  float32 (float32 inputs; KIVI's key quantizer, which is `AffineQuantizer`, always works in float32).
- stored fp16 scales: within one fp16 ulp of the reference's (the implementation may round a float32 value where
  the reference rounds a float64 one); float64 scales: to 1e-12.
- reconstructions: `decode` against the reference formula applied to the stored fields, to float32 round-off.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvarn.cache.store import LayerStore
from kvarn.ops.hadamard import hadamard_transform
from kvarn.ops.packing import unpack_codes
from kvarn.presets import get_preset, preset_names
from kvarn.quant.baselines import (
    DenseSparseRTN,
    KittyKeyQuantizer,
    PolarKeyQuantizer,
    TokenRTN,
    TurboQuantizer,
    lloyd_max_codebook,
)
from kvarn.quant.baselines.kitty import promoted_count
from kvarn.quant.baselines.kivi import kivi_key, kivi_preset
from kvarn.quant.baselines.kvquant import outlier_count
from tests.reference.baselines_ref import (
    channel_rows_recon,
    coordinate_mse_ref,
    dense_sparse_recon,
    dense_sparse_ref,
    kitty_ref,
    kivi_keys_ref,
    lloyd_max_ref,
    polar_recon,
    polar_ref,
    token_rtn_recon,
    token_rtn_ref,
    turbo_recon,
    turbo_ref,
)
from tests.reference.data import heavy_tailed, real_tiles
from tests.tolerances import CODE_TIE_F32 as F32  # code-unit tie tolerances (see the module docstring)
from tests.tolerances import CODE_TIE_F64 as F64

BASELINES = ["kivi-k2v2-g32", "kivi-k2v2-g128", "kivi-k4v4-g32", "kivi-k4v4-g128", "quarot-k2v2",
             "quarot-k2v2-clip95", "quarot-k4v4", "quarot-k2v2-sink128", "kvquant-k2v2-1pct", "polarquant-k4v2",
             "turboquant-k3v3", "turboquant-qjl-k3v3", "kitty-k2v2-g128", "kitty-k2v2-g32"]
ALIASES = {"kivi": "kivi-k2v2-g32", "kivi-g128": "kivi-k2v2-g128", "kivi-k4v4": "kivi-k4v4-g32",
           "quarot": "quarot-k2v2", "quarot-clip95": "quarot-k2v2-clip95", "quarot-sink128": "quarot-k2v2-sink128",
           "kvquant-1pct": "kvquant-k2v2-1pct", "polarquant": "polarquant-k4v2", "turboquant": "turboquant-k3v3",
           "turboquant-qjl": "turboquant-qjl-k3v3", "kitty": "kitty-k2v2-g128"}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _codes_ok(actual: torch.Tensor, ref: list, margin: list, tol: float, what: str) -> None:
    a = actual.long()
    r = torch.tensor(ref, dtype=torch.long)
    m = torch.tensor(margin, dtype=torch.float64)
    assert a.shape == r.shape, (what, a.shape, r.shape)
    differ = a != r
    far = differ & (m >= tol)
    assert not far.any(), f"{what}: {int(far.sum())} codes differ away from a decision boundary"
    assert ((a - r).abs() <= 1).all(), f"{what}: codes differ by more than one step"


def _stored_ok(stored: torch.Tensor, ref: list | torch.Tensor, what: str) -> None:
    r = torch.as_tensor(ref, dtype=torch.float64)
    s = stored.double()
    assert s.shape == r.shape, (what, s.shape, r.shape)
    if stored.dtype == torch.float64:
        assert torch.allclose(s, r, rtol=1e-12, atol=1e-300), what
    else:  # one ulp of the storage dtype
        fi = torch.finfo(stored.dtype)
        assert torch.allclose(s, r.to(stored.dtype).double(), rtol=fi.eps, atol=fi.tiny), what


def _recon_ok(decoded: torch.Tensor, ref: torch.Tensor, what: str, stored: torch.Tensor | None = None) -> None:
    """`stored`: a stored scale field; decoding runs in float64 only when it is float64, else in float32."""
    d = decoded.double()
    scale = ref.abs().max().item() + 1e-30
    tol = 1e-12 if stored is not None and stored.dtype == torch.float64 else 2e-6
    assert (d - ref).abs().max().item() <= tol * scale, f"{what}: max error {(d - ref).abs().max().item():.3g}"


# --- one check per method: encode, compare with the reference, decode --------------------------------------


def check_kivi_keys(q, x: torch.Tensor, tol: float = F32) -> None:
    bits = q.config.bits
    p = q.encode(x)
    codes = unpack_codes(p.codes, bits)  # [N, D, G]
    ref = kivi_keys_ref(x, bits)
    _codes_ok(codes, ref["codes"], ref["margin"], tol, "kivi keys")
    _stored_ok(p.row_scale, ref["scale"], "kivi key scale")
    _stored_ok(p.row_zero, ref["zero"], "kivi key min")
    rec = channel_rows_recon(codes.tolist(), p.row_scale.double().tolist(), p.row_zero.double().tolist())
    _recon_ok(q.decode(p, torch.float64), rec, "kivi keys")


def check_token_rtn(q: TokenRTN, x: torch.Tensor, tol: float) -> None:
    p = q.encode(x)
    codes = unpack_codes(p.codes, q.bits)
    ref = token_rtn_ref(x, q.bits, q.group, q.rotate, q.clip)
    _codes_ok(codes, ref["codes"], ref["margin"], tol, q.name)
    _stored_ok(p.scale, ref["scale"], "scale")
    _stored_ok(p.zero, ref["zero"], "zero")
    rec = token_rtn_recon(codes.tolist(), p.scale.double().tolist(), p.zero.double().tolist(), q.group,
                          q.rotate)
    _recon_ok(q.decode(p, torch.float64), rec, q.name, p.scale)


def check_dense_sparse(q: DenseSparseRTN, x: torch.Tensor, tol: float) -> None:
    p = q.encode(x)
    codes = unpack_codes(p.codes, q.bits)
    ref = dense_sparse_ref(x, q.bits, q.axis, q.k)
    assert p.outlier_index.long().tolist() == ref["index"]
    _stored_ok(p.outliers, ref["outliers"], "outliers")
    _codes_ok(codes, ref["codes"], ref["margin"], tol, q.name)
    _stored_ok(p.scale, ref["scale"], "scale")
    _stored_ok(p.zero, ref["zero"], "zero")
    rec = dense_sparse_recon(codes.tolist(), p.scale.double().tolist(), p.zero.double().tolist(),
                             ref["index"], p.outliers.double().tolist(), q.axis)
    _recon_ok(q.decode(p, torch.float64), rec, q.name, p.scale)


def check_polar(q: PolarKeyQuantizer, x: torch.Tensor, tol: float) -> None:
    p = q.encode(x)
    rc = unpack_codes(p.radius_codes, q.radius_bits)
    tc = unpack_codes(p.angle_codes, q.angle_bits)
    ref = polar_ref(x, q.radius_bits, q.angle_bits)
    _codes_ok(rc, ref["r_codes"], ref["r_margin"], tol, "radius")
    _codes_ok(tc, ref["t_codes"], ref["t_margin"], tol, "angle")
    for field, key in (("radius_scale", "r_scale"), ("radius_min", "r_min"), ("angle_scale", "t_scale"),
                       ("angle_min", "t_min")):
        _stored_ok(getattr(p, field), ref[key], field)
    rec = polar_recon(rc.tolist(), p.radius_scale.double().tolist(), p.radius_min.double().tolist(),
                      tc.tolist(), p.angle_scale.double().tolist(), p.angle_min.double().tolist())
    _recon_ok(q.decode(p, torch.float64), rec, "polar", p.radius_scale)


def check_turbo(q: TurboQuantizer, x: torch.Tensor, tol: float) -> None:
    p = q.encode(x)
    cb = q.codebook.tolist()
    codes = unpack_codes(p.codes, q.mse_bits)
    ref = turbo_ref(x, cb, q.rotation, q.sketch)
    _codes_ok(codes, ref["codes"], ref["margin"], tol, q.name)
    _stored_ok(p.norm, ref["norm"], "norm")
    signs = rnorm = None
    if q.qjl:
        signs = unpack_codes(p.signs, 1)
        same_codes = (codes.long() == torch.tensor(ref["codes"])).all(dim=-1)  # the residual depends on the codes
        ref_signs = torch.tensor(ref["signs"])
        clear = torch.tensor(ref["sign_margin"], dtype=torch.float64) >= tol  # |S r| away from 0
        assert ((signs.long() == ref_signs) | ~clear | ~same_codes.unsqueeze(-1)).all(), "QJL signs"
        rn = torch.tensor(ref["rnorm"], dtype=torch.float64)
        _stored_ok(p.residual_norm[same_codes], rn[same_codes], "residual norm")
        signs, rnorm = signs.tolist(), p.residual_norm.double().tolist()
    rec = turbo_recon(codes.tolist(), p.norm.double().tolist(), cb, q.rotation, signs, rnorm, q.sketch)
    _recon_ok(q.decode(p, torch.float64), rec, q.name, p.norm)


def check_kitty(q: KittyKeyQuantizer, x: torch.Tensor, tol: float) -> None:
    p = q.encode(x)
    ref = kitty_ref(x, q.bits, q.high_bits, q.k)
    assert p.channels.long().tolist() == ref["promoted"]
    low = unpack_codes(p.low_codes, q.bits)
    high = unpack_codes(p.high_codes, q.high_bits)
    n, d = x.shape[0], x.shape[2]
    codes = torch.empty(n, d, x.shape[1], dtype=torch.long)
    scale = torch.empty(n, d, dtype=torch.float64)
    zero = torch.empty(n, d, dtype=torch.float64)
    for i, promoted in enumerate(ref["promoted"]):
        rest = [c for c in range(d) if c not in promoted]  # stored order: low channels, then promoted, ascending
        codes[i, rest], codes[i, promoted] = low[i].long(), high[i].long()
        scale[i, rest], scale[i, promoted] = p.low_scale[i].double(), p.high_scale[i].double()
        zero[i, rest], zero[i, promoted] = p.low_zero[i].double(), p.high_zero[i].double()
    _codes_ok(codes, ref["codes"], ref["margin"], tol, "kitty")
    ref_scale = torch.tensor(ref["scale"], dtype=torch.float64)
    _stored_ok(scale.to(p.low_scale.dtype), ref_scale, "kitty scale")
    _stored_ok(zero.to(p.low_zero.dtype), ref["zero"], "kitty min")
    _recon_ok(q.decode(p, torch.float64), channel_rows_recon(codes.tolist(), scale.tolist(), zero.tolist()), "kitty",
              p.low_scale)


# --- registration and description ---------------------------------------------------------------------------


def test_presets_registered_and_described():
    names = preset_names()
    aliased = preset_names(include_aliases=True)
    for name in BASELINES:
        assert name in names
        p = get_preset(name)
        assert p.name == name and p.quantized
        for d in (64, 128):
            kq, vq = p.quantizers(d)
            assert p.tile % kq.tile == 0 and p.tile % vq.tile == 0
            for q in (kq, vq):
                desc = q.describe()
                json.dumps(desc)
                assert desc["name"] and desc["tile"] == q.tile and len(desc) > 3
    for alias, target in ALIASES.items():
        assert alias in aliased and get_preset(alias).name == target
    with pytest.raises(ValueError, match="kivi"):  # the error lists the valid names, baselines included
        get_preset("no-such-method")


def test_cache_policies_as_published():
    # (flush unit, sink, value window, fp layers, pre-RoPE keys): the methods' published settings
    policy = {"kivi": (128, 0, "sliding", (0, 0), False), "quarot": (1, 0, "block", (0, 0), False),
              "quarot-sink128": (128, 128, "block", (0, 0), False),
              "kvquant-1pct": (128, 1, "block", (0, 0), True), "polarquant": (128, 0, "block", (0, 0), False),
              "turboquant": (1, 0, "block", (2, 2), False), "kitty": (128, 32, "sliding", (0, 0), False)}
    for name, want in policy.items():
        p = get_preset(name)
        assert (p.tile, p.sink, p.value_window, p.fp_layers, p.key_pre_rope) == want, name
    assert get_preset("kivi").quantizers(64)[0].tile == 32 and get_preset("kivi-g128").quantizers(64)[0].tile == 128


# --- each quantizer against its reference (float64, float32, real activations) ------------------------------


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_keys_match_reference(group, bits, seed):
    x = heavy_tailed(3, group, 64, generator=_gen(seed)).float()  # AffineQuantizer works in float32
    check_kivi_keys(kivi_key(bits, group), x)


@pytest.mark.parametrize("bits,group,rotate,clip,d", [
    (2, 32, False, None, 64),  # KIVI values
    (4, 32, False, None, 80),  # KIVI values, D = 80: groups of gcd(80, 32) = 16
    (2, None, True, 1.0, 64),  # QuaRot
    (2, None, True, 0.95, 96),  # QuaRot clip 0.95, block-diagonal Hadamard (64 + 32)
    (4, None, True, 0.95, 64),
    (2, None, False, None, 128),  # PolarQuant values
    (2, None, False, 0.95, 64),  # clipped range without rotation: an all-positive token starts at 0
])
def test_token_rtn_matches_reference(bits, group, rotate, clip, d, seed):
    x = heavy_tailed(4, 2, d, generator=_gen(seed))
    x[0, 0] = x[0, 0].abs() + 0.1  # an all-positive token (QuaRot's range includes 0)
    q64 = TokenRTN(bits, d, group=group, tile=2, rotate=rotate, clip=clip, scale_dtype=torch.float64)
    check_token_rtn(q64, x, F64)
    q = TokenRTN(bits, d, group=group, tile=2, rotate=rotate, clip=clip)
    check_token_rtn(q, x.float(), F32)
    assert q.group == (d if group is None else math.gcd(d, group))


@pytest.mark.parametrize("axis,tile", [("channel", 128), ("channel", 64), ("token", 1), ("token", 4)])
def test_dense_sparse_matches_reference(axis, tile, seed):
    x = heavy_tailed(3, tile, 64, generator=_gen(seed))
    q64 = DenseSparseRTN(2, 64, axis, tile, scale_dtype=torch.float64, outlier_dtype=torch.float64)
    assert q64.k == math.ceil(0.01 * (tile if axis == "channel" else 64))
    check_dense_sparse(q64, x, F64)
    check_dense_sparse(DenseSparseRTN(2, 64, axis, tile), x.float(), F32)


@pytest.mark.parametrize("rb,tb,tile", [(4, 4, 128), (3, 3, 32), (2, 4, 16)])
def test_polar_matches_reference(rb, tb, tile, seed):
    x = heavy_tailed(2, tile, 64, generator=_gen(seed))
    check_polar(PolarKeyQuantizer(64, rb, tb, tile, scale_dtype=torch.float64), x, F64)
    check_polar(PolarKeyQuantizer(64, rb, tb, tile), x.float(), F32)


@pytest.mark.parametrize("bits,qjl,d", [(3, False, 64), (2, False, 32), (3, True, 64), (4, True, 32)])
def test_turbo_matches_reference(bits, qjl, d, seed):
    x = heavy_tailed(6, 1, d, generator=_gen(seed))
    check_turbo(TurboQuantizer(d, bits, qjl=qjl, seed=seed % 1000, norm_dtype=torch.float64), x, F64)
    check_turbo(TurboQuantizer(d, bits, qjl=qjl, seed=seed % 1000), x.float(), F32)


@pytest.mark.parametrize("tile,ratio", [(128, 0.1), (32, 0.1), (32, 0.25)])
def test_kitty_matches_reference(tile, ratio, seed):
    x = heavy_tailed(3, tile, 64, generator=_gen(seed))
    q64 = KittyKeyQuantizer(64, 2, 4, ratio, tile, scale_dtype=torch.float64)
    assert q64.k == int(64 * ratio + 1e-6)
    check_kitty(q64, x, F64)
    check_kitty(KittyKeyQuantizer(64, 2, 4, ratio, tile), x.float(), F32)


@pytest.mark.model
def test_baselines_on_real_activations():
    # real keys and values of SmolLM2 (float32 values; float64 arithmetic where the quantizer allows it)
    keys128, keys32 = real_tiles(128, "keys").double(), real_tiles(32, "keys")
    values = real_tiles(1, "values")[:96].double()
    check_kivi_keys(kivi_key(2, 32), keys32[:6], 1e-5)
    check_token_rtn(TokenRTN(2, 64, group=32, scale_dtype=torch.float64), values, F64)
    check_token_rtn(TokenRTN(2, 64, rotate=True, clip=0.95, scale_dtype=torch.float64), values, F64)
    check_dense_sparse(DenseSparseRTN(2, 64, "channel", 128, scale_dtype=torch.float64,
                                      outlier_dtype=torch.float64), keys128[:3], F64)
    check_dense_sparse(DenseSparseRTN(2, 64, "token", 1, scale_dtype=torch.float64,
                                      outlier_dtype=torch.float64), values, F64)
    check_polar(PolarKeyQuantizer(64, 4, 4, 128, scale_dtype=torch.float64), keys128[:3], F64)
    check_turbo(TurboQuantizer(64, 3, qjl=True, norm_dtype=torch.float64), keys128[0, :24].unsqueeze(1), F64)
    check_kitty(KittyKeyQuantizer(64, scale_dtype=torch.float64), keys128[:3], F64)


# --- method-specific properties -----------------------------------------------------------------------------


def test_polar_pairs_follow_rotate_half(seed):
    # One pre-RoPE key at 128 positions, rotated the transformers way (pairs (d, d + D/2)): every pair keeps its
    # radius, so the radius is recovered to fp16 precision while the angle sweeps with the position. Adjacent
    # pairing (2i, 2i + 1) would see varying radii and fail this.
    g = _gen(seed)
    d, n = 64, 128
    base = torch.randn(d, generator=g, dtype=torch.float64)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(n, dtype=torch.float64).unsqueeze(1) * inv_freq  # [n, D/2]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    rotate_half = torch.cat([-base[d // 2:], base[: d // 2]])
    keys = (base * cos + rotate_half * sin).unsqueeze(0)  # [1, n, D]
    out = PolarKeyQuantizer(d, 4, 4, n).roundtrip(keys.float()).double()
    radius = torch.hypot(keys[..., : d // 2], keys[..., d // 2:])
    radius_hat = torch.hypot(out[..., : d // 2], out[..., d // 2:])
    assert ((radius_hat - radius).abs() <= 2e-3 * radius + 1e-6).all()


def test_turbo_codebook_matches_independent_lloyd(seed):
    d = [16, 64, 128][seed % 3]
    sigma = 1 / math.sqrt(d)
    for bits in (1, 2, 3):
        got = lloyd_max_codebook(d, bits)
        ref = torch.tensor(lloyd_max_ref(d, bits), dtype=torch.float64)
        assert (got - ref).abs().max().item() < 1e-7 * sigma, (d, bits)
    # 1 bit: the levels are +-E|t| = Gamma(D/2) / (sqrt(pi) Gamma((D+1)/2)) exactly
    half = math.exp(math.lgamma(d / 2) - math.lgamma((d + 1) / 2)) / math.sqrt(math.pi)
    assert torch.allclose(lloyd_max_codebook(d, 1), torch.tensor([-half, half], dtype=torch.float64), rtol=1e-8)


def test_turbo_codebook_tends_to_gaussian_lloyd_max():
    # For large D, sqrt(D) t is N(0, 1): levels and distortion approach Max's (1960) Gaussian quantizer tables
    # (J. Max, "Quantizing for minimum distortion", IRE Trans. IT-6, Table I), independent of this code.
    max_levels = {2: [0.4528, 1.510], 3: [0.2451, 0.7560, 1.344, 2.152]}
    max_mse = {1: 0.3634, 2: 0.1175, 3: 0.03454}
    d = 2048
    for bits, levels in max_levels.items():
        got = (lloyd_max_codebook(d, bits) * math.sqrt(d))[2 ** (bits - 1):].tolist()
        assert all(abs(a - b) < 2e-3 * b + 5e-4 for a, b in zip(got, levels)), (bits, got)
    for bits, mse in max_mse.items():
        assert abs(d * coordinate_mse_ref(d, lloyd_max_codebook(d, bits).tolist()) - mse) < 2e-3 * mse + 1e-4


def test_turbo_distortion_matches_theory(seed):
    # ||u - u^||^2 over random directions = D * E[(y - c(y))^2], y one coordinate of a uniform unit vector
    d, n = 64, 4000
    x = torch.randn(n, 1, d, generator=_gen(seed), dtype=torch.float64) * 3.0
    for bits in (2, 3):
        # the rotation's seed must differ from the inputs' (same stream -> rotation correlated with x, +8% error)
        q = TurboQuantizer(d, bits, seed=(seed + 1) % 1000, norm_dtype=torch.float64)
        err = ((q.roundtrip(x) - x).pow(2).sum(-1) / x.pow(2).sum(-1)).mean().item()
        theory = d * coordinate_mse_ref(d, q.codebook.tolist())
        assert abs(err - theory) < 0.05 * theory, (bits, err, theory)


def test_turbo_qjl_inner_products_unbiased(seed):
    # E_S <x, x^> = ||x||^2 with the QJL residual; the plain 2-bit codebook alone shrinks it by ~(1 - mse)
    d = 32
    x = torch.randn(1, 1, d, generator=_gen(seed), dtype=torch.float64)
    true = x.pow(2).sum().item()
    qjl, mse = [], []
    for s in range(200):
        qjl.append((TurboQuantizer(d, 3, qjl=True, seed=s, norm_dtype=torch.float64).roundtrip(x) * x).sum().item())
        mse.append((TurboQuantizer(d, 2, seed=s, norm_dtype=torch.float64).roundtrip(x) * x).sum().item())
    q, m = torch.tensor(qjl), torch.tensor(mse)
    assert abs(q.mean().item() - true) < 4 * q.std().item() / math.sqrt(len(q)) + 1e-9 * true
    assert abs(m.mean().item() - true) > 10 * m.std().item() / math.sqrt(len(m))  # the test can tell bias


def test_turbo_rotation_is_orthogonal_and_seeded():
    q0, q1 = TurboQuantizer(64, 3, seed=0), TurboQuantizer(64, 3, seed=1)
    eye = torch.eye(64, dtype=torch.float64)
    assert (q0.rotation @ q0.rotation.T - eye).abs().max().item() < 1e-12
    assert torch.equal(q0.rotation, TurboQuantizer(64, 3, seed=0).rotation)
    assert not torch.allclose(q0.rotation, q1.rotation)


# --- round-trip error bounds (float32 scales, so the bounds are the methods' own) -----------------------------


def test_roundtrip_error_bounds(seed):
    g = _gen(seed)
    x = heavy_tailed(4, 128, 64, generator=g).float()
    f32 = torch.float32
    slack = 1 + 1e-5
    # RTN: |w - w^| <= delta / 2 inside the range; QuaRot clip: plus the distance to the clipped range
    for clip in (None, 0.95):
        q = TokenRTN(2, 64, tile=128, rotate=clip is not None, clip=clip, scale_dtype=f32)
        p = q.encode(x)
        w = hadamard_transform(x) if q.rotate else x
        w_hat = hadamard_transform(q.decode(p)) if q.rotate else q.decode(p)
        delta = p.scale.repeat_interleave(q.group, dim=-1)
        lo = p.zero.repeat_interleave(q.group, dim=-1)
        hi = lo + delta * 3
        outside = (lo - w).clamp_min(0) + (w - hi).clamp_min(0)
        assert ((w - w_hat).abs() <= (delta / 2 + outside) * slack + 1e-5).all()
    # dense-and-sparse: outliers exact, inliers within half a step of the inliers' range
    q = DenseSparseRTN(2, 64, "channel", 128, scale_dtype=f32, outlier_dtype=f32)
    p = q.encode(x)
    err = (q.decode(p) - x).abs().transpose(-1, -2)  # [N, D, G]
    assert (err.gather(-1, p.outlier_index.long()) == 0).all()
    assert (err <= p.scale.unsqueeze(-1) / 2 * slack + 1e-5).all()
    # polar: |x_pair - x^_pair| <= |rho - rho^| + rho^ |phi - phi^| <= s_r / 2 + rho^ s_t / 2
    q = PolarKeyQuantizer(64, 4, 4, 128, scale_dtype=f32)
    p = q.encode(x)
    x_hat = q.decode(p)
    pair_err = torch.hypot(*(x - x_hat).chunk(2, dim=-1))  # [N, G, D/2]
    rho_hat = torch.hypot(*x_hat.chunk(2, dim=-1))
    bound = p.radius_scale.unsqueeze(1) / 2 + rho_hat * p.angle_scale.unsqueeze(1) / 2
    assert (pair_err <= bound * slack + 1e-5).all()
    # kitty: every channel within half a step of its own bit width; promoted channels have the finer step
    q = KittyKeyQuantizer(64, 2, 4, 0.1, 128, scale_dtype=f32)
    p = q.encode(x)
    err = (q.decode(p) - x).abs().amax(dim=1)  # [N, D]
    for i in range(x.shape[0]):
        promoted = p.channels[i].long()
        rest = torch.tensor([c for c in range(64) if c not in promoted.tolist()])
        assert (err[i, rest] <= p.low_scale[i] / 2 * slack + 1e-5).all()
        assert (err[i, promoted] <= p.high_scale[i] / 2 * slack + 1e-5).all()
        assert (p.high_scale[i] * 15 - (x[i, :, promoted].amax(0) - x[i, :, promoted].amin(0))).abs().max() < 1e-4


# --- bytes through LayerStore --------------------------------------------------------------------------------


def _layout(name: str, d: int) -> tuple[int, int, int, int]:
    """(key tile tokens, key tile bytes, value tile tokens, value tile bytes), from each method's documented
    storage, written out independently of the implementation."""
    fam = name.split("-")[0]
    if fam == "kivi" or fam == "kitty":
        kb, vb = int(name.split("-")[1][1]), int(name.split("-")[1][3])
        g = int(name.split("-g")[1])
        value = (1, d * vb // 8 + 2 * 2 * (d // min(g, d)))  # codes + fp16 scale and min per channel group
        if fam == "kivi":
            return (g, d * g * kb // 8 + 2 * 2 * d, *value)  # codes + fp16 scale and min per channel
        k = int(0.1 * d)  # promoted channels: 4-bit codes, 1-byte channel ids
        return (g, (d - k) * g * 2 // 8 + k * g * 4 // 8 + 2 * 2 * d + k, *value)
    if fam == "quarot":
        b = int(name.split("-")[1][1])
        return (1, d * b // 8 + 4, 1, d * b // 8 + 4)
    if fam == "kvquant":  # + per row: ceil(1%) outliers of (fp16 value + 1-byte position)
        return (128, d * 128 * 2 // 8 + 4 * d + d * math.ceil(1.28) * 3, 1, d * 2 // 8 + 4 + math.ceil(0.01 * d) * 3)
    if fam == "polarquant":  # 4 + 4 bits per pair, four fp16 per pair; values 2-bit per token
        return (128, (d // 2) * 128 * 8 // 8 + 4 * 2 * (d // 2), 1, d * 2 // 8 + 4)
    if fam == "turboquant":  # 3-bit codes + fp16 norm; QJL keys: 2-bit codes + norm + sign bits + residual norm
        key = d * 2 // 8 + 2 + d // 8 + 2 if "qjl" in name else d * 3 // 8 + 2
        return (1, key, 1, d * 3 // 8 + 2)
    raise AssertionError(name)


@pytest.mark.parametrize("name", BASELINES)
def test_bits_per_element_are_stored_bytes(name, seed):
    p = get_preset(name)
    d, b, h = 64, 1, 2
    kt, kbytes, vt, vbytes = _layout(name, d)
    assert p.bits_per_element(d) == pytest.approx((kbytes / (kt * d) + vbytes / (vt * d)) * 8 / 2, abs=1e-12)
    # a realistic sequence: a prefill, then tokens one at a time (float32 activations, 4 bytes when exact)
    g = _gen(seed)
    t0, t = 300, 337
    k = torch.randn(b, h, t, d, generator=g)
    v = torch.randn(b, h, t, d, generator=g)
    store = LayerStore.from_preset(p, d)
    store.append(k[:, :, :t0], v[:, :, :t0])
    for i in range(t0, t):
        store.append(k[:, :, i:i + 1], v[:, :, i:i + 1])
    # which tokens are quantized, by each method's documented policy
    s = min(p.sink, t)
    kq = (t - s) // p.tile * p.tile
    vq = kq if p.value_window == "block" else max(t - s - p.tile, 0) // vt * vt
    exact_tokens = 2 * s + (t - s - kq) + (t - s - vq)
    expected = 4 * b * h * d * exact_tokens + b * h * (kq // kt * kbytes + vq // vt * vbytes)
    nb = store.nbytes()
    assert nb.content == expected  # the regions' formula; spare buffer capacity is reported apart (`reserved`)
    assert nb.total == expected + nb.reserved
    assert nb.elements == 2 * b * h * t * d
    assert nb.bits_per_element == pytest.approx(nb.total * 8 / (2 * b * h * t * d), rel=1e-12)
    # the quantized region really is quantized: error > 0 there, exact elsewhere
    kf, vf = store.full()
    assert (kf[:, :, s:s + kq] - k[:, :, s:s + kq]).abs().amax(dim=(0, 1, 3)).gt(0).all()
    assert torch.equal(kf[:, :, :s], k[:, :, :s]) and torch.equal(kf[:, :, s + kq:], k[:, :, s + kq:])
    assert (vf[:, :, s:s + vq] - v[:, :, s:s + vq]).abs().amax(dim=(0, 1, 3)).gt(0).all()
    assert torch.equal(vf[:, :, s + vq:], v[:, :, s + vq:])


def test_turboquant_fp_layers_counted():
    # TurboQuant's setup keeps the first and last 2 layers in full precision: a 6-layer model averages them in
    p = get_preset("turboquant")
    d, n_layers, t = 64, 6, 40
    first, last = p.fp_layers
    total = None
    for layer in range(n_layers):
        fp = layer < first or layer >= n_layers - last
        store = LayerStore.from_preset(p, d, quantize=not fp)
        x = torch.randn(1, 3, t, d).half()  # an fp16 cache: exact layers at 16 bits
        store.append(x, x)
        total = store.nbytes() if total is None else total + store.nbytes()
    # the regions' formula (`content`): growable buffers may hold up to 4% spare capacity, reported as `reserved`
    assert total.content * 8 / total.elements == pytest.approx(p.bits_per_element(d, num_layers=n_layers), rel=1e-12)
    assert total.content * 8 / total.elements == pytest.approx((2 * (3 + 16 / d) + 4 * 16) / 6, rel=1e-12)


def test_kivi_keys_really_quantized_one_token_at_a_time(seed):
    # The reimplementation bug: per-channel statistics over one decode token make it exact. Here keys wait for
    # R = 128 tokens and are then quantized as 4 tiles of 32; values leave a 128-token window one by one.
    g = _gen(seed)
    d, t, r = 64, 128 + 40, 128
    k = torch.randn(1, 2, t, d, generator=g)
    v = torch.randn(1, 2, t, d, generator=g)
    step = LayerStore.from_preset(get_preset("kivi"), d)
    for i in range(t):
        step.append(k[:, :, i:i + 1], v[:, :, i:i + 1])
    assert step.keys.n_tiles == r // 32 and step.keys.tail.shape[2] == t - r
    assert step.values.n_tiles == t - r and step.values.tail.shape[2] == r
    kf, vf = step.full()
    per_token = (kf - k).abs().amax(dim=(0, 1, 3))
    assert (per_token[:r] > 0).all() and (per_token[r:] == 0).all()
    per_token = (vf - v).abs().amax(dim=(0, 1, 3))
    assert (per_token[: t - r] > 0).all() and (per_token[t - r:] == 0).all()
    keys_bytes = step.keys.nbytes()
    assert keys_bytes.packed == 2 * (r // 32) * (d * 32 * 2 // 8 + 4 * d)
    assert keys_bytes.tail == 2 * (t - r) * d * 4
    # one token at a time gives exactly what one prefill gives (tiles are aligned the same way)
    once = LayerStore.from_preset(get_preset("kivi"), d)
    once.append(k, v)
    assert all(torch.equal(a, b) for a, b in zip(once.full(), (kf, vf)))


def test_turbo_overflowing_norm_kept_exact():
    # a token whose norm overflows fp16 cannot be stored; the cache keeps that tile exact and counts it
    store = LayerStore.from_preset(get_preset("turboquant"), 64)
    x = torch.randn(1, 1, 4, 64)
    x[0, 0, 2] *= 1e5
    store.append(x, x)
    kf, _ = store.full()
    assert torch.equal(kf[0, 0, 2], x[0, 0, 2])
    assert store.nbytes().exact_tiles > 0


# --- bad input ------------------------------------------------------------------------------------------------


def test_bad_input_errors():
    x = torch.randn(2, 1, 64)
    with pytest.raises(ValueError, match="bit width"):
        TokenRTN(5, 64)
    with pytest.raises(ValueError, match="clip ratio"):
        TokenRTN(2, 64, clip=1.5)
    with pytest.raises(ValueError, match="clip ratio"):
        TokenRTN(2, 64, clip=0.0)
    with pytest.raises(ValueError, match="group must be positive"):
        TokenRTN(2, 64, group=0)
    with pytest.raises(ValueError, match="head_dim"):
        TokenRTN(2, 64).encode(torch.randn(2, 1, 32))
    with pytest.raises(ValueError, match="rank 3"):
        TokenRTN(2, 64).encode(torch.randn(1, 64))
    with pytest.raises(ValueError, match="NaN"):
        TokenRTN(2, 64).encode(x.clone().fill_(float("nan")))
    with pytest.raises(ValueError, match="G=128"):
        DenseSparseRTN(2, 64, "channel", 128).encode(x)
    with pytest.raises(ValueError, match="outlier fraction"):
        DenseSparseRTN(2, 64, "token", 1, fraction=0.0)
    with pytest.raises(ValueError, match="leaves no dense"):
        DenseSparseRTN(2, 64, "token", 1, fraction=0.999)
    with pytest.raises(ValueError, match="axis"):
        DenseSparseRTN(2, 64, "head", 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="even"):
        PolarKeyQuantizer(63)
    with pytest.raises(ValueError, match="whole bytes"):
        PolarKeyQuantizer(64, 3, 3, tile=4)
    with pytest.raises(ValueError, match="whole bytes"):
        TurboQuantizer(60, 3)
    with pytest.raises(ValueError, match="at least 2 bits"):
        TurboQuantizer(64, 1, qjl=True)
    with pytest.raises(ValueError, match="head_dim >= 2"):
        lloyd_max_codebook(1, 2)
    with pytest.raises(ValueError, match="promote ratio"):
        promoted_count(64, 1.5)
    with pytest.raises(ValueError, match="bit width"):
        KittyKeyQuantizer(64, bits=5)
    with pytest.raises(ValueError, match="multiple of the key group"):
        kivi_preset(2, 2, group=48)
    with pytest.raises(ValueError, match="outlier fraction"):
        outlier_count(1.5, 64)
