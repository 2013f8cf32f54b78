"""Property tests of the store's update sequence (hypothesis, derandomized: the same examples on every run).

Random chunk sizes, prefill/decode interleavings, NaN tiles, crop and batch reordering, applied to a `LayerStore` and
to a plain model of its content: per tensor kind, one tensor of every position's value as attention should read it,
where a tile that completes is replaced by the quantizer's round trip of its current values (kept as is when it
holds a NaN), and a crop simply drops the newest positions (their tiles' survivors already hold dequantized values).
After every step the store's `full()`, the attention view and the byte accounting must agree with the model."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvarn.attention.view import StoredKV
from kvarn.cache.memory import held_bytes
from kvarn.cache.store import LayerStore
from kvarn.presets import affine_preset

D, G = 8, 16


class Model:
    """What one TensorStore should return: vals [B, H, T, D], and how many tokens after the sink are in tiles."""

    def __init__(self, quantizer, sink: int, flush: int) -> None:
        self.q, self.sink, self.flush = quantizer, sink, flush
        self.vals: torch.Tensor | None = None
        self.n_q = 0

    def append(self, x: torch.Tensor) -> None:
        self.vals = x.clone() if self.vals is None else torch.cat([self.vals, x], dim=2)
        t = self.vals.shape[2]
        ready = max(t - self.sink - self.n_q, 0) // self.flush * self.flush
        if ready:
            a = self.sink + self.n_q
            region = self.vals[:, :, a:a + ready]
            b, h = region.shape[:2]
            flat = region.reshape(b, h, ready // G, G, D).flatten(0, 2)
            finite = torch.isfinite(flat).flatten(1).all(1)
            out = flat.clone()
            if finite.any():
                out[finite] = self.q.roundtrip(flat[finite])
            self.vals[:, :, a:a + ready] = out.reshape(b, h, ready, D)
            self.n_q += ready

    def crop(self, n: int) -> None:
        t = self.vals.shape[2] - n
        self.vals = self.vals[:, :, :t]
        self.n_q = min(self.n_q, max(t - self.sink, 0) // G * G)

    def index(self, idx: torch.Tensor) -> None:
        self.vals = self.vals[idx]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


ops = st.lists(st.one_of(
    st.tuples(st.just("append"), st.sampled_from([1, 1, 1, 2, 3, 7, 16, 17, 40, 70]), st.booleans()),
    st.tuples(st.just("crop"), st.integers(1, 40), st.just(False)),
    st.tuples(st.just("index"), st.integers(0, 2**16), st.just(False)),
), min_size=1, max_size=14)


@settings(derandomize=True, max_examples=30, deadline=None)
@given(ops=ops, family=st.sampled_from(["kvarn", "rtn"]), sink=st.sampled_from([0, 3, 8]),
       flush=st.sampled_from([G, 2 * G]), data_seed=st.integers(0, 2**31))
def test_store_follows_the_model(ops, family, sink, flush, data_seed):
    preset = affine_preset(family, 2, 2, G).replace(sink=sink, tile=flush)
    store = LayerStore.from_preset(preset, D)
    kq, vq = preset.quantizers(D)
    mk, mv = Model(kq, sink, flush), Model(vq, sink, flush)
    g = torch.Generator().manual_seed(data_seed)
    batch = 2
    for op, n, nan in ops:
        if op == "append":
            k, v = torch.randn(batch, 2, n, D, generator=g), torch.randn(batch, 2, n, D, generator=g)
            if nan:
                k[0, 1, n // 2, 3] = float("nan")
            store.append(k, v)
            mk.append(k)
            mv.append(v)
        elif op == "crop" and store.length:
            n = min(n, store.length)
            store.crop(n)
            mk.crop(n)
            mv.crop(n)
        elif op == "index" and store.length:
            perm = torch.randint(0, batch, (3 if n % 3 == 0 else batch,), generator=torch.Generator().manual_seed(n))
            store.index_batch(perm)
            mk.index(perm)
            mv.index(perm)
            batch = perm.numel()
        if not store.length:
            continue
        kf, vf = store.full()
        assert same(kf, mk.vals) and same(vf, mv.vals), (op, n)
        assert same(StoredKV.of(store.keys).dequantized(torch.float32), kf)
        assert store.keys.n_tiles * G == mk.n_q and store.values.n_tiles * G == mv.n_q
        nb = store.nbytes()
        assert nb.elements == 2 * batch * 2 * store.length * D
        assert nb.content <= held_bytes(store) <= nb.total
