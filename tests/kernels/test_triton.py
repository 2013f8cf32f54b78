"""Triton kernels (kvarn.kernels.triton) on the CPU through TRITON_INTERPRET=1, small shapes.

Decode attention is checked against the float64 oracle of tests/helpers.py (independent dequantization with
the bit-stream unpacking and the reference Hadamard, plain per-head softmax), on pool-layout fields read through a
permuted block table, batch rows of different lengths, sink/tail/fresh exact regions, several splits (one of them
empty); and through the transformers-cache adapter against the same oracle. The store kernel is checked against
`AffineQuantizer.encode` (codes bit-exact where the arithmetic is the same, stated tolerances where float32
summation order differs). Skipped when triton is not installed.
"""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # conftest sets it first (before anything imports triton)

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install 'kvarn[triton]'): Triton kernel tests "
                    "skipped")

from kvarn.attention.packed import KVarNPast
from kvarn.attention.reference import reference_attention
from kvarn.attention.view import StoredKV
from kvarn.bench.gpu_check import encode_pool
from kvarn.kernels.triton import ops
from kvarn.kernels.triton.attention import packed_decode, paged_decode
from kvarn.ops.packing import pack_codes, unpack_codes
from kvarn.presets import affine_preset, get_preset
from kvarn.quant.affine import AffineConfig, AffineQuantizer
from kvarn.quant.policy import kernel_weighted
from kvarn.quant.tiles import AffineTiles
from tests.helpers import logit_l1, oracle
from tests.reference.data import heavy_tailed
from tests.tolerances import EPS32


# -- codes -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 4])
def test_codes_match_packing_module(bits):
    """The kernels' unpack/pack equal kvarn.ops.packing, whichever layout it writes (ops.code_layout)."""
    gen = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (3, 16, 64), generator=gen, dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert torch.equal(ops.unpack(packed, bits), unpack_codes(packed, bits, dtype=torch.float32))
    assert torch.equal(ops.pack(codes, bits), packed)


@pytest.mark.parametrize("bits", [2, 4])
def test_planes_layout(bits):
    """The planes layout (byte k of a row holds codes k + j*C/PER, j at bits [j*b, (j+1)*b)), which kvarn.ops.packing
    may switch to (issue 10): the kernels' branch for it round-trips and matches that definition written plainly."""
    from kvarn.kernels.triton.kernels.codes import pack_kernel, unpack_kernel

    gen = torch.Generator().manual_seed(10 + bits)
    n, r, c, per = 2, 16, 64, 8 // bits
    codes = torch.randint(0, 1 << bits, (n, r, c), generator=gen, dtype=torch.int32)
    planes = sum(codes[..., j * (c // per):(j + 1) * (c // per)] << (j * bits) for j in range(per)).to(torch.uint8)
    packed = torch.empty(n, r, c * bits // 8, dtype=torch.uint8)
    pack_kernel[(n,)](codes, packed, R=r, C=c, BITS=bits, PLANES=True)
    assert torch.equal(packed, planes)
    out = torch.empty(n, r, c)
    unpack_kernel[(n,)](planes, out, R=r, C=c, BITS=bits, PLANES=True)
    assert torch.equal(out, codes.float())


# -- decode ------------------------------------------------------------------------------------------------------
def view_of(fields: AffineTiles, blocks: torch.Tensor, quantizer, sink, tail) -> StoredKV:
    """One batch row's StoredKV: pool blocks gathered in table order, [1, H, n, ...]."""
    packed = fields.map(lambda v: v[blocks.long()].transpose(0, 1).unsqueeze(0))
    h, d = sink.shape[1], sink.shape[3]
    return StoredKV(sink, packed, len(blocks), tail if tail.shape[2] else None, torch.zeros(0, 3, dtype=torch.long),
                    None, quantizer, (1, h, d), torch.float32)


def tolerance(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, d: int, t: int) -> float:
    """float32 bound on |out - oracle|: each logit is a sum of ~D + 2 products, off by <= (D + 4) eps times the sum
    of |products| (logit_l1); softmax moves by at most twice the largest logit error, times max|V|; the value sums
    over T tokens and D channels add (T + D + 4) eps max|V|."""
    vmax = float(v.abs().max())
    return (2 * (d + 4) * EPS32 * logit_l1(q, k, scaling) + (t + d + 4) * EPS32) * vmax


KERNELS = [("tile", "ieee"), ("planes", "ieee"), ("planes", "bf16x3"), ("stacked", "bf16x3")]  # decode versions
# 1 and 2, the version 3 candidate, and precisions


@pytest.fixture(params=KERNELS, ids=lambda k: "-".join(k))
def kernel(request, monkeypatch):
    """Force one decode kernel version (`ops.DECODE_KERNEL`); the test passes the precision."""
    monkeypatch.setattr(ops, "DECODE_KERNEL", request.param[0])
    return request.param[1]


CASES = [  # head_dim, GQA ratio, preset
    (64, 1, "kvarn-k2v2-g64"),
    (128, 4, "kvarn-k4v2-g64"),
    (64, 4, "kvarn-auto-k2v2-g64"),
    (128, 1, "kvarn-auto-k4v2-g64"),
    (64, 4, "rtn-k2v2-g64"),
]


@pytest.mark.parametrize("d,gqa,preset", CASES)
def test_paged_decode_matches_oracle(d, gqa, preset, kernel):
    gen = torch.Generator().manual_seed(1000 * d + gqa)
    kq, vq = get_preset(preset).quantizers(d)
    g, hkv, nb_pool, b = kq.tile, 2, 6, 2
    xk = heavy_tailed(nb_pool, hkv, g, d, generator=gen).float()
    xv = heavy_tailed(nb_pool, hkv, g, d, generator=gen).float()
    fk = torch.tensor([[1, 0], [0, 1], [1, 1], [0, 0], [1, 0], [0, 1]], dtype=torch.bool)  # both kinds of tile
    kf, vf = encode_pool(kq, xk, fk), encode_pool(vq, xv, fk.flip(0))
    perm = torch.randperm(nb_pool, generator=gen).to(torch.int32)
    n_blocks = torch.tensor([3, 2], dtype=torch.int32)
    table = torch.stack([perm[:3], torch.cat([perm[3:5], perm[:1]])])  # row 1: a stale entry past n_blocks
    sink_k, sink_v = (heavy_tailed(b, hkv, 2, d, generator=gen).float() for _ in range(2))
    tail_k, tail_v = (heavy_tailed(b, hkv, 5, d, generator=gen).float() for _ in range(2))
    tail_len = torch.tensor([5, 2], dtype=torch.int32)
    new_k, new_v = (heavy_tailed(b, hkv, 1, d, generator=gen).float() for _ in range(2))
    q = torch.randn(b, hkv * gqa, d, generator=gen)  # keys and values heavy-tailed: logits up to ~1e3
    exact = [(sink_k, sink_v, None), (tail_k, tail_v, tail_len), (new_k, new_v, None)]
    out = paged_decode(q, ops.TileFields.from_pool(kf), ops.TileFields.from_pool(vf), table, n_blocks,
                       exact, blocks_per_split=2, precision=kernel)  # splits of 2: row 1's second one is empty
    scaling = d ** -0.5
    for r in range(b):
        blocks, t = table[r, :n_blocks[r]], int(tail_len[r])
        past = KVarNPast(view_of(kf, blocks, kq, sink_k[r:r + 1], tail_k[r:r + 1, :, :t]),
                         view_of(vf, blocks, vq, sink_v[r:r + 1], tail_v[r:r + 1, :, :t]))
        ok = torch.ones(1, 1, 1, past.length + 1, dtype=torch.bool)
        want = oracle(q[r:r + 1, :, None], new_k[r:r + 1], new_v[r:r + 1], past, ok, scaling)[0, 0]
        kv = torch.cat([past.keys.dequantized(torch.float32), new_k[r:r + 1]], 2)
        vv = torch.cat([past.values.dequantized(torch.float32), new_v[r:r + 1]], 2)
        tol = tolerance(q[r:r + 1, :, None], kv, vv, scaling, d, past.length + 1)
        err = float((out[r].double() - want).abs().max())
        assert err <= tol, f"row {r}: max error {err:.3g} > bound {tol:.3g}"
        # and no worse than plain float32 attention over the same dequantized K/V (a tighter, empirical check)
        f32 = reference_attention(q[r:r + 1, :, None], kv, vv, dtype=torch.float32)[0, 0]
        err32 = float((f32.double() - want).abs().max())
        assert err <= 4 * err32 + 16 * EPS32 * float(vv.abs().max()), f"row {r}: {err:.3g} vs float32 {err32:.3g}"


def test_fixed_split_count_equals_adaptive_splits():
    """splits=S (the vLLM path's fixed MAX_SPLITS: grid (B*H, S) whatever the blocks): fewer splits than blocks
    (several blocks per split) and more (trailing splits empty, rows with no block at all) give the adaptive launch's
    result up to float32 merge order (1e-6 relative)."""
    gen = torch.Generator().manual_seed(21)
    kq, vq = affine_preset("kvarn", 2, 2, 16).quantizers(16)  # the smallest tile the kernels take
    nb, h, d = 8, 2, 16
    fk = torch.zeros(nb, h, dtype=torch.bool)
    kf = encode_pool(kq, heavy_tailed(nb, h, 16, d, generator=gen).float(), fk)
    vf = encode_pool(vq, heavy_tailed(nb, h, 16, d, generator=gen).float(), fk)
    keys, values = ops.TileFields.from_pool(kf), ops.TileFields.from_pool(vf)
    table = torch.randperm(nb, generator=gen)[:6].to(torch.int32).repeat(3, 1)
    n_blocks = torch.tensor([6, 2, 0], dtype=torch.int32)
    q = torch.randn(3, 4, d, generator=gen)
    fresh = [(heavy_tailed(3, h, 1, d, generator=gen).float(), heavy_tailed(3, h, 1, d, generator=gen).float(), None)]
    want = paged_decode(q, keys, values, table, n_blocks, fresh, blocks_per_split=6)
    for splits in (4, 16):
        got = paged_decode(q, keys, values, table, n_blocks, fresh, splits=splits)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))


@pytest.mark.parametrize("d,gqa,preset", [(64, 4, "kvarn-k2v2-g64"), (128, 1, "kvarn-auto-k2v2-g64")])
def test_cache_adapter_matches_oracle(d, gqa, preset, kernel):
    """packed_decode over transformers-cache fields [B, H, n, ...] (block_table[b, j] = j)."""
    gen = torch.Generator().manual_seed(7 * d + gqa)
    kq, vq = get_preset(preset).quantizers(d)
    b, hkv, n, g = 2, 2, 2, kq.tile
    flags = torch.tensor([[1, 0], [0, 1], [1, 1], [0, 0]], dtype=torch.bool)  # [b*n, hkv]
    xk, xv = (heavy_tailed(b * n, hkv, g, d, generator=gen).float() for _ in range(2))
    kf = encode_pool(kq, xk, flags).map(lambda v: v.unflatten(0, (b, n)).transpose(1, 2))
    vf = encode_pool(vq, xv, ~flags).map(lambda v: v.unflatten(0, (b, n)).transpose(1, 2))
    sink_k, sink_v, tail_k, tail_v = (heavy_tailed(b, hkv, 3, d, generator=gen).float() for _ in range(4))
    new_k, new_v = (heavy_tailed(b, hkv, 1, d, generator=gen).float() for _ in range(2))
    q = heavy_tailed(b, hkv * gqa, 1, d, generator=gen).float()

    def view(fields, quantizer, sink, tail):
        return StoredKV(sink, fields, n, tail, torch.zeros(0, 3, dtype=torch.long), None, quantizer,
                        (b, hkv, d), torch.float32)

    past = KVarNPast(view(kf, kq, sink_k, tail_k), view(vf, vq, sink_v, tail_v))
    got = packed_decode(q, new_k, new_v, past, precision=kernel)  # [B, 1, Hq, D]
    ok = torch.ones(b, 1, 1, past.length + 1, dtype=torch.bool)
    want = oracle(q, new_k, new_v, past, ok, d ** -0.5)
    kall = torch.cat([past.keys.dequantized(torch.float32), new_k], 2)
    vall = torch.cat([past.values.dequantized(torch.float32), new_v], 2)
    tol = tolerance(q, kall, vall, d ** -0.5, d, past.length + 1)
    assert float((got.double() - want).abs().max()) <= tol


def test_decode_refuses_bad_input():
    kq, vq = get_preset("kvarn-k2v2-g64").quantizers(64)
    f = encode_pool(kq, torch.randn(2, 1, 64, 64), torch.zeros(2, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="contiguous"):
        ops.TileFields.from_pool(dataclasses.replace(f, row_scale=torch.stack([f.row_scale] * 2, -1)[..., 0]))
    keys = ops.TileFields.from_pool(f)
    with pytest.raises(ValueError, match="per token"):
        paged_decode(torch.randn(1, 1, 64), keys, keys, torch.zeros(1, 2, dtype=torch.int32),
                     torch.ones(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        vf = encode_pool(vq, torch.randn(2, 1, 64, 64), torch.zeros(2, 1, dtype=torch.bool))
        paged_decode(torch.randn(1, 1, 64), keys, ops.TileFields.from_pool(vf), torch.zeros(1, 2),
                     torch.ones(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="precision"):
        paged_decode(torch.randn(1, 1, 64), keys, ops.TileFields.from_pool(vf), torch.zeros(1, 2, dtype=torch.int32),
                     torch.ones(1, dtype=torch.int32), precision="bf16")


def test_decode_kernel_choice(monkeypatch):
    """Version 2 (planes) runs where its dots have >= 16 rows, version 1 (tile) elsewhere; forcing a version that
    cannot read the tiles, or bf16x3 on version 1, is refused by name."""
    assert ops.planes_unsupported(64, 64, 2, 2) is None and ops.planes_unsupported(128, 128, 4, 4) is None
    assert "< 16 rows" in ops.planes_unsupported(64, 32, 2, 2) and "< 16 rows" in ops.planes_unsupported(32, 128, 2, 2)
    kq, vq = affine_preset("kvarn", 2, 2, 16).quantizers(16)
    flags = torch.zeros(2, 1, dtype=torch.bool)
    keys = ops.TileFields.from_pool(encode_pool(kq, torch.randn(2, 1, 16, 16), flags))
    values = ops.TileFields.from_pool(encode_pool(vq, torch.randn(2, 1, 16, 16), flags))
    call = (torch.randn(1, 1, 16), keys, values, torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32))
    assert paged_decode(*call).isfinite().all()  # auto: version 1
    monkeypatch.setattr(ops, "DECODE_KERNEL", "planes")
    with pytest.raises(ValueError, match="planes decode kernel cannot read"):
        paged_decode(*call)
    monkeypatch.setattr(ops, "DECODE_KERNEL", "tile")
    with pytest.raises(ValueError, match=r"bf16x3.*planes"):
        paged_decode(*call, precision="bf16x3")
    monkeypatch.setattr(ops, "DECODE_KERNEL", "stacked")
    with pytest.raises(ValueError, match="stacked decode kernel cannot read"):
        paged_decode(*call)


@pytest.mark.parametrize("preset", ["kvarn-k4v4-g64", "kvarn-auto-k4v4-g64"])
def test_planes_kernel_equals_tile_kernel(preset, monkeypatch):
    """4-bit values (two value planes) and 4-bit keys through every version (auto precision): the same sums in another
    order, and bf16x3's parts."""
    gen = torch.Generator().manual_seed(5)
    kq, vq = get_preset(preset).quantizers(64)
    flags = torch.tensor([[1, 0], [0, 1], [1, 1]], dtype=torch.bool)
    kf = encode_pool(kq, heavy_tailed(3, 2, 64, 64, generator=gen).float(), flags)
    vf = encode_pool(vq, heavy_tailed(3, 2, 64, 64, generator=gen).float(), ~flags)
    call = (torch.randn(2, 4, 64, generator=gen), ops.TileFields.from_pool(kf), ops.TileFields.from_pool(vf),
            torch.tensor([[2, 0, 1], [1, 2, 0]], dtype=torch.int32), torch.tensor([3, 2], dtype=torch.int32))
    out = {}
    for kind in ("tile", "planes", "stacked"):
        monkeypatch.setattr(ops, "DECODE_KERNEL", kind)
        out[kind] = paged_decode(*call)
    for kind in ("planes", "stacked"):
        torch.testing.assert_close(out[kind], out["tile"], rtol=1e-5, atol=1e-5 * float(out["tile"].abs().max()))


# -- store ---------------------------------------------------------------------------------------------------------
STORE_CASES = [  # head_dim, AffineConfig: (bits, axis, rotate, varn)
    (64, (2, "channel", "none", False)),
    (128, (4, "token", "none", False)),
    (64, (2, "channel", "hadamard", True)),
    (128, (2, "token", "hadamard", True)),
    (64, (4, "channel", "none", True)),
]


def empty_pool(quantizer: AffineQuantizer, nb: int, h: int, d: int) -> AffineTiles:
    """Pool fields [nb, H, ...] filled with a marker (0xAB codes, NaN scales) so unwritten slots show."""
    like = quantizer.encode(torch.randn(1, quantizer.tile, d))
    return like.map(lambda v: torch.full((nb, h, *v.shape[1:]), 0xAB if v.dtype == torch.uint8 else float("nan"),
                                         dtype=v.dtype))


def store_args(q: AffineQuantizer) -> dict:
    """The encoding parameters ops.store_tiles takes besides the tiles' format."""
    return {"varn": q.config.varn, "varn_iters": q.config.varn_iters, "weighted": bool(kernel_weighted(q.policy))}


def stored(pool: AffineTiles, dst: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: v[dst.long()].flatten(0, 1) for k, v in pool.items()}


@pytest.mark.parametrize("d,cfg", STORE_CASES)
def test_store_matches_encode(d, cfg):
    """Tiles written through a permuted block mapping equal AffineQuantizer.encode.

    Without VarN or rotation the arithmetic is the same (min, max, (x - lo) / delta, round half to even): codes and
    scales are bit-exact. With a rotation (dense matmul instead of the butterfly) or VarN (std, exp, log in another
    summation order) intermediate values differ by a few float32 ulps, so a code whose position (B - lo) / delta sits
    within ~1e-5 of a rounding boundary may move by one step, and scales (products of exp of the VarN logs) by
    ~1e-6 relative before their fp16 rounding, i.e. at most one fp16 ulp (2^-10 relative) after it. Asserted: at most
    1% of codes differ, each by at most 1; scales within 2^-9 relative; and the tile reconstruction error of the
    kernel's encoding within 1% of the reference's (a moved code costs at most one step of its row)."""
    gen = torch.Generator().manual_seed(d + cfg[0])
    q = AffineQuantizer(AffineConfig(*cfg, tile=64))
    n, h, nb = 3, 2, 5
    x = heavy_tailed(n, h, 64, d, generator=gen).float()
    dst = torch.randperm(nb, generator=gen)[:n].to(torch.int32)
    pool = empty_pool(q, nb, h, d)
    ops.store_tiles(x, ops.TileFields.from_pool(pool), dst, **store_args(q))
    got, want = stored(pool, dst), q.encode(x.flatten(0, 1)).tensors()
    exact = cfg[2] == "none" and not cfg[3]
    for k, v in want.items():
        if k == "codes":
            a, b = unpack_codes(got[k], q.config.bits).int(), unpack_codes(v, q.config.bits).int()
            if exact:
                assert torch.equal(a, b)
            else:
                assert (a - b).abs().max() <= 1 and (a != b).float().mean() <= 0.01
        elif exact:
            assert torch.equal(got[k], v), k
        else:
            torch.testing.assert_close(got[k].float(), v.float(), rtol=2 ** -9, atol=0, msg=k)
    err = (q.decode(q.template(d).with_tensors(got)) - x.flatten(0, 1)).square().mean()
    ref = (q.decode(q.template(d).with_tensors(want)) - x.flatten(0, 1)).square().mean()
    assert err <= 1.01 * ref


def test_store_auto_writes_the_chosen_candidate():
    """rotate="auto": flags come from the quantizer's policy on the kernel's own candidates; each stored tile is
    the candidate its flag names (bit-exact vs a separate launch of that candidate), and the flags agree with
    AffineQuantizer.encode (they could differ only where the two candidates' errors tie within float32 noise;
    asserted equal on these 4 tiles, both kinds present)."""
    gen = torch.Generator().manual_seed(3)
    iters = 2  # VarN rounds: the selection logic does not depend on them (interpreter time does)
    q = AffineQuantizer(AffineConfig(2, "channel", "auto", True, varn_iters=iters, tile=64), "mse")
    n, h, nb, d = 2, 2, 4, 64
    x = heavy_tailed(n, h, 64, d, generator=gen).float()
    x[0, 0] = torch.rand(64, d, generator=gen) * torch.logspace(-1, 1, d)  # uniform, channel scales 0.1..10:
    # plain per-channel RTN wins here (8 of 8 seeds tried), the rotation on heavy-tailed tiles: both kinds stored
    dst = torch.tensor([3, 0], dtype=torch.int32)
    pool = empty_pool(q, nb, h, d)
    ops.store_tiles(x, ops.TileFields.from_pool(pool), dst, **store_args(q))
    got, want = stored(pool, dst), q.encode(x.flatten(0, 1)).tensors()
    assert torch.equal(got["rotated"], want["rotated"])
    assert 0 < int(got["rotated"].sum()) < n * h, f"flags {got['rotated'].tolist()}: want both kinds of tile"
    for rot in (True, False):
        cfg = AffineConfig(2, "channel", "hadamard" if rot else "none", True, varn_iters=iters, tile=64)
        single = AffineQuantizer(cfg)
        alone = empty_pool(single, nb, h, d)
        ops.store_tiles(x, ops.TileFields.from_pool(alone), dst, **store_args(single))
        sel = got["rotated"].bool() == rot
        for k, v in stored(alone, dst).items():
            assert torch.equal(got[k][sel], v[sel]), k


def test_store_refuses_unsupported():
    q = AffineQuantizer(AffineConfig(2, "channel", "hadamard", True, tile=64, scale_dtype=torch.float8_e4m3fn))
    pool = empty_pool(q, 2, 1, 64)
    with pytest.raises(ValueError, match="8-bit scales"):
        ops.store_tiles(torch.randn(1, 1, 64, 64), ops.TileFields.from_pool(pool),
                        torch.zeros(1, dtype=torch.int32), **store_args(q))
    q = AffineQuantizer(AffineConfig(2, "channel", "none", False, tile=64))
    pool = empty_pool(q, 2, 1, 64)
    with pytest.raises(ValueError, match="dst must be int32"):
        ops.store_tiles(torch.randn(1, 1, 64, 64), ops.TileFields.from_pool(pool), torch.zeros(1), **store_args(q))


# -- compiler ----------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_kernels_compile_for_cuda():
    """The interpreter accepts code the compiler refuses (non-constexpr globals, some layouts): compile every kernel
    for sm_90 (no GPU needed; triton bundles ptxas) in a process without TRITON_INTERPRET. ~3 min on 2 cores."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "kvarn.kernels.triton.compile_check"], env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("compiled for sm_90") == 9, run.stdout


# -- the prepared GPU check ----------------------------------------------------------------------------------------
def test_gpu_check_smoke_runs_on_the_interpreter(tmp_path):
    """python -m kvarn.bench.gpu_check --smoke: every section of the prepared GPU check (correctness vs float64, decode
    and store timing) on tiny shapes through the CPU interpreter, so the script a lent GPU will run is not first run
    there. Timings on the interpreter mean nothing; only that it ran and found no failure."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]  # the checkout's kvarn, whatever the venv installed
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        [str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
    run = subprocess.run([sys.executable, "-m", "kvarn.bench.gpu_check", "--smoke", "--out", str(tmp_path)], env=env,
                         cwd=root, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "0 failures/errors" in run.stdout, run.stdout[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["checks"] and result["timings"] and not result["errors"], result["errors"]
