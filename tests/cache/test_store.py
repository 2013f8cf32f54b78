"""The layer store (kvarn.cache.store): region boundaries, quantize-once, the float64 reference of
quantize-per-tile, the sliding value window, non-finite tiles and byte accounting."""

from __future__ import annotations

import random

import pytest
import torch

from kvarn.cache.store import Bytes, LayerStore, TensorStore
from kvarn.presets import affine_preset, get_preset
from tests.helpers import B, D, H, small_preset
from tests.reference.data import heavy_tailed
from tests.reference.store_check import tile_error_excess


def random_chunks(total: int, rng: random.Random) -> list[int]:
    sizes = []
    while total > 0:
        n = min(total, rng.choice([1, 1, 2, 3, 7, 16, 17, 40]))
        sizes.append(n)
        total -= n
    return sizes


def fill(store: LayerStore, k: torch.Tensor, v: torch.Tensor, rng: random.Random, check=None) -> None:
    start = 0
    for n in random_chunks(k.shape[2], rng):
        store.append(k[:, :, start:start + n], v[:, :, start:start + n])
        start += n
        if check:
            check(store, start)


def regions(s: TensorStore) -> tuple[int, int, int]:
    sink = 0 if s.sink is None else s.sink.shape[2]
    tiles = s.n_tiles * s.quantizer.tile
    tail = 0 if s.tail is None else s.tail.shape[2]
    return sink, tiles, tail


# --- boundaries and quantize-once ------------------------------------------------------------------------


@pytest.mark.parametrize("sink,flush,window", [(8, None, "block"), (0, None, "block"), (5, 32, "block"),
                                               (8, 32, "sliding"), (0, None, "sliding")])
def test_region_boundaries_for_random_append_patterns(sink, flush, window, seed):
    rng = random.Random(seed)
    p = small_preset("rtn", tile=16, sink=sink, flush=flush, window=window)
    g, f = 16, p.tile
    store = LayerStore.from_preset(p, D)
    k, v = torch.randn(B, H, 150, D), torch.randn(B, H, 150, D)

    def check(st: LayerStore, t: int) -> None:
        s = min(t, sink)
        # keys flush whole blocks of `f` tokens once complete
        assert regions(st.keys) == (s, (t - s) // f * f, (t - s) % f)
        # values: block like keys, or sliding: the newest `f` tokens stay exact, older ones are quantized
        # a quantizer tile at a time, so the exact tail is [f, f + g) long once t - s >= f
        n_q = (t - s) // f * f if window == "block" else max(t - s - f, 0) // g * g
        assert regions(st.values) == (s, n_q, t - s - n_q)
        assert st.length == st.keys.length == st.values.length == t

    fill(store, k, v, rng, check)
    kf, vf = store.full()
    assert kf.shape == vf.shape == (B, H, 150, D)
    # exact regions come back bit for bit
    s_k, n_k, _ = regions(store.keys)
    s_v, n_v, _ = regions(store.values)
    assert torch.equal(kf[:, :, :s_k], k[:, :, :s_k]) and torch.equal(kf[:, :, s_k + n_k:], k[:, :, s_k + n_k:])
    assert torch.equal(vf[:, :, :s_v], v[:, :, :s_v]) and torch.equal(vf[:, :, s_v + n_v:], v[:, :, s_v + n_v:])


def test_tiles_are_quantized_once(seed):
    rng = random.Random(seed)
    store = LayerStore.from_preset(small_preset("kvarn", sink=4), D)
    k, v = torch.randn(B, H, 200, D), torch.randn(B, H, 200, D)
    fill(store, k[:, :, :90], v[:, :, :90], rng)
    old_k = {n: t.clone() for n, t in store.keys.packed.items()}
    old_dec = store.keys.dequantized_tiles().clone()
    n_old = store.keys.n_tiles
    assert n_old == (90 - 4) // 16
    fill(store, k[:, :, 90:], v[:, :, 90:], rng)
    assert store.keys.n_tiles > n_old
    for name, t in old_k.items():
        assert torch.equal(store.keys.packed.tensors()[name][:, :, :n_old], t), name
    assert torch.equal(store.keys.dequantized_tiles()[:, :, : n_old * 16], old_dec)


def test_tiles_equal_the_quantizer_applied_per_tile(seed):
    # plumbing, bit for bit: tile j of (b, h) is the quantizer's round trip of exactly those positions
    rng = random.Random(seed)
    p = small_preset("kvarn", sink=8, flush=32, window="sliding")
    store = LayerStore.from_preset(p, D)
    k, v = torch.randn(B, H, 120, D), torch.randn(B, H, 120, D)
    fill(store, k, v, rng)
    kq, vq = p.quantizers(D)
    for x, ts, q in ((k, store.keys, kq), (v, store.values, vq)):
        n = ts.n_tiles * 16
        tiles = x[:, :, 8:8 + n].reshape(B, H, ts.n_tiles, 16, D).flatten(0, 2)
        want = q.roundtrip(tiles).reshape(B, H, n, D)
        assert torch.equal(ts.dequantized_tiles(), want)


# --- against the float64 reference of quantize-per-tile --------------------------------------------------


@pytest.mark.parametrize("family", ["kvarn", "rtn"])
def test_full_equals_float64_reference(family, seed):
    """full() against the oracle of docs/SPEC.md §3 tile by tile (tolerance: reference/store_check.py)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    sink, tile = 8, 16
    store = LayerStore.from_preset(small_preset(family, tile=tile, sink=sink), D)
    k = heavy_tailed(B, H, 75, D, generator=g).float()
    v = heavy_tailed(B, H, 75, D, generator=g).float()
    fill(store, k, v, rng)
    kf, vf = store.full()
    rotate = family == "kvarn"
    for x, full, axis in ((k, kf, "channel"), (v, vf, "token")):
        assert torch.equal(full[:, :, :sink], x[:, :, :sink])
        n_tiles = (75 - sink) // tile
        assert torch.equal(full[:, :, sink + n_tiles * tile:], x[:, :, sink + n_tiles * tile:])
        for b in range(B):
            for h in range(H):
                for j in range(n_tiles):
                    pos = slice(sink + j * tile, sink + (j + 1) * tile)
                    assert tile_error_excess(x[b, h, pos], full[b, h, pos], 2, axis, rotate, rotate) <= 0, \
                        (b, h, j, axis)


# --- non-finite tiles ------------------------------------------------------------------------------------


def same_with_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))


def test_non_finite_tiles_kept_exact_and_counted(seed):
    rng = random.Random(seed)
    sink, tile = 8, 16
    store = LayerStore.from_preset(small_preset("kvarn", tile=tile, sink=sink), D)
    k, v = torch.randn(B, H, 90, D), torch.randn(B, H, 90, D)
    # keys: NaN in tile 0 of (0, 1), +inf in tile 2 of (1, 2); values: -inf in tile 1 of (1, 0);
    # a NaN in the sink stays there too
    k[0, 1, sink + 3, 5] = float("nan")
    k[1, 2, sink + 2 * tile + 15, 0] = float("inf")
    v[1, 0, sink + tile, 7] = -float("inf")
    k[0, 0, 2, 2] = float("nan")
    fill(store, k, v, rng)
    assert sorted(store.keys.exact_index.tolist()) == [[0, 1, 0], [1, 2, 2]]
    assert store.values.exact_index.tolist() == [[1, 0, 1]]
    kf, vf = store.full()
    assert same_with_nan(kf[0, 1, sink: sink + tile], k[0, 1, sink: sink + tile])
    assert same_with_nan(kf[1, 2, sink + 2 * tile: sink + 3 * tile], k[1, 2, sink + 2 * tile: sink + 3 * tile])
    assert torch.equal(vf[1, 0, sink + tile: sink + 2 * tile], v[1, 0, sink + tile: sink + 2 * tile])
    assert same_with_nan(kf[:, :, :sink], k[:, :, :sink])
    # the other tiles are quantized normally and finite; no stored field holds a non-finite value
    assert torch.isfinite(kf[0, 0, sink:]).all() and torch.isfinite(vf[0]).all()
    for t in store.keys.packed.tensors().values():
        assert torch.isfinite(t.float()).all()
    nb = store.keys.nbytes()
    assert nb.exact_tiles == 2 * tile * D * 4 + store.keys.exact_index.numel() * 8


def test_scale_overflow_tile_kept_exact():
    # finite input whose fp16 scales overflow (|z| > 65504): the tile is kept exact instead of decoding to inf
    store = LayerStore.from_preset(small_preset("rtn", tile=16, sink=0), D)
    k = torch.randn(1, 1, 32, D)
    k[0, 0, 16:] += 1e6
    store.append(k, k.clone())
    assert store.keys.exact_index.tolist() == [[0, 0, 1]]
    kf, _ = store.full()
    assert torch.equal(kf[0, 0, 16:], k[0, 0, 16:]) and torch.isfinite(kf).all()


def test_fp8_scale_overflow_tile_kept_exact():
    # e4m3 scales saturate at 448 without an inf: the quantizer marks them NaN and the store keeps the tile
    p = affine_preset("kvarn", 2, 2, 16, scale_dtype=torch.float8_e4m3fn).replace(sink=0)
    store = LayerStore.from_preset(p, D)
    k = torch.randn(1, 2, 32, D)
    k[0, 1, 16:] *= 5000.0
    store.append(k, k.clone())
    assert store.keys.exact_index.tolist() == store.values.exact_index.tolist() == [[0, 1, 1]]
    kf, vf = store.full()
    assert torch.equal(kf[0, 1, 16:], k[0, 1, 16:]) and torch.isfinite(kf).all() and torch.isfinite(vf).all()


# --- bytes -----------------------------------------------------------------------------------------------


def held_bytes(s: TensorStore) -> int:
    tensors = [s.sink, s.tail, s.exact_values, *s.packed.tensors().values()]
    n = sum(t.numel() * t.element_size() for t in tensors if t is not None)
    return n + (s.exact_index.numel() * s.exact_index.element_size() if s.exact_values is not None else 0)


@pytest.mark.parametrize("window", ["block", "sliding"])
def test_nbytes_is_the_sum_of_held_tensors(window, seed):
    rng = random.Random(seed)
    store = LayerStore.from_preset(small_preset("kvarn", sink=8, flush=32, window=window), D)
    k, v = torch.randn(B, H, 137, D), torch.randn(B, H, 137, D)
    k[1, 1, 50, 3] = float("nan")  # one exact tile
    fill(store, k, v, rng)
    for s in (store.keys, store.values):
        nb = s.nbytes()
        assert nb.total == held_bytes(s)
        assert nb.elements == B * H * 137 * D
        assert nb.sink == B * H * 8 * D * 4
        assert nb.packed == s.packed.nbytes
    total = store.nbytes()
    assert isinstance(total, Bytes) and total.total == held_bytes(store.keys) + held_bytes(store.values)
    assert total.bits_per_element == total.total * 8 / total.elements
    assert store.keys.nbytes().exact_tiles > 0


def test_packed_bytes_match_bits_per_element(seed):
    # once only whole tiles are held, the packed region costs exactly the preset's bits per element
    p = small_preset("kvarn", tile=16, sink=0)
    store = LayerStore.from_preset(p, D)
    x = torch.randn(B, H, 64, D)
    store.append(x, x.clone())
    nb = store.nbytes()
    assert nb.sink == nb.tail == 0
    assert nb.bits_per_element == p.bits_per_element(D)


# --- options and refusals ---------------------------------------------------------------------------------


def test_keep_decoded_and_unquantized(seed):
    rng = random.Random(seed)
    p = small_preset("kvarn", sink=8)
    k, v = torch.randn(B, H, 70, D), torch.randn(B, H, 70, D)
    a, b = LayerStore.from_preset(p, D), LayerStore.from_preset(p, D, keep_decoded=True)
    c = LayerStore.from_preset(p, D, quantize=False)
    for st in (a, b, c):
        fill(st, k, v, random.Random(rng.random()))
    assert torch.equal(a.full()[0], b.full()[0]) and torch.equal(a.full()[1], b.full()[1])
    assert torch.equal(c.full()[0], k) and torch.equal(c.full()[1], v)
    assert LayerStore.from_preset(p, D, sink=0).keys.sink_len == 0


def test_store_bad_input():
    store = LayerStore.from_preset(small_preset(), D)
    with pytest.raises(ValueError, match="no tokens"):
        store.full()
    with pytest.raises(ValueError, match="batch, heads, tokens, head_dim"):
        store.keys.append(torch.randn(H, 4, D))
    with pytest.raises(ValueError, match="head_dim 8"):
        store.append(torch.randn(B, H, 4, 8), torch.randn(B, H, 4, 8))
    with pytest.raises(ValueError, match="disagree"):
        store.append(torch.randn(B, H, 4, D), torch.randn(B, H, 5, D))
    store.append(torch.randn(B, H, 4, D), torch.randn(B, H, 4, D))
    with pytest.raises(ValueError, match="cannot append"):
        store.append(torch.randn(B, H + 1, 4, D), torch.randn(B, H + 1, 4, D))
    with pytest.raises(ValueError, match="sink must be >= 0"):
        LayerStore.from_preset(small_preset(), D, sink=-1)
    with pytest.raises(ValueError, match="not a multiple"):
        TensorStore(small_preset().quantizers(D)[0], 0, flush=24)
    with pytest.raises(ValueError, match="window"):
        TensorStore(None, 0, flush=16, window="ring")
    with pytest.raises(ValueError, match="unknown preset"):
        LayerStore.from_preset(get_preset("no-such-preset"), D)


def test_store_takes_quantizers_and_a_policy():
    """The store is built from what the preset resolved to; `from_preset` is the same store."""
    p = small_preset("kvarn", sink=4, flush=32, window="sliding")
    kq, vq = p.quantizers(D)
    direct, built = LayerStore(kq, vq, p.policy, D), LayerStore.from_preset(p, D)
    for a, b in ((direct.keys, built.keys), (direct.values, built.values)):
        assert (a.sink_len, a.flush, a.window, a.quantizer.describe()) == (b.sink_len, b.flush, b.window,
                                                                            b.quantizer.describe())
    assert (direct.keys.window, direct.values.window, direct.keys.flush) == ("block", "sliding", 32)
    assert direct.policy is p.policy and LayerStore(None, None, p.policy, D, sink=0).keys.quantizer is None
    with pytest.raises(ValueError, match="both keys and values or neither"):
        LayerStore(kq, None, p.policy, D)
