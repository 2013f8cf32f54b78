"""Attention over the packed cache (kvarn.attention) against an independent float64 oracle.

The oracle below dequantizes the stored fields itself (bit-by-bit unpacking from tests/reference/packing, (q a + z) t
in float64, Sylvester Hadamard from tests/reference) and runs softmax attention written plainly with an explicit GQA
head map. The packed path is checked twice:
  * float64 queries: the packed path then computes in float64 from the same stored fp16 scales and exact codes,
    so it must agree to rounding: |err| <= 1e-9 * (1 + max|V|) (measured ~1e-14; the bound leaves room for
    summation order over a few hundred terms);
  * float32 queries (what a model runs): the logits carry float32 rounding of order eps32 * sum_d |q_d k_d|, a
    probability moves by about that much in relative terms, and the output is a convex combination of values, so
    |err| <= 64 * eps32 * (1 + L) * (1 + max|V|) with L the largest sum_d |q_d k_d| * scaling of the inputs.
"""

from __future__ import annotations

import pytest
import torch

import kvarn.attention.packed as packed_mod
from kvarn.attention import kvarn_attention_forward, packed_attention, reference_from_past
from kvarn.presets import CachePolicy, Preset, get_preset
from kvarn.quant.affine import AffineConfig, AffineQuantizer
from kvarn.quant.base import Identity
from tests.helpers import (
    build_past,
    dequant_f64,
    fresh,
    logit_l1,
    make_inputs,
    nonfinite_case,
    opposite_heads,
    oracle,
    padding_mask,
)
from tests.reference.data import real_kv
from tests.reference.packing import unpack_tensor
from tests.tolerances import ATTN_F32, ATTN_F64_REL

# Stores built here without queries (and Gemma2's "eager" attention, which observes none) choose the kvarn-auto
# key rotation by unweighted squared error, as kvarn.quant.policy documents; its warning says so on every tile.
pytestmark = pytest.mark.filterwarnings("ignore:kvarn. key tiles stored before any query:UserWarning")


# -- the oracle -------------------------------------------------------------------------------------------------
def check(q, k_new, v_new, past, ok, scaling=None, softcap=None, mask=None):
    """Packed path (float64 and float32 queries) against the oracle; returns the float32 error."""
    d = q.shape[-1]
    scaling = d ** -0.5 if scaling is None else scaling
    mask = ok if mask is None else mask
    ref = oracle(q, k_new, v_new, past, ok, scaling, softcap)
    kp = dequant_f64(past.keys) if past is not None else None
    vp = dequant_f64(past.values) if past is not None else None
    kall = k_new.double() if kp is None else torch.cat([kp, k_new.double()], 2)
    vmax = float(v_new.abs().max()) if vp is None else max(float(vp.abs().max()), float(v_new.abs().max()))
    out64 = packed_attention(q.double(), k_new, v_new, past, mask, scaling, softcap)
    assert out64.shape == ref.shape and out64.dtype == torch.float64
    err64 = (out64 - ref).abs().max().item()
    assert err64 <= ATTN_F64_REL * (1 + vmax), err64
    out32 = packed_attention(q.float(), k_new, v_new, past, mask, scaling, softcap)
    assert out32.dtype == torch.float32
    err32 = (out32.double() - ref).abs().max().item()
    bound = ATTN_F32 * (1 + logit_l1(q, kall, scaling)) * (1 + vmax)
    assert err32 <= bound, (err32, bound)
    return err32


# -- tests ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["gauss", "heavy"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("preset", ["kvarn-k2v2-g64", "kvarn-auto-k4v2-g64", "rtn-k2v2-g64", "varn-k4v4-g128"])
def test_packed_matches_oracle(preset, d, kind, seed):
    """GQA ratios 1, 3, 7 over one stored past; a decode step and a chunk of 5 queries; row 1 left-padded."""
    gen = torch.Generator().manual_seed(seed)
    b, hkv = 2, 2
    g = get_preset(preset).tile
    t = 16 + 3 * g + int(torch.randint(1, g, (1,), generator=gen))  # sink, 3 tiles, a partial tail
    k, v = make_inputs(kind, b, hkv, t, d, gen), make_inputs(kind, b, hkv, t, d, gen)
    past = build_past(preset, k, v, sink=16)
    assert past.keys.n_tiles == 3 and past.keys.tail_len > 0
    for groups in (1, 3, 7):
        for length in (1, 5):  # causal inside the chunk of 5
            q = make_inputs(kind, b, hkv * groups, length, d, gen)
            kn, vn = make_inputs(kind, b, hkv, length, d, gen), make_inputs(kind, b, hkv, length, d, gen)
            ok = padding_mask([0, 7], length, t + length)
            check(q, kn, vn, past, ok)


@pytest.mark.parametrize("preset", ["kvarn-k2v2-g64", "kvarn-auto-k2v2-g64", "rtn-k4v2-g64"])
def test_many_query_rows_decode_order_matches_oracle(preset, seed, monkeypatch):
    """Prefill chunks (more than FOLD_MAX_ROWS query rows per KV head) decode the tiles and multiply, instead of
    folding the scales into the query: same oracle, same tolerances; forcing either order on a small chunk agrees."""
    gen = torch.Generator().manual_seed(seed)
    b, hkv, d, t = 1, 2, 64, 16 + 4 * 64 + 9
    outliers, heavy = opposite_heads(gen, t, d)  # kvarn-auto: plain and rotated tiles both present
    k, v = torch.cat([outliers, heavy], dim=1), make_inputs("heavy", b, hkv, t, d, gen)
    past = build_past(preset, k, v, sink=16)
    length = packed_mod.FOLD_MAX_ROWS // 7 + 3  # 7 query heads per KV head: more rows than FOLD_MAX_ROWS
    q = make_inputs("heavy", b, hkv * 7, length, d, gen)
    kn, vn = make_inputs("heavy", b, hkv, length, d, gen), make_inputs("heavy", b, hkv, length, d, gen)
    check(q, kn, vn, past, padding_mask([0], length, t + length))
    q, kn, vn = fresh(gen, b, hkv * 3, hkv, 5, d)
    ok = padding_mask([0], 5, t + 5)
    folded = packed_attention(q.double(), kn, vn, past, ok)
    monkeypatch.setattr(packed_mod, "FOLD_MAX_ROWS", 0)
    decoded = packed_attention(q.double(), kn, vn, past, ok)
    check(q, kn, vn, past, ok)
    torch.testing.assert_close(decoded, folded, atol=1e-9, rtol=1e-9)  # float64 queries: both orders exact to ~1e-15


def test_auto_rotation_mixed_flags(seed):
    """kvarn-auto with heads that favour opposite choices: outlier channels (plain) and heavy tails (rotated)."""
    gen = torch.Generator().manual_seed(seed)
    t, d = 8 + 4 * 64 + 9, 64
    outliers, heavy = opposite_heads(gen, t, d)
    k = torch.cat([outliers, heavy], dim=1)
    v = make_inputs("heavy", 1, 2, t, d, gen)
    past = build_past("kvarn-auto-k2v2-g64", k, v, sink=8)
    flags = past.keys.packed.rotated.bool()
    assert flags.any() and not flags.all(), flags  # both kinds of tiles are present
    q = make_inputs("heavy", 1, 6, 2, d, gen)
    check(q, torch.randn(1, 2, 2, d, generator=gen), torch.randn(1, 2, 2, d, generator=gen), past,
          padding_mask([0], 2, t + 2))


@pytest.mark.parametrize("key_cfg,value_cfg", [
    (AffineConfig(2, "token", "hadamard", True, tile=32), AffineConfig(2, "channel", "auto", True, tile=32)),
    (AffineConfig(4, "token", "none", False, tile=32), AffineConfig(4, "channel", "hadamard", False, tile=32)),
    (AffineConfig(3, "channel", "auto", False, tile=32), AffineConfig(8, "token", "none", True, tile=32)),
])
def test_other_orientations(key_cfg, value_cfg, seed):
    """Keys per token and values per channel (the two folds the KVarN presets do not use), 3- and 8-bit codes."""
    gen = torch.Generator().manual_seed(seed)
    preset = Preset("test-orient", "", lambda _: AffineQuantizer(key_cfg), lambda _: AffineQuantizer(value_cfg),
                    CachePolicy(tile=32, sink=4))
    t, d = 4 + 5 * 32 + 3, 64
    k, v = make_inputs("heavy", 2, 3, t, d, gen), make_inputs("gauss", 2, 3, t, d, gen)
    past = build_past(preset, k, v, sink=4)
    q = make_inputs("gauss", 2, 9, 3, d, gen)
    check(q, torch.randn(2, 3, 3, d, generator=gen), torch.randn(2, 3, 3, d, generator=gen), past,
          padding_mask([3, 0], 3, t + 3))


@pytest.mark.parametrize("preset", ["identity", "kivi-k2v2-g32", "quarot-k2v2", "turboquant-k3v3", "kvquant-k2v2-1pct",
                                    "polarquant-k4v2", "kitty-k2v2-g128"])
def test_fallback_for_other_quantizers(preset, seed):
    """Quantizers that are not affine are decoded chunk by chunk inside the same softmax (values on a sliding
    window for KIVI/Kitty, per-token tiles of 1 for QuaRot/TurboQuant)."""
    gen = torch.Generator().manual_seed(seed)
    if preset == "identity":
        preset = Preset("test-identity", "", lambda _: Identity(64), lambda _: Identity(64),
                        CachePolicy(tile=64, sink=8))
    t, d = 8 + 2 * 128 + 40, 64
    k, v = make_inputs("heavy", 1, 2, t, d, gen), make_inputs("gauss", 1, 2, t, d, gen)
    past = build_past(preset, k, v, sink=8)
    assert past.keys.n_tiles > 0
    q = make_inputs("gauss", 1, 6, 2, d, gen)
    check(q, torch.randn(1, 2, 2, d, generator=gen), torch.randn(1, 2, 2, d, generator=gen), past,
          padding_mask([0], 2, t + 2))


def test_masks_none_float_and_softcap(seed):
    """None = causal bottom-right aligned; an additive float mask equals the boolean one; softcap is applied."""
    gen = torch.Generator().manual_seed(seed)
    t, d = 8 + 2 * 64 + 5, 64
    past = build_past("kvarn-k2v2-g64", make_inputs("gauss", 1, 2, t, d, gen), make_inputs("gauss", 1, 2, t, d, gen), 8)
    q, kn, vn = fresh(gen, 1, 6, 2, 4, d)
    ok = padding_mask([0], 4, t + 4)
    check(q, kn, vn, past, ok, mask=None)
    additive = torch.zeros(ok.shape).masked_fill(~ok, torch.finfo(torch.float32).min)
    check(q, kn, vn, past, ok, mask=additive)
    check(q * 8, kn, vn, past, ok, softcap=5.0)
    check(q, kn, vn, past, ok, scaling=0.3)


def test_fully_masked_rows_give_zero_like_sdpa(seed):
    gen = torch.Generator().manual_seed(seed)
    d = 64
    q, k, v = fresh(gen, 1, 3, 1, 3, d)
    ok = torch.tensor([[False, False, False], [True, False, False], [True, True, True]]).view(1, 1, 3, 3)
    out = packed_attention(q, k, v, None, ok)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k.expand(1, 3, 3, d), v.expand(1, 3, 3, d),
                                                            attn_mask=ok).transpose(1, 2)
    assert torch.all(out[:, 0] == 0)
    torch.testing.assert_close(out, sdpa, atol=1e-6, rtol=1e-5)


def test_exact_tiles_non_finite(seed):
    """A NaN in one stored tile of one (row, head): that tile is kept exact; only that head's outputs become
    NaN (as full-precision attention would), every other head still matches the oracle."""
    q, kn, vn, past, ok, ref, bad = nonfinite_case(seed)
    out = packed_attention(q.double(), kn, vn, past, ok)
    torch.testing.assert_close(out, ref, equal_nan=True, atol=1e-9, rtol=1e-9)
    assert (~out[:, 0].isfinite()).any(-1).eq(bad).all()


def test_chunking_gives_the_same_result(seed, monkeypatch):
    """Small chunk budgets force several tile chunks and query chunks: same result."""
    gen = torch.Generator().manual_seed(seed)
    t, d = 16 + 6 * 64 + 7, 64
    k, v = make_inputs("heavy", 1, 2, t, d, gen), make_inputs("heavy", 1, 2, t, d, gen)
    for preset in ("kvarn-auto-k2v2-g64", "quarot-k2v2"):
        past = build_past(preset, k, v, sink=16)
        q, kn, vn = fresh(gen, 1, 6, 2, 9, d)
        ok = padding_mask([0], 9, t + 9)
        whole = packed_attention(q.double(), kn, vn, past, ok)
        monkeypatch.setattr(packed_mod, "TILE_CHUNK_ELEMENTS", 2 * 64 * 64 * 20)
        monkeypatch.setattr(packed_mod, "LOGIT_CHUNK_ELEMENTS", 6 * (t + 9) * 2)
        chunked = packed_attention(q.double(), kn, vn, past, ok)
        monkeypatch.undo()
        torch.testing.assert_close(chunked, whole, atol=1e-12, rtol=1e-12)


def test_reference_module_matches_oracle(seed):
    """kvarn.attention.reference (what non-kvarn implementations effectively compute) agrees with the oracle
    to the float32 decode rounding of the quantizer (AffineQuantizer.decode works in float32)."""
    gen = torch.Generator().manual_seed(seed)
    t, d = 8 + 2 * 64 + 3, 64
    past = build_past("kvarn-k2v2-g64", make_inputs("heavy", 1, 2, t, d, gen), make_inputs("gauss", 1, 2, t, d, gen), 8)
    q, kn, vn = fresh(gen, 1, 6, 2, 2, d)
    ok = padding_mask([0], 2, t + 2)
    ref = oracle(q, kn, vn, past, ok, d ** -0.5)
    got = reference_from_past(q, kn, vn, past, ok)
    vmax = float(dequant_f64(past.values).abs().max())
    assert (got - ref).abs().max() <= ATTN_F32 * (1 + vmax) * (1 + logit_l1(q, dequant_f64(past.keys), d ** -0.5))


def test_attention_function_without_past_is_sdpa(seed):
    """No attached past (empty cache, sliding layers, other caches): transformers' SDPA; with softcap: exact path."""
    gen = torch.Generator().manual_seed(seed)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 3, True
    q, k, v = fresh(gen, 2, 6, 2, 7, 64)
    ok = padding_mask([0, 2], 7, 7)
    out, w = kvarn_attention_forward(module, q, k, v, ok, scaling=0.125)
    assert w is None
    torch.testing.assert_close(out.double(), oracle(q, k, v, None, ok, 0.125), atol=1e-5, rtol=1e-5)
    out, _ = kvarn_attention_forward(module, q, k, v, ok, scaling=0.125, softcap=2.0)
    torch.testing.assert_close(out.double(), oracle(q, k, v, None, ok, 0.125, softcap=2.0), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_unpack_codes_to_float(bits, seed):
    """ops.unpack_codes(dtype=float) (the int32-word read used here) equals the bit-by-bit oracle, also on the
    strided tile slices the attention reads."""
    from kvarn.ops.packing import unpack_codes

    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (2, 3, 5, 7, 24), generator=gen, dtype=torch.uint8)
    for part in (data, data[:, :, 1:4], data[:, :, :, :, 4:16], data[..., 1:13]):
        want = unpack_tensor(part, bits)
        for dtype in (torch.float32, torch.float64, torch.uint8):
            got = unpack_codes(part, bits, dtype=dtype)
            assert got.dtype == dtype and torch.equal(got.long(), want)


def test_bad_inputs():
    q, k, v = torch.randn(1, 5, 1, 64), torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64)
    with pytest.raises(ValueError, match="not a multiple"):
        packed_attention(q, k, v, None)
    with pytest.raises(ValueError, match="does not fit"):
        packed_attention(torch.randn(1, 4, 1, 64), k, v, None, torch.ones(1, 1, 1, 3, dtype=torch.bool))
    module = torch.nn.Module()
    module.training = True
    with pytest.raises(ValueError, match="dropout"):
        kvarn_attention_forward(module, torch.randn(1, 4, 1, 64), k, v, None, dropout=0.1)


@pytest.mark.model
def test_real_activations(real_model, monkeypatch, seed):
    """Queries, fresh K/V, stored past and masks captured from the real model running the kvarn preset under
    attn_implementation "kvarn" (a 128-token sink, tiles, a tail, a 7-token chunk, then a decode step)."""
    from kvarn.eval.text import load_tokens
    from kvarn.integrations.transformers import KVarNCache

    model, tok = real_model
    captured = []
    real = packed_mod.packed_attention

    def record(query, key, value, past, attention_mask=None, scaling=None, softcap=None):
        if past is not None:
            captured.append((query, key, value, past, attention_mask, scaling, softcap))
        return real(query, key, value, past, attention_mask, scaling, softcap)

    monkeypatch.setattr(packed_mod, "packed_attention", record)
    ids = load_tokens(tok, None, 128 + 2 * 128 + 57 + 8, offset_chars=int(torch.randint(0, 20000, (1,))))
    cache = KVarNCache(model.config, "kvarn-auto-k2v2-g128")
    before = model.config._attn_implementation
    try:
        model.set_attn_implementation("kvarn")
        with torch.no_grad():
            model(ids[:, :-8], cache=cache)
            model(ids[:, -8:-1], cache=cache)  # a chunk of 7 queries on a filled cache
            model(ids[:, -1:], cache=cache)
    finally:
        model.set_attn_implementation(before)
    assert len(captured) == 2 * model.config.num_hidden_layers
    for i in (0, 1, 14, 29, 30, 44, 59):  # layers of the chunk step, then of the decode step
        query, key, value, past, mask, scaling, softcap = captured[i]
        assert past.keys.n_tiles == 2 and past.keys.sink_len == 128
        ok = mask if mask is not None else padding_mask([0], query.shape[2], past.length + key.shape[2])
        check(query, key, value, past, ok, scaling, softcap, mask=mask)


@pytest.mark.model
def test_real_kv_decode(seed):
    """Real post-RoPE K/V of the embedded model (several layers) as the stored past, random queries."""
    k, v = real_kv(256 + 64 + 11)
    gen = torch.Generator().manual_seed(seed)
    layer = int(torch.randint(0, k.shape[0], (1,), generator=gen))
    kk, vv = k[layer:layer + 1, :, :-1], v[layer:layer + 1, :, :-1]  # [1, 3, T, 64]
    past = build_past(get_preset("kvarn-k2v2-g64").replace(sink=32), kk, vv, sink=32)
    q = torch.randn(1, 9, 1, 64, generator=gen) * kk.std()
    check(q, k[layer:layer + 1, :, -1:], v[layer:layer + 1, :, -1:], past, padding_mask([0], 1, kk.shape[2] + 1))
