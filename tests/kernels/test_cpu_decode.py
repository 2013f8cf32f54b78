"""The fused CPU decode kernel (kvarn.kernels.cpu, the fast path of packed_attention) against the float64 oracle.

The oracle is tests/helpers.py's: it dequantizes the stored fields itself (bit-by-bit unpacking, (q a + z) t in float64,
Sylvester Hadamard) and runs plain softmax attention with an explicit GQA head map. KVARN_KERNEL=cpu makes every
step here take the kernel (a step it cannot serve raises instead of falling back).

Tolerance (float32 queries): the kernel accumulates in float32 in a different order from the PyTorch path but with
the same kind of terms. A logit is sum_d q~_d (a_d code + z_d) t_g, each product and partial sum rounded: its error is
at most ~D * eps32 * sum_d |q_d k_d| (the rotation q~ = q H adds eps32 * sqrt(D) * |q| |k|, of the same order), and
in practice the accumulated rounding stays within a few tens of eps32 of L = max sum_d |q_d k_d| * scaling. A
probability then moves by that much in relative terms; the online rescaling exp(m_old - m_new) and the split combine
add a few eps32 relative each, and the exponential of the kernel has relative error < 1e-8. The output is a convex
combination of values, so |err| <= 64 * eps32 * (1 + L) * (1 + max|V|), test_attention's bound. bf16/fp16 inputs add
the rounding of the output to that dtype: half an ulp, eps_dtype / 2 * max|out|.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest
import torch

import kvarn.attention.launch as decode_mod
import kvarn.kernels.cpu.build as build_mod
from kvarn.attention import KVarNPast, packed_attention
from kvarn.attention import fused as fused_mod
from kvarn.kernels import PackedTiles, decode_attention
from kvarn.ops.widths import unpack_widths
from kvarn.presets import CachePolicy, Preset, get_preset
from kvarn.quant.affine import AffineConfig, AffineQuantizer
from kvarn.quant.tiles import AffineTiles
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
from tests.reference.data import heavy_tailed, real_kv
from tests.tolerances import ATTN_F32

pytestmark = pytest.mark.filterwarnings("ignore:kvarn. key tiles stored before any query:UserWarning")


@pytest.fixture(autouse=True)
def kernel_only(monkeypatch):
    if not fused_mod.kernel.available():
        pytest.skip(f"the CPU kernel cannot be built here: {build_mod.error()}")
    monkeypatch.setenv("KVARN_KERNEL", "cpu")


def check_kernel(q, kn, vn, past, ok, scaling=None, softcap=None, mask=None) -> float:
    """packed_attention (through the kernel) vs the oracle, with the bound of the module docstring."""
    d = q.shape[-1]
    scaling = d ** -0.5 if scaling is None else scaling
    ref = oracle(q, kn, vn, past, ok, scaling, softcap)
    out = packed_attention(q, kn, vn, past, ok if mask is None else mask, scaling, softcap)
    assert out.dtype == q.dtype and out.shape == ref.shape
    kall = torch.cat([dequant_f64(past.keys), kn.double()], 2)
    vmax = max(float(dequant_f64(past.values).abs().max()), float(vn.abs().max()))
    bound = ATTN_F32 * (1 + logit_l1(q, kall, scaling)) * (1 + vmax)
    if q.dtype != torch.float32:
        bound += torch.finfo(q.dtype).eps / 2 * float(ref.abs().max())
    err = (out.double() - ref).abs().max().item()
    assert err <= bound, (err, bound)
    return err


CASES = [("kvarn-k2v2-g64", d) for d in (64, 96, 128, 256)] + \
    [("kvarn-auto-k4v2-g64", d) for d in (64, 96, 256)] + \
    [("rtn-k2v2-g64", 64), ("rtn-k2v2-g64", 36), ("varn-k4v4-g128", 128), ("kvarn-k2v2-g128-fp8", 128),
     ("kvarn-k4v4-g64", 96)] + \
    [("kvarn-w2.5", d) for d in (64, 128)]
# 36: dense-row dot products with a scalar tail, value code rows of 9 bytes (scalar path); kvarn-w2.5: key rows at
# their own widths (1-4 bits, G = 128)


@pytest.mark.parametrize("preset,d", CASES)
def test_kernel_matches_oracle(preset, d, seed):
    """GQA ratios 1, 3, 4 over one past of 3 batch rows (row 1 padded inside the sink, row 2 into the first tile),
    heavy-tailed K/V; a decode step and a causal chunk of 3 queries."""
    gen = torch.Generator().manual_seed(seed)
    b, hkv = 3, 2
    g = get_preset(preset).tile
    t = 16 + 3 * g + int(torch.randint(1, g, (1,), generator=gen))  # sink, 3 tiles, a partial tail
    k, v = make_inputs("heavy", b, hkv, t, d, gen), make_inputs("gauss", b, hkv, t, d, gen)
    past = build_past(preset, k, v, sink=16)
    assert past.keys.n_tiles == 3
    if past.keys.packed.row_widths is not None:  # every width, so each block of the layout is read
        assert set(unpack_widths(past.keys.packed.row_widths).unique().tolist()) == set(range(5))
    for groups in (1, 3, 4):
        for length in (1, 3):
            q = make_inputs("heavy", b, hkv * groups, length, d, gen)
            kn, vn = make_inputs("heavy", b, hkv, length, d, gen), make_inputs("gauss", b, hkv, length, d, gen)
            check_kernel(q, kn, vn, past, padding_mask([0, 5, 16 + g // 2], length, t + length))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(dtype, seed):
    """A model running in bf16/fp16: stored from those K/V (sink and tail kept in that dtype), queries too."""
    gen = torch.Generator().manual_seed(seed)
    t, d = 8 + 3 * 64 + 21, 128
    k, v = (make_inputs("gauss", 2, 2, t, d, gen).to(dtype) for _ in range(2))
    past = build_past("kvarn-auto-k2v2-g64", k, v, sink=8)
    q = make_inputs("gauss", 2, 8, 1, d, gen).to(dtype)
    kn, vn = (make_inputs("gauss", 2, 2, 1, d, gen).to(dtype) for _ in range(2))
    check_kernel(q, kn, vn, past, padding_mask([0, 3], 1, t + 1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_dense_rows_read_as_they_are(dtype, seed):
    """Dense segments (sink, tail, fresh rows) handed to the kernel in fp16/bf16 are widened row by row inside it.
    Widening a 16-bit float to float32 is exact, so the result must equal, bit for bit, the same call with the rows
    converted to float32 beforehand (the arithmetic after the load is the same)."""
    gen = torch.Generator().manual_seed(seed)
    b, hkv, d, g, n = 2, 2, 64, 64, 3
    k, v = make_inputs("heavy", b, hkv, n * g, d, gen), make_inputs("gauss", b, hkv, n * g, d, gen)
    past = build_past("kvarn-k2v2-g64", k, v, sink=0)
    q = make_inputs("gauss", b, 3 * hkv, 1, d, gen)
    rows = [tuple(make_inputs("heavy", b, hkv, t, d, gen).to(dtype) for _ in range(2)) for t in (16, 9, 1)]
    pos = [0, 16 + n * g, 25 + n * g]  # sink | tiles | tail | fresh
    table, count = torch.arange(n, dtype=torch.int32).expand(b, n), torch.full((b,), n, dtype=torch.int32)

    def call(dense):
        return decode_attention(q, PackedTiles.cache(past.keys.packed),
                                PackedTiles.cache(past.values.packed), table, count, g,
                                dense=dense, tiles_pos=16, splits=2)

    native = call([(kk, vv, p) for (kk, vv), p in zip(rows, pos)])
    widened = call([(kk.float(), vv.float(), p) for (kk, vv), p in zip(rows, pos)])
    assert torch.equal(native, widened)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_indexed_rows_read_in_place(dtype, seed, monkeypatch):
    """Rows read through an index (`paged=`: vLLM's fp slots [N, H, R, D], row ids n * R + r, keys and values from
    different places, rows shared between batch rows) equal, bit for bit, the same rows gathered into a dense segment
    at the same position (same arithmetic, same order); the seat's reference (kvarn.ops.decode) agrees to float32
    rounding, ids outside the rows are refused before the kernel reads them, and rows the bias masks (padding, here
    non-finite) change nothing."""
    from kvarn.ops.decode import packed_decode_reference

    gen = torch.Generator().manual_seed(seed)
    b, hkv, d, g, n, t = 3, 2, 64, 64, 2, 70
    k, v = make_inputs("heavy", b, hkv, n * g, d, gen), make_inputs("gauss", b, hkv, n * g, d, gen)
    past = build_past("kvarn-auto-k2v2-g64", k, v, sink=0)
    q = make_inputs("gauss", b, 3 * hkv, 1, d, gen)
    rows = make_inputs("heavy", 5, hkv, 48, d, gen).to(dtype)  # [N, H, R, D]
    index = torch.randint(0, 5 * 48, (b, 2, t), generator=gen)
    index[1] = index[0]  # two batch rows reading the same rows
    table, count = torch.arange(n, dtype=torch.int32).expand(b, n), torch.tensor([2, 1, 2], dtype=torch.int32)
    bias = torch.zeros(b, 1, 1, n * g + t)
    bias[2, ..., n * g + 50:] = float("-inf")  # padding, as the batched decode masks it
    keys, values = PackedTiles.cache(past.keys.packed), PackedTiles.cache(past.values.packed)

    def call(**kw):
        return decode_attention(q, keys, values, table, count, g, tiles_pos=0, bias=bias, splits=2, **kw)

    inplace = call(paged=(rows, index, n * g))
    got = rows[index // 48, :, index % 48]  # [B, 2, t, H, D]
    gathered = call(dense=[(got[:, 0].transpose(1, 2), got[:, 1].transpose(1, 2), n * g)])
    assert torch.equal(inplace, gathered)
    seen = []
    real = decode_mod.SEAT
    with monkeypatch.context() as m:  # the seat's arguments as the call passes them
        m.setattr(decode_mod, "SEAT", lambda *a: seen.append(a) or real(*a))
        call(paged=(rows, index, n * g))
    ref, kern = packed_decode_reference(*seen[0])[0], real(*seen[0])[0]
    assert float((ref - kern).abs().max()) <= 1e-5 * (1 + float(ref.abs().max()))
    bad = index.clone()
    bad[0, 1, 3] = 5 * 48
    with pytest.raises(ValueError, match="outside"):
        call(paged=(rows, bad, n * g))
    with pytest.raises(ValueError, match="int64"):
        call(paged=(rows, index.int(), n * g))
    poisoned = torch.cat([rows, torch.full_like(rows[:1], float("nan"))])  # block 5: NaN rows
    pidx = index.clone()
    pidx[2, :, 50:] = 5 * 48 + torch.arange(t - 50)  # the masked padding reads NaN rows: skipped, never read
    assert torch.equal(call(paged=(poisoned, pidx, n * g)), inplace)


def test_auto_rotation_mixed_flags(seed):
    """kvarn-auto with heads that favour opposite choices: both rotated and plain key and value tiles."""
    gen = torch.Generator().manual_seed(seed)
    t, d = 8 + 6 * 64 + 9, 64
    outliers, heavy = opposite_heads(gen, t, d)
    k = torch.cat([outliers, heavy], dim=1)
    v = torch.cat([heavy_tailed(1, 1, t, d, generator=gen, df=2).float(), outliers * 0.1], dim=1)
    past = build_past("kvarn-auto-k2v2-g64", k, v, sink=8)
    for view in (past.keys, past.values):
        flags = view.packed.rotated.bool()
        assert flags.any() and not flags.all(), flags
    q = make_inputs("heavy", 1, 6, 1, d, gen)
    check_kernel(q, torch.randn(1, 2, 1, d, generator=gen), torch.randn(1, 2, 1, d, generator=gen), past,
                 padding_mask([0], 1, t + 1))


def test_other_bit_widths_and_tile_sizes(seed):
    """8-bit keys and 1-bit values (kernel widths 8 and 1), tiles of 32 tokens (rows of 8 bytes: the 8-lane path) and
    D = 96 (2-bit value rows of 24 bytes), a 1-bit key tile of 4-byte rows (the scalar path), and 3-bit codes (groups
    of 8 codes in 3 bytes, not planes) for keys (auto, rows of 12 bytes) and values (D = 96: rows of 36 bytes)."""
    gen = torch.Generator().manual_seed(seed)
    cfgs = [(AffineConfig(8, "channel", "hadamard", True, tile=32), AffineConfig(1, "token", "auto", True, tile=32)),
            (AffineConfig(2, "channel", "none", True, tile=32), AffineConfig(2, "token", "hadamard", False, tile=32)),
            (AffineConfig(1, "channel", "auto", False, tile=32), AffineConfig(4, "token", "none", True, tile=32)),
            (AffineConfig(3, "channel", "auto", True, tile=32), AffineConfig(3, "token", "hadamard", True, tile=32))]
    for kc, vc in cfgs:
        preset = Preset("test-bits", "", lambda _, c=kc: AffineQuantizer(c), lambda _, c=vc: AffineQuantizer(c),
                        CachePolicy(tile=32, sink=4))
        t, d = 4 + 5 * 32 + 3, 96
        k, v = make_inputs("heavy", 2, 3, t, d, gen), make_inputs("gauss", 2, 3, t, d, gen)
        past = build_past(preset, k, v, sink=4)
        q = make_inputs("gauss", 2, 9, 2, d, gen)
        check_kernel(q, torch.randn(2, 3, 2, d, generator=gen), torch.randn(2, 3, 2, d, generator=gen), past,
                     padding_mask([3, 0], 2, t + 2))


def test_softcap_float_mask_and_scaling(seed, monkeypatch):
    gen = torch.Generator().manual_seed(seed)
    t, d = 8 + 2 * 64 + 5, 64
    past = build_past("kvarn-k2v2-g64", make_inputs("gauss", 1, 2, t, d, gen), make_inputs("gauss", 1, 2, t, d, gen), 8)
    q, kn, vn = fresh(gen, 1, 6, 2, 4, d)
    ok = padding_mask([0], 4, t + 4)
    check_kernel(q, kn, vn, past, ok, mask=None)  # None = causal
    additive = torch.zeros(ok.shape).masked_fill(~ok, torch.finfo(torch.float32).min)
    additive[..., 20:40] += 0.7  # a real additive bias, not only 0 / masked
    ref = oracle(q, kn, vn, past, ok, d ** -0.5)
    monkeypatch.setenv("KVARN_KERNEL", "torch")
    ref_bias = packed_attention(q.double(), kn, vn, past, additive)  # the PyTorch path in float64
    monkeypatch.setenv("KVARN_KERNEL", "cpu")
    assert (ref_bias - ref).abs().max() > 1e-3  # the bias matters
    got = packed_attention(q, kn, vn, past, additive)
    torch.testing.assert_close(got.double(), ref_bias, atol=1e-5, rtol=1e-5)
    check_kernel(q * 8, kn, vn, past, ok, softcap=5.0)
    check_kernel(q, kn, vn, past, ok, scaling=0.3)


def test_exact_tiles_non_finite(seed):
    """A NaN key tile (its value tile packed) and an Inf value tile (its key tile packed): the tile is exact for both;
    only the heads that read them become NaN, every other head matches the oracle."""
    q, kn, vn, past, ok, ref, bad = nonfinite_case(seed)
    d = q.shape[-1]
    out = packed_attention(q, kn, vn, past, ok)
    assert (~out[:, 0].isfinite()).any(-1).eq(bad).all()
    good = ~bad.unsqueeze(1).unsqueeze(-1).expand_as(out)
    finite = torch.nan_to_num(dequant_f64(past.values), nan=0.0, posinf=0.0, neginf=0.0)
    kall = torch.nan_to_num(torch.cat([dequant_f64(past.keys), kn.double()], 2), nan=0.0)
    bound = ATTN_F32 * (1 + logit_l1(q, kall, d ** -0.5)) * (1 + float(finite.abs().max()))
    assert (out.double() - ref)[good].abs().max() <= bound


def _pool(fields: AffineTiles, perm: torch.Tensor) -> AffineTiles:
    """[B, H, n, ...] -> a paged pool [B*n, H, ...] where tile (b, j) sits in block perm[b*n + j]."""
    def paged(f: torch.Tensor) -> torch.Tensor:
        b, h, n = f.shape[:3]
        flat = f.transpose(1, 2).reshape(b * n, h, *f.shape[3:])  # [(b, j), H, ...]
        pool = torch.empty_like(flat)
        pool[perm] = flat
        return pool

    return fields.map(paged)


def test_block_table_paged_pool(seed):
    """The public entry point on a permuted pool [num_blocks, H, ...] with ragged n_blocks per row equals the cache
    layout call bit for bit (same arithmetic), and the oracle over each row's own tiles."""
    gen = torch.Generator().manual_seed(seed)
    b, hkv, d, g, n = 3, 2, 64, 64, 5
    t = n * g
    k, v = make_inputs("heavy", b, hkv, t, d, gen), make_inputs("gauss", b, hkv, t, d, gen)
    past = build_past("kvarn-auto-k2v2-g64", k, v, sink=0)
    perm = torch.randperm(b * n, generator=gen)
    table = perm.view(b, n).to(torch.int32)
    n_blocks = torch.tensor([5, 3, 4], dtype=torch.int32)
    q = make_inputs("gauss", b, 3 * hkv, 1, d, gen)
    fresh = (torch.randn(b, hkv, 1, d, generator=gen), torch.randn(b, hkv, 1, d, generator=gen))
    pooled = decode_attention(q, PackedTiles.pool(_pool(past.keys.packed, perm)),
                              PackedTiles.pool(_pool(past.values.packed, perm)), table,
                              n_blocks, g, dense=[(*fresh, t)], splits=2)
    cached = decode_attention(q, PackedTiles.cache(past.keys.packed),
                              PackedTiles.cache(past.values.packed),
                              torch.arange(n, dtype=torch.int32).expand(b, n), n_blocks, g, dense=[(*fresh, t)],
                              splits=2)
    assert torch.equal(pooled, cached)
    bad = table.clone()
    bad[1, 2] = b * n  # one past the pool
    with pytest.raises(ValueError, match="outside"):
        decode_attention(q, PackedTiles.pool(_pool(past.keys.packed, perm)),
                         PackedTiles.pool(_pool(past.values.packed, perm)), bad, n_blocks, g)
    with pytest.raises(ValueError, match="must end in"):  # value fields passed as keys: [G, D/4] rows, not [D, G/4]
        decode_attention(q[..., :g], PackedTiles.cache(past.values.packed),
                         PackedTiles.cache(past.values.packed),
                         torch.arange(n, dtype=torch.int32).expand(b, n), n_blocks, 32)
    with pytest.raises(ValueError, match="n_blocks"):
        decode_attention(q, PackedTiles.cache(past.keys.packed),
                         PackedTiles.cache(past.values.packed),
                         torch.arange(n, dtype=torch.int32).expand(b, n), n_blocks + 1, g)
    kd, vd = dequant_f64(past.keys), dequant_f64(past.values)
    for row in range(b):
        m = int(n_blocks[row]) * g
        ref = oracle(q[row:row + 1], torch.cat([kd[row:row + 1, :, :m], fresh[0][row:row + 1].double()], 2),
                     torch.cat([vd[row:row + 1, :, :m], fresh[1][row:row + 1].double()], 2), None,
                     torch.ones(1, 1, 1, m + 1, dtype=torch.bool), d ** -0.5)
        bound = ATTN_F32 * (1 + logit_l1(q[row:row + 1], kd[row:row + 1, :, :m], d ** -0.5)) * \
            (1 + float(vd.abs().max()))
        assert (pooled[row:row + 1].transpose(1, 2).double() - ref).abs().max() <= bound


def test_splits_combine_exactly(seed):
    """The split-K combination is exact algebra: 1, 3 and 7 splits agree to float32 rounding of the rescaling."""
    gen = torch.Generator().manual_seed(seed)
    t, d = 16 + 14 * 64 + 7, 64
    past = build_past("kvarn-k2v2-g64", make_inputs("heavy", 1, 3, t, d, gen), make_inputs("gauss", 1, 3, t, d, gen),
                      16)
    q = make_inputs("heavy", 1, 9, 1, d, gen)
    n = past.keys.n_tiles
    args = (q, PackedTiles.cache(past.keys.packed),
            PackedTiles.cache(past.values.packed),
            torch.arange(n, dtype=torch.int32).expand(1, n), torch.tensor([n], dtype=torch.int32), 64)
    outs = [decode_attention(*args, splits=s) for s in (1, 3, 7)]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], atol=1e-5 * float(outs[0].abs().max()), rtol=1e-5)


def test_fallbacks_are_explicit(seed, monkeypatch):
    """Steps the kernel does not serve take the PyTorch path under KVARN_KERNEL=auto and raise, naming the reason,
    under KVARN_KERNEL=cpu: float64 queries, prefill-sized chunks, keys per token, keys stored before RoPE. The
    PyTorch path under auto never calls the decode kernel and equals KVARN_KERNEL=torch's but for the tiles' decode:
    the tile decode kernel there gives the reference's butterfly, torch's dense H matmul sums in another order
    (float32 rounding: 1e-5)."""
    gen = torch.Generator().manual_seed(seed)
    t, d = 8 + 2 * 64 + 3, 64
    k, v = make_inputs("gauss", 1, 2, t, d, gen), make_inputs("gauss", 1, 2, t, d, gen)
    past = build_past("kvarn-k2v2-g64", k, v, sink=8)
    token_keys = Preset("test-tok", "", lambda _: AffineQuantizer(AffineConfig(2, "token", tile=64)),
                        lambda _: AffineQuantizer(AffineConfig(2, "token", tile=64)), CachePolicy(tile=64, sink=8))
    pre_rope = KVarNPast(dataclasses.replace(past.keys, post=lambda x, first: x), past.values)
    cases = [(torch.randn(1, 4, 1, d, generator=gen, dtype=torch.float64), past, "float64"),
             (torch.randn(1, 4, 17, d, generator=gen), past, "prefill"),
             (torch.randn(1, 4, 1, d, generator=gen), build_past(token_keys, k, v, sink=8), "per token"),
             (torch.randn(1, 4, 1, d, generator=gen), pre_rope, "before RoPE")]
    for q, p, why in cases:
        kn, vn = torch.randn(1, 2, q.shape[2], d, generator=gen), torch.randn(1, 2, q.shape[2], d, generator=gen)
        with pytest.raises(RuntimeError, match=why):
            packed_attention(q, kn, vn, p)
        monkeypatch.setenv("KVARN_KERNEL", "auto")
        with monkeypatch.context() as m:
            m.setattr(decode_mod, "SEAT", lambda *a, why=why: pytest.fail(f"{why}: the decode kernel was called"))
            out = packed_attention(q, kn, vn, p)
        monkeypatch.setenv("KVARN_KERNEL", "torch")
        tol = 0 if q.dtype == torch.float64 else 1e-5  # float64 tiles: no tile decode kernel (`decode_kernel`)
        torch.testing.assert_close(out, packed_attention(q, kn, vn, p), atol=tol, rtol=tol)  # the PyTorch path
        monkeypatch.setenv("KVARN_KERNEL", "cpu")
    monkeypatch.setenv("KVARN_KERNEL", "fast")
    with pytest.raises(ValueError, match="KVARN_KERNEL"):
        packed_attention(cases[0][0].float(), kn[:, :, :1], vn[:, :, :1], past)


def test_torch_path_stays_reachable(seed, monkeypatch):
    """KVARN_KERNEL=torch gives the PyTorch path's result; the kernel agrees with it to float32 rounding."""
    gen = torch.Generator().manual_seed(seed)
    t, d = 8 + 3 * 64 + 3, 64
    past = build_past("kvarn-k2v2-g64", make_inputs("gauss", 1, 3, t, d, gen), make_inputs("gauss", 1, 3, t, d, gen), 8)
    q, kn, vn = fresh(gen, 1, 9, 3, 1, d)
    fast = packed_attention(q, kn, vn, past)
    monkeypatch.setenv("KVARN_KERNEL", "torch")
    slow = packed_attention(q, kn, vn, past)
    assert not torch.equal(fast, slow)  # two different computations ...
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)  # ... of the same thing


def test_build_failure_warns_once(monkeypatch):
    """No compiler (or a failed build): load() returns None with ONE warning saying why; attention still works."""
    import torch.utils.cpp_extension as cpp

    def fail(**_):
        raise RuntimeError("Error building extension: c++: error: no such compiler")

    monkeypatch.setattr(build_mod, "_module", None)
    monkeypatch.setattr(build_mod, "_error", None)
    monkeypatch.setattr(cpp, "load", fail)
    with pytest.warns(UserWarning, match="could not be built.*no such compiler"):
        assert build_mod.load() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert build_mod.load() is None  # no second warning
    monkeypatch.setenv("KVARN_KERNEL", "auto")
    gen = torch.Generator().manual_seed(0)
    past = build_past("kvarn-k2v2-g64", torch.randn(1, 1, 200, 64, generator=gen),
                      torch.randn(1, 1, 200, 64, generator=gen), 8)
    out = packed_attention(torch.randn(1, 2, 1, 64, generator=gen), torch.randn(1, 1, 1, 64, generator=gen),
                           torch.randn(1, 1, 1, 64, generator=gen), past)
    assert out.isfinite().all()


@pytest.mark.model
def test_real_kv_decode(seed):
    """Real post-RoPE K/V of one layer of the embedded model (3 KV heads, head_dim 64) as the stored past, kvarn and
    kvarn-auto presets, GQA 3 as in the model, queries of the keys' scale."""
    k, v = real_kv(256 + 2 * 64 + 11)
    gen = torch.Generator().manual_seed(seed)
    layer = int(torch.randint(0, k.shape[0], (1,), generator=gen))
    kk, vv = k[layer:layer + 1, :, :-1], v[layer:layer + 1, :, :-1]  # [1, 3, T, 64]
    for preset in ("kvarn-k2v2-g64", "kvarn-auto-k2v2-g64"):
        past = build_past(get_preset(preset).replace(sink=32), kk, vv, sink=32)
        q = torch.randn(1, 9, 1, 64, generator=gen) * kk.std()
        check_kernel(q, k[layer:layer + 1, :, -1:], v[layer:layer + 1, :, -1:], past,
                     padding_mask([0], 1, kk.shape[2] + 1))


@pytest.mark.slow
def test_both_vector_widths_give_the_same_bits(tmp_path, monkeypatch):
    """The kernels' loops run in the CPU's vector width (kvarn/kernels/cpu/lanes.h: 16 float lanes with AVX-512, 8
    without), and sums whose order depends on lanes keep the order of 16. Built again at the other width
    (-DKVARN_VW: 8 on an AVX-512 CPU, generic 16-lane vectors elsewhere), every output of `kernel_outputs` (decode
    and tile store, 7 presets x 3 dtypes x 3 GQA ratios) is the same to the bit. Slow: one more build (~2 min)."""
    from torch.utils.cpp_extension import load as load_extension

    from tests.helpers import kernel_outputs

    mine = build_mod.load()
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    flags = next((ln for ln in cpuinfo if ln.startswith("flags")), "").split()
    other = 8 if "avx512f" in flags else 16
    variant = load_extension(name=f"kvarn_cpu_decode_vw{other}", sources=[str(s) for s in build_mod.SOURCES],
                             extra_cflags=[*build_mod.FLAGS, f"-DKVARN_VW={other}"], extra_ldflags=["-fopenmp"],
                             build_directory=str(tmp_path), verbose=False)
    assert variant is not mine
    a = kernel_outputs()
    monkeypatch.setattr(build_mod, "_module", variant)
    b = kernel_outputs()
    assert a.keys() == b.keys() and len(a) == 63
    differ = [key for key in a if not torch.equal(a[key], b[key])]
    assert not differ, f"{len(differ)} of {len(a)} outputs differ between {other} lanes and this CPU's: {differ[:5]}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_write_rows_matches_indexed_write(dtype, seed):
    """decode.cpp's `write_rows` (a serving step's fresh K/V rows into their fp slots) writes what the PyTorch indexed
    write does, bit for bit, from key/value views of one qkv tensor as vLLM hands them; bad indices are refused before
    anything is written, and another dtype is left to the caller."""
    from kvarn.kernels.cpu.decode import write_rows

    gen = torch.Generator().manual_seed(seed)
    n, h, r, d, t = 6, 3, 8, 64, 11
    share = torch.randn(n, h, r * d + 16, generator=gen).to(dtype)  # rows of a page, padded as a pool's share is
    rows = share[..., :r * d].unflatten(-1, (r, d))  # [N, H, R, D], strided
    qkv = torch.randn(t, (9 + 2 * h) * d, generator=gen).to(dtype)
    key = qkv[:, 9 * d:(9 + h) * d].view(t, h, d)
    value = qkv[:, (9 + h) * d:].view(t, h, d)
    tok = torch.tensor([4, 0, 9, 5])
    blk = torch.tensor([[0, 0], [2, 3], [5, 1], [4, 4]])
    sub = torch.tensor([[1, 5], [7, 0], [2, 2], [0, 6]])
    old = rows.clone()
    want = rows.clone()
    want[blk, :, sub] = torch.stack([key[tok], value[tok]], 1)
    assert write_rows(rows, key, value, tok, blk, sub)
    assert torch.equal(rows, want) and not torch.equal(rows, old)
    before = share.clone()
    with pytest.raises(RuntimeError, match="out of range"):
        write_rows(rows, key, value, torch.tensor([4, 0, 9, t]), blk, sub)
    with pytest.raises(RuntimeError, match="out of range"):
        write_rows(rows, key, value, tok, blk, sub + torch.tensor([[0, r], [0, 0], [0, 0], [0, 0]]))
    assert torch.equal(share, before)  # refused before any write
    other = torch.float16 if dtype == torch.float32 else torch.float32
    assert not write_rows(rows, key.to(other), value.to(other), tok, blk, sub) and torch.equal(share, before)
