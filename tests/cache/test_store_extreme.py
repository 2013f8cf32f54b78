"""Non-finite and extreme K/V through the store, each class against the float64 oracle of docs/SPEC.md §3.

Every tile is either kept exact (restored bit for bit, counted by cause in `stats`) or matches the oracle at the
tolerance of reference/store_check.py; exact regions come back bit for bit; no position is lost. The count of
tokens lost or corrupted must be 0 for every class."""

from __future__ import annotations

import pytest
import torch

from kvarn.cache.store import LayerStore, TensorStore
from kvarn.presets import affine_preset
from tests.reference.store_check import tile_error_excess

B, H, D, G, SINK = 1, 2, 16, 16, 4
T = SINK + 4 * G + 5


def preset(family: str, scale_dtype: torch.dtype = torch.float16):
    return affine_preset(family, 2, 2, G, scale_dtype=scale_dtype).replace(sink=SINK)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(), b.nan_to_num())


def damaged(store: TensorStore, x: torch.Tensor, full: torch.Tensor, family: str, axis: str) -> int:
    """Positions (batch, head, token) lost or not matching: exact regions and tiles kept exact bit for bit, other
    tiles within the oracle's tolerance."""
    if full.shape != x.shape:
        return x.shape[0] * x.shape[1] * x.shape[2]
    bad = 0
    s, n = store.tiles_start, store.n_tiles
    exact = {tuple(r) for r in store.exact_index.tolist()}
    rotate = family == "kvarn"
    for b in range(x.shape[0]):
        for h in range(x.shape[1]):
            bad += int(not same(full[b, h, :s], x[b, h, :s].to(full.dtype))) * s
            bad += int(not same(full[b, h, s + n * G:], x[b, h, s + n * G:])) * (x.shape[2] - s - n * G)
            for j in range(n):
                pos = slice(s + j * G, s + (j + 1) * G)
                if (b, h, j) in exact:
                    ok = same(full[b, h, pos], x[b, h, pos])
                else:
                    ok = tile_error_excess(x[b, h, pos].double(), full[b, h, pos].double(), 2, axis, rotate,
                                           rotate) <= 0
                bad += 0 if ok else G
    return bad


def run(family: str, k: torch.Tensor, v: torch.Tensor, scale_dtype=torch.float16, oracle: bool = True) -> LayerStore:
    """Append k, v (a prompt, then one token at a time) and check every position (`damaged`); the oracle's
    tolerance assumes fp16 scales (oracle=False for 8-bit scales: exact regions and tiles only)."""
    store = LayerStore.from_preset(preset(family, scale_dtype), D)
    store.append(k[:, :, :SINK + G + 3], v[:, :, :SINK + G + 3])
    for t in range(SINK + G + 3, T):
        store.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
    kf, vf = store.full()
    if oracle:
        assert damaged(store.keys, k, kf, family, "channel") == 0
        assert damaged(store.values, v, vf, family, "token") == 0
    else:
        for st, x, f in ((store.keys, k, kf), (store.values, v, vf)):
            assert f.shape == x.shape and torch.isfinite(f).all()
            for b, h, j in st.exact_index.tolist():
                assert torch.equal(f[b, h, tile(j)], x[b, h, tile(j)])
    return store


def base(dtype=torch.float32, seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, T, D, generator=g).to(dtype), torch.randn(B, H, T, D, generator=g).to(dtype))


def tile(j: int) -> slice:
    return slice(SINK + j * G, SINK + (j + 1) * G)


@pytest.mark.parametrize("family", ["kvarn", "rtn"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_kept_exact(family, value):
    k, v = base()
    k[0, 1, tile(1).start + 2, 3] = value
    v[0, 0, tile(3).start, 0] = value
    k[0, 0, 1, 1] = value  # sink
    k[0, 0, T - 1, 2] = value  # tail
    store = run(family, k, v)
    assert store.keys.exact_index.tolist() == [[0, 1, 1]] and store.values.exact_index.tolist() == [[0, 0, 3]]
    assert store.stats.exact_nonfinite == 2 and store.stats.exact_scale_overflow == 0


@pytest.mark.parametrize("family", ["kvarn", "rtn"])
def test_zero_and_constant_tiles(family):
    k, v = base()
    for x in (k, v):
        x[0, 0, tile(0)] = 0.0
        x[0, 1, tile(1)] = 3.25
        x[0, 0, tile(2)] = torch.arange(G, dtype=torch.float32).unsqueeze(1)  # constant along the channels
    store = run(family, k, v)
    kf, vf = store.full()
    assert torch.equal(kf[0, 0, tile(0)], torch.zeros(G, D)) and torch.equal(vf[0, 0, tile(0)], torch.zeros(G, D))
    assert not len(store.keys.exact_index) and not len(store.values.exact_index)


@pytest.mark.parametrize("family", ["kvarn", "rtn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_token_1e4_times_larger(family, dtype):
    k, v = base(dtype)
    big = 1e4 if dtype == torch.float32 else 6e3  # x 1e4 a N(0, 1) token would pass fp16's range
    k[0, 1, tile(2).start + 5] *= big
    v[0, 0, tile(1).start + 9] *= big
    store = run(family, k, v)
    assert not len(store.keys.exact_index) and not len(store.values.exact_index)


@pytest.mark.parametrize("family", ["kvarn", "rtn"])
@pytest.mark.parametrize("scale", [1e-40, 1e-30, 1e-6])
def test_denormal_and_tiny_tiles(family, scale):
    """float32 denormals (1e-40), tiny values whose fp16 scales underflow (1e-30) and fp16-subnormal scales (1e-6)."""
    k, v = base()
    for x in (k, v):
        x[0, 0, tile(1)] *= scale
        x[0, 1, tile(3)] *= scale
    store = run(family, k, v)
    kf, _ = store.full()
    assert torch.isfinite(kf).all()


def test_fp16_overflow_after_rotation_kept_exact():
    """float16 K/V near the top of fp16's range: the rotated tile's fp16 scales are finite and the float32
    reconstruction too, but cast to float16 (the reference read path of an fp16 model) it overflows. On main the
    store kept such a tile packed and full() returned inf for finite input."""
    k, v = base(torch.float16)
    g = torch.Generator().manual_seed(1)
    k[0, 1, tile(2)] = ((torch.rand(G, D, generator=g) * 2 - 1) * 65000).half()
    v[0, 0, tile(0)] = ((torch.rand(G, D, generator=g) * 2 - 1) * 65000).half()
    store = run("kvarn", k, v)
    kf, vf = store.full()
    assert torch.isfinite(kf).all() and torch.isfinite(vf).all()
    assert store.keys.exact_index.tolist() == [[0, 1, 2]] and store.values.exact_index.tolist() == [[0, 0, 0]]
    assert store.stats.exact_dtype_overflow == 2
    # rtn (no rotation) reconstructs within each row's range: no overflow, nothing kept exact
    store = run("rtn", k, v)
    assert store.stats.exact_dtype_overflow == 0 and not len(store.keys.exact_index)


@pytest.mark.parametrize("family", ["kvarn", "rtn"])
def test_scale_overflow_kept_exact(family):
    """float32 values beyond fp16's range: the folded row scales / zeros overflow fp16 (inf), the tile is kept.
    (VarN splits a value tile's magnitude between row and column scales: x 1e6 still fits, x 1e10 does not.)"""
    k, v = base()
    k[0, 0, tile(1)] += 1e6
    v[0, 1, tile(2)] *= 1e10
    store = run(family, k, v)
    assert store.keys.exact_index.tolist() == [[0, 0, 1]] and store.values.exact_index.tolist() == [[0, 1, 2]]
    assert store.stats.exact_scale_overflow == 2


def test_fp8_folded_scale_overflow_kept_exact():
    k, v = base()
    k[0, 1, tile(1)] *= 5000.0
    store = run("kvarn", k, v, scale_dtype=torch.float8_e4m3fn, oracle=False)
    assert store.keys.exact_index.tolist() == [[0, 1, 1]] and store.stats.exact_scale_overflow >= 1


# -- strictness ---------------------------------------------------------------------------------------------------
def test_nonfinite_error_refuses_and_leaves_the_store_intact():
    k, v = base()
    store = LayerStore.from_preset(preset("kvarn"), D, nonfinite="error")
    store.append(k[:, :, :SINK + G], v[:, :, :SINK + G])
    before = [t.clone() for t in store.full()]
    bad = v[:, :, SINK + G:SINK + 2 * G].clone()
    bad[0, 1, 4, 7] = float("nan")
    with pytest.raises(ValueError, match=r"non-finite K/V value nan at batch 0, head 1, position 24, channel 7"):
        store.append(k[:, :, SINK + G:SINK + 2 * G], bad)
    assert store.length == SINK + G and all(torch.equal(a, b) for a, b in zip(store.full(), before))
    huge = k[:, :, SINK + G:SINK + 2 * G].clone()
    huge[0, 0] += 1e6  # finite, but its scales overflow fp16
    with pytest.raises(ValueError, match=r"batch 0, head 0, positions \[20, 36\).*stored scale overflows"):
        store.append(huge, v[:, :, SINK + G:SINK + 2 * G])
    assert store.length == store.values.length == SINK + G  # neither keys nor values changed
    with pytest.raises(ValueError, match="nonfinite must be"):
        LayerStore.from_preset(preset("kvarn"), D, nonfinite="ignore")


def test_cache_threads_nonfinite_error():
    from transformers import LlamaConfig

    from kvarn.integrations.transformers import KVarNCache

    cfg = LlamaConfig(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, hidden_size=32, head_dim=16)
    cache = KVarNCache(cfg, "rtn-k2v2-g64", nonfinite="error")
    k = torch.randn(1, 2, 3, 16)
    k[0, 0, 2, 0] = float("inf")
    with pytest.raises(ValueError, match="non-finite K/V value inf at batch 0, head 0, position 2"):
        cache.update(k, k.clone(), 0)
