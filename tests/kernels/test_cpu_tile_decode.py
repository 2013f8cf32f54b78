"""The C++ tile decode (`kvarn::tile_decode`, the store's inverse; store.cpp's `tile_decode`) against the PyTorch
reference (`kvarn.quant.affine.decode_tiles`, dense=False) and the float64 oracle (tests/reference/affine.py's
`reconstruct_ref`).

Tolerance, derived. The kernel repeats the reference's float32 operations in its order: q a, + z, x t (no fused
multiply-add), then the butterflies of `kvarn.ops.hadamard` and the division by sqrt(block), then one cast to the
output dtype; so it equals the reference bit for bit, which is what is asserted, for every code width, axis,
rotation (none, hadamard, per-tile auto), scale dtype and output dtype. Against the float64 oracle: three float32
roundings of the affine step (relative 2^-24 each of values bounded by M = max |(q a + z) t|) and, for rotated
tiles, log2(D) butterfly stages (each adds at most 2^-24 of a value bounded by sqrt(D) M in magnitude, before the
division): atol = (3 + log2(D)) * 2^-24 * sqrt(D) * M.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import kvarn.kernels.cpu.build as build_mod
from kvarn.kernels.cpu import store as store_kernel
from kvarn.ops.packing import unpack_codes
from kvarn.quant.affine import AffineConfig, AffineQuantizer, decode_kernel, decode_tiles, tile_decode_reference
from tests.reference.affine import reconstruct_ref
from tests.reference.data import heavy_tailed

FAMILIES = {"rtn": ("none", False), "kvarn": ("hadamard", True), "auto": ("auto", True)}
UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.fixture(autouse=True)
def kernel_only(monkeypatch):
    if not store_kernel.load():
        pytest.skip(f"the CPU kernel cannot be built here: {build_mod.error()}")
    monkeypatch.setenv("KVARN_KERNEL", "cpu")


def encoded(family: str, bits: int, axis: str, tile: int, d: int, seed: int, scale=torch.float16, col=None,
            n: int = 6):
    rotate, use_varn = FAMILIES[family]
    q = AffineQuantizer(AffineConfig(bits, axis, rotate, use_varn, tile=tile, scale_dtype=scale, col_scale_dtype=col),
                        "mse")
    x = heavy_tailed(n, tile, d, generator=torch.Generator().manual_seed(seed)).float()
    return q, q.encode(x)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("axis", ["channel", "token"])
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_kernel_equals_reference_bit_for_bit(family, axis, bits, seed):
    """Every code width, axis and rotation, float32 / bf16 / fp16 outputs: the kernel's tiles are the reference's."""
    _, p = encoded(family, bits, axis, 32, 64, seed)
    if family == "auto":  # both bases among the tiles, whatever the encode chose (the decode follows the flags)
        p = dataclasses.replace(p, rotated=torch.arange(len(p.rotated), dtype=torch.uint8) % 2)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = decode_kernel(p, dtype)
        assert got is not None and got.dtype == dtype
        assert torch.equal(got, decode_tiles(p, dtype)), dtype
        assert torch.equal(decode_tiles(p, dtype, dense=True), got)  # the fast path takes the kernel


@pytest.mark.parametrize(("scale", "col"), [(torch.bfloat16, None), (torch.float32, None),
                                            (torch.float16, torch.float8_e4m3fn), (torch.float8_e4m3fn, None)])
def test_scale_dtypes_and_other_shapes(scale, col, seed):
    """Row scales in bf16 / float32 / e4m3 (fp16 zeros), 8-bit relative column scales, tiles of 128 x 64 and 16 x 128,
    leading dimensions kept."""
    for tile, d in ((128, 64), (16, 128)):
        _, p = encoded("auto", 2, "channel", tile, d, seed, scale, col)
        got = decode_kernel(p.unflatten((2, 3)), torch.bfloat16)
        assert got.shape == (2, 3, tile, d)
        assert torch.equal(got.flatten(0, 1), decode_tiles(p, torch.bfloat16))


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_kernel_against_float64_oracle(family, axis, seed):
    """The kernel's float32 tiles against (q a + z) t, transposed, @ H in float64 (the module docstring's bound)."""
    _, p = encoded(family, 3, axis, 32, 64, seed)
    got = decode_kernel(p, torch.float32).double()
    d = 64
    for n in range(len(got)):
        fields = (unpack_codes(p.codes[n], 3).tolist(), p.row_scale[n].double().tolist(),
                  p.row_zero[n].double().tolist(), None if p.col_scale is None else p.col_scale[n].double().tolist())
        rotated = family == "kvarn" or (family == "auto" and bool(p.rotated[n]))
        m = reconstruct_ref(*fields, axis, False).abs().max().item()  # M: the affine step's largest value
        atol = (3 + math.log2(d)) * 2.0**-24 * math.sqrt(d) * m
        torch.testing.assert_close(got[n], reconstruct_ref(*fields, axis, rotated), rtol=0, atol=atol)


def test_seat_opcheck_and_default(seed):
    """opcheck of the seat on its CPU kernel; its default (the PyTorch reference) gives the same tiles."""
    _, p = encoded("auto", 2, "token", 32, 64, seed)
    args = (p.codes, p.row_scale, p.row_zero, p.col_scale, p.rotated, 2, False, 2, 32, 2)
    torch.library.opcheck(torch.ops.kvarn.tile_decode.default, args, test_utils=UTILS)
    assert torch.equal(torch.ops.kvarn.tile_decode.default(*args), tile_decode_reference(*args))


def test_torch_mode_and_what_the_kernel_does_not_serve(monkeypatch, seed):
    """KVARN_KERNEL=torch: no kernel (dense=True keeps its matmul); refined rows: auto falls back, cpu names why."""
    _, p = encoded("kvarn", 2, "channel", 32, 64, seed)
    monkeypatch.setenv("KVARN_KERNEL", "torch")
    assert decode_kernel(p, torch.float32) is None
    monkeypatch.setenv("KVARN_KERNEL", "auto")
    assert decode_kernel(p, torch.float64) is None  # float64: the dense path's own precision
    q = AffineQuantizer(AffineConfig(2, "channel", "hadamard", True, tile=32, refine=0.125), "mse")
    r = q.encode(heavy_tailed(2, 32, 64, generator=torch.Generator().manual_seed(seed)).float())
    assert decode_kernel(r, torch.float32) is None
    monkeypatch.setenv("KVARN_KERNEL", "cpu")
    with pytest.raises(RuntimeError, match="refined rows"):
        decode_kernel(r, torch.float32)
