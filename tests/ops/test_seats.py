"""The op seats (kvarn.ops.seats): torch.library.opcheck of every op on CPU (the C++ kernels registered for CPU
against their fake implementations), the default PyTorch reference of each seat against the kernel, and a decode step
of KVarNCache under torch.compile giving the tokens of eager mode.

opcheck runs all four of its checks (test_schema, test_autograd_registration, test_faketensor,
test_aot_dispatch_dynamic), except test_schema where an input is a float8 tensor (see the decode test).
"""

from __future__ import annotations

import pytest
import torch

import kvarn.attention.launch as decode_mod
import kvarn.quant.affine as affine
from kvarn.attention import fused
from kvarn.integrations.transformers import KVarNCache
from kvarn.ops import seats
from kvarn.ops.decode import packed_decode_reference
from kvarn.ops.dispatch import mode
from kvarn.ops.rtn import query_aware_bases
from kvarn.presets import get_preset
from kvarn.quant.affine import QueryAwareQuantizer, tile_store_reference
from tests.helpers import build_past, make_inputs, make_tiny_model

UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")

needs_kernel = pytest.mark.skipif(not decode_mod.available(), reason="the C++ extension cannot be built here")


def _store_args(name: str, kind: int, x: torch.Tensor, weight: torch.Tensor | None, monkeypatch):
    """The seat's arguments as AffineQuantizer.encode_kernel passes them, recorded."""
    q = get_preset(name).quantizers(x.shape[2])[kind]
    seen = []
    real = affine.STORE_SEAT
    monkeypatch.setattr(affine, "STORE_SEAT", lambda *a: seen.append(a) or real(*a))
    q.encode_kernel(x, weight)
    monkeypatch.setattr(affine, "STORE_SEAT", real)
    return q, seen[0]


@needs_kernel
@pytest.mark.parametrize("name,kind", [("kvarn-k2v2-g64", 0), ("kvarn-k2v2-g64", 1), ("kvarn-auto-k2v2-g64", 0),
                                       ("kvarn-k4v2-g64", 1)])
def test_tile_store_opcheck_and_reference(name, kind, monkeypatch, seed):
    """opcheck on the CPU kernel; the seat's default (the PyTorch reference) gives the reference encode's fields."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 64, 64, generator=g)
    x[1, 5, 7] = float("nan")  # a non-finite tile: encoded as zeros, reported
    w = torch.rand(3, 64, generator=g)
    q, args = _store_args(name, kind, x, w if q_auto(name) else None, monkeypatch)
    torch.library.opcheck(torch.ops.kvarn.tile_store.default, args, test_utils=UTILS)
    ref = tile_store_reference(*args)
    xz = torch.where(torch.isfinite(x).flatten(1).all(1).view(-1, 1, 1), x, 0)
    want = q.encode_reference(xz, w if q_auto(name) else None)
    assert torch.equal(ref[0], want.codes) and torch.equal(ref[1], want.row_scale)
    assert ref[5].tolist() == [True, False, True]
    got = torch.ops.kvarn.tile_store.default(*args)
    assert [t.dtype for t in got] == [t.dtype for t in ref] and [t.shape for t in got] == [t.shape for t in ref]


@needs_kernel
def test_tile_store_opcheck_with_query_aware_coefficients(monkeypatch, seed):
    """The seat's optional coef (query-aware rounding of keys): opcheck, and its default equals the kernel."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 64, 64, generator=g)
    a = torch.randn(3, 64, 4, generator=g)
    sigma = a @ a.transpose(1, 2) + 0.1 * torch.eye(64)
    q = QueryAwareQuantizer(get_preset("kvarn-auto-k2v2-g64").quantizers(64)[0].config)
    seen = []
    real = affine.STORE_SEAT
    monkeypatch.setattr(affine, "STORE_SEAT", lambda *a: seen.append(a) or real(*a))
    q.encode_kernel(x, sigma)
    monkeypatch.setattr(affine, "STORE_SEAT", real)
    args = seen[0]
    assert args[-3].shape == (3, 2, 64, 64) and args[-2] == 1.0 and args[-1] == 0
    torch.library.opcheck(torch.ops.kvarn.tile_store.default, args, test_utils=UTILS)
    for got, want in zip(torch.ops.kvarn.tile_store.default(*args), tile_store_reference(*args), strict=True):
        assert torch.equal(got, want)


@needs_kernel
def test_tile_store_opcheck_with_row_widths(monkeypatch, seed):
    """The seat's widths (key rows at their own widths, kvarn-w2.5's keys): codes [N, widths G / 8] and the widths as
    the eighth output; opcheck, and its default equals the kernel on these tiles (tests/kernels/test_cpu_store.py
    states how near-ties may differ)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 128, 64, generator=g) * torch.linspace(0.2, 3.0, 64)
    a = torch.randn(3, 64, 4, generator=g)
    _, args = _store_args("kvarn-w2.5", 0, x, a @ a.transpose(1, 2) + 0.1 * torch.eye(64), monkeypatch)
    assert args[-1] == 150 and args[2] == 4
    torch.library.opcheck(torch.ops.kvarn.tile_store.default, args, test_utils=UTILS[1:])  # e4m3 column scales
    got, want = torch.ops.kvarn.tile_store.default(*args), tile_store_reference(*args)
    assert got[0].shape == (3, 150 * 128 // 8) and got[7].shape == (3, 24)
    for k, w in zip(got, want, strict=True):
        assert torch.equal(k, w)


@needs_kernel
@pytest.mark.parametrize("d", [64, 96, 128])
def test_query_aware_coefficients_opcheck_and_reference(d, seed):
    """The coefficients seat: opcheck on the C++ kernel; against its default (`query_aware_bases`: LAPACK's float64
    factorisation) within one float32 ulp. Both are float64 computations of the same factor, each off by about
    cond(Sigma') D eps64 relative (cond <= 1 + D / 0.01 under the damping: ~1e-10 at D = 128), far under float32's
    eps, so the cast can land them at most one ulp apart. Runs of equal matrices, a NaN and an indefinite Sigma
    (identity: nearest rounding) included."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(4, d, 6, generator=g)
    sigma = a @ a.transpose(1, 2) + 0.05 * torch.eye(d)
    sigma[2, 3, 1] = float("nan")
    sigma[3] = -torch.eye(d)
    sigma = sigma[torch.tensor([0, 0, 1, 2, 3, 1])]
    seat = torch.ops.kvarn.query_aware_coefficients.default
    for rotate in (0, 1, 2):
        torch.library.opcheck(seat, (sigma, rotate, 0.01), test_utils=UTILS)
        got, want = seat(sigma, rotate, 0.01), query_aware_bases(sigma, rotate, 0.01)
        assert got.shape == want.shape == (6, 2 if rotate == 2 else 1, d, d) and got.dtype == torch.float32
        assert (got - want).abs().le(torch.finfo(torch.float32).eps * want.abs()).all()
        assert torch.equal(got.tril(-1), torch.zeros_like(got))
        assert torch.equal(got.diagonal(dim1=-2, dim2=-1), torch.ones(6, got.shape[1], d))
        assert torch.equal(got[1], got[0]) and torch.equal(got[5], got[2])
        assert torch.equal(got[3], torch.eye(d).expand_as(got[3])) and torch.equal(got[4], got[3])  # NaN, indefinite
        assert not torch.equal(got[0], got[3])


def q_auto(name: str) -> bool:
    return "auto" in name


def _decode_args(preset: str, monkeypatch, seed: int, length: int = 1, bias: bool = False, softcap=None):
    """The seat's arguments as the fused attention path passes them for one step, recorded."""
    gen = torch.Generator().manual_seed(seed)
    b, hkv, d, t = 2, 2, 64, 16 + 3 * 64 + 5
    past = build_past(preset, make_inputs("heavy", b, hkv, t, d, gen), make_inputs("gauss", b, hkv, t, d, gen), 16)
    q = make_inputs("gauss", b, 2 * hkv, length, d, gen)
    k, v = (make_inputs("gauss", b, hkv, length, d, gen) for _ in range(2))
    ok = None
    if bias:
        ok = torch.ones(b, 1, length, t + length, dtype=torch.bool)
        ok[0, :, :, 20:40] = False
    seen = []
    real = decode_mod.SEAT
    monkeypatch.setattr(decode_mod, "SEAT", lambda *a: seen.append(a) or real(*a))
    out = fused.fused_attention(q, k, v, past.keys, past.values, ok, None, d ** -0.5, softcap)
    monkeypatch.setattr(decode_mod, "SEAT", real)
    return seen[0], out


@needs_kernel
@pytest.mark.parametrize("preset,length,bias,softcap", [("kvarn-k2v2-g64", 1, False, None),
                                                        ("kvarn-auto-k2v2-g64", 1, False, None),
                                                        ("kvarn-k4v2-g64", 3, True, 30.0),
                                                        ("kvarn-w2.5", 1, False, None)])  # keys at row widths
def test_packed_decode_opcheck_and_reference(preset, length, bias, softcap, monkeypatch, seed):
    """opcheck on the CPU kernel; the default (kvarn.ops.decode) agrees with the kernel to float32 rounding of the
    different summation order (softmax over ~220 keys of O(1) logits: 1e-5 of the output scale)."""
    args, _ = _decode_args(preset, monkeypatch, seed, length, bias, softcap)
    fp8 = any(t.dtype.itemsize == 1 and t.is_floating_point() for t in (*args[4], *args[8]))
    # test_schema compares inputs before and after with arithmetic that has no float8 kernels (kvarn-auto's
    # relative column scales): the other two checks run there
    torch.library.opcheck(torch.ops.kvarn.packed_decode.default, args, test_utils=UTILS[1:] if fp8 else UTILS)
    got = torch.ops.kvarn.packed_decode.default(*args)
    ref = packed_decode_reference(*args)
    for a, r in zip(got, ref):
        assert a.shape == r.shape and a.dtype == r.dtype
        if a.numel():
            assert float((a - r).abs().max()) <= 1e-5 * (1 + float(r.abs().max()))


@needs_kernel
def test_seat_calls_the_registered_kernel_directly(monkeypatch, seed):
    """`Seat` (what kvarn's own callers call) runs the kernel registered for the argument's device without the
    dispatcher, and gives the op's outputs to the bit; a device with no kernel (and dynamo) gets the op itself."""
    args, _ = _decode_args("kvarn-auto-k2v2-g64", monkeypatch, seed, 1, False, None)
    seat = seats.Seat("packed_decode")
    want = torch.ops.kvarn.packed_decode.default(*args)
    calls = []
    real = seats._KERNELS["packed_decode", "cpu"]
    monkeypatch.setitem(seats._KERNELS, ("packed_decode", "cpu"), lambda *a: calls.append(1) or real(*a))
    got = seat(*args)
    assert calls == [1] and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    monkeypatch.delitem(seats._KERNELS, ("packed_decode", "cpu"))  # no kernel for the device: the op
    assert all(torch.equal(a, b) for a, b in zip(seat(*args), want, strict=True)) and calls == [1]
    monkeypatch.setitem(seats._KERNELS, ("packed_decode", "cpu"), lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # what dynamo's trace sees
    seat(*args)
    assert calls == [1]


def test_dispatch_is_one_rule(monkeypatch):
    monkeypatch.setenv("KVARN_KERNEL", "torch")
    assert mode() == "torch" and not fused.take(None)
    monkeypatch.setenv("KVARN_KERNEL", "bogus")
    with pytest.raises(ValueError, match="KVARN_KERNEL"):
        mode()


@needs_kernel
@pytest.mark.slow  # ~30 s of dynamo compiling; out of the CI's 25 minutes (`make test-slow`)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_decode_step_under_torch_compile(seed):
    """Greedy decode steps of a filled KVarNCache (tiny llama, 2 packed tiles per head) with the model's forward
    under torch.compile(backend="aot_eager") give the tokens of eager mode. Graph breaks are allowed, counted and
    printed (torch._dynamo.utils.counters["graph_break"]). At this commit: 37 breaks over the 3 steps (2 layers),
    all in the cache's Python code around the seats: 24 at UntypedStorage.nbytes (the store's byte accounting), 12 at
    torch.get_num_threads (the kernel's split count), 1 at a format string; the seats have fake implementations,
    so dynamo can put them in a graph."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    model = make_tiny_model("llama")
    ids = torch.randint(3, 256, (1, 140), generator=torch.Generator().manual_seed(seed))

    def run(forward, steps: int = 3) -> list[int]:
        cache = KVarNCache(model.config, "kvarn-k2v2-g64", sink=0)
        with torch.no_grad():
            out = model(input_ids=ids, past_key_values=cache, use_cache=True)
            tok, toks = out.logits[:, -1:].argmax(-1), []
            for _ in range(steps):
                toks.append(int(tok))
                out = forward(input_ids=tok, past_key_values=cache, use_cache=True)
                tok = out.logits[:, -1:].argmax(-1)
        return toks

    eager = run(model)
    torch._dynamo.reset()
    counters.clear()
    compiled = run(torch.compile(model, backend="aot_eager"))
    breaks = sum(counters["graph_break"].values())
    print(f"graph breaks in 3 compiled decode steps: {breaks} ({dict(counters['graph_break'])})")
    assert compiled == eager
    torch._dynamo.reset()


@needs_kernel
@pytest.mark.parametrize("preset", ["kvarn-k2v2-g64", "kvarn-k4v2-g64"])
def test_triton_seat_implementation(preset, monkeypatch, seed):
    """The CUDA implementation of the decode seat (kvarn.kernels.triton.register, Triton on the CPU interpreter
    here) on the arguments the fused path passes agrees with the seat's reference to float32 rounding (1e-5 of the
    output scale), and names what it does not serve (a mask and soft cap)."""
    pytest.importorskip("triton")
    from kvarn.kernels.triton import register as triton_seat

    args, _ = _decode_args(preset, monkeypatch, seed)
    got = triton_seat.packed_decode(*args)
    ref = packed_decode_reference(*args)
    for a, r in zip(got, ref):
        assert a.shape == r.shape
        if a.numel():
            assert float((a - r).abs().max()) <= 1e-5 * (1 + float(r.abs().max()))
    assert triton_seat.unsupported(args[0], 2, 2, 64, torch.ones(1), 0.0, torch.empty(0)) is not None


def test_cuda_steps_route_to_the_triton_seat(monkeypatch, seed):
    """The transformers cache's fused path on CUDA queries (kvarn.attention.fused.unsupported_cuda, answered by the
    Triton seat's reasons): a single unmasked query over 2-bit tiles qualifies; more queries, a soft cap and tiles
    kept exact name their reason; and taking it never builds the CPU extension. (Before, CUDA queries never reached
    the Triton kernel: found on the first GPU run; the route itself ran there, docs/gpu/h200-2026-12-04.md.)"""
    pytest.importorskip("triton")
    import kvarn.kernels.triton.register

    gen = torch.Generator().manual_seed(seed)
    b, hkv, d, t = 1, 2, 64, 16 + 3 * 64 + 5

    def past(preset, nonfinite=False):
        k = make_inputs("heavy", b, hkv, t, d, gen)
        if nonfinite:
            k[0, 0, 20] = float("nan")  # inside the first tile (sink 16, tile 64): kept exact
        return build_past(preset, k, make_inputs("gauss", b, hkv, t, d, gen), 16)

    # the reasons the CUDA kernel gives (the queries here are CPU tensors standing in for CUDA ones)
    monkeypatch.setattr(fused, "supported", lambda seat, device, *a: kvarn.kernels.triton.register.unsupported(*a))
    q = make_inputs("gauss", b, 2 * hkv, 1, d, gen)
    p = past("kvarn-k2v2-g64")
    assert fused.unsupported_cuda(q, p.keys, p.values, None) is None
    assert "2 queries" in fused.unsupported_cuda(q.expand(-1, -1, 2, -1), p.keys, p.values, None)
    assert "soft cap" in fused.unsupported_cuda(q, p.keys, p.values, 30.0)
    pn = past("kvarn-k2v2-g64", nonfinite=True)
    assert len(pn.keys.exact_index) and "exact" in fused.unsupported_cuda(q, pn.keys, pn.values, None)
    monkeypatch.setenv("KVARN_KERNEL", "auto")
    monkeypatch.setattr(fused, "supported", lambda *a: pytest.fail("the CPU kernel was asked"))
    assert fused.take(None, torch.device("cuda")) and not fused.take("a reason", torch.device("cuda"))
