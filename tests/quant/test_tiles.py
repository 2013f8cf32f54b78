"""Typed tiles: the computed layout of AffineTiles equals what a real encode stores, for every preset; the vLLM page
layout computed from it equals the one learned by encoding a probe tile; the generic container methods."""

from __future__ import annotations

import pytest
import torch

from kvarn.presets import get_preset, preset_names
from kvarn.quant.affine import AffineQuantizer
from kvarn.quant.base import TileQuantizer
from kvarn.quant.tiles import AffineTiles, Tiles


def _affine(head_dim: int):
    for name in preset_names():
        p = get_preset(name)
        if p.quantized:
            for kind, q in zip(("keys", "values"), p.quantizers(head_dim)):
                if isinstance(q, AffineQuantizer):
                    yield name, kind, q


@pytest.mark.parametrize("head_dim", [64, 128, 96])
def test_spec_bytes_equal_stored_bytes(head_dim):
    """Per field: shape, dtype and bytes of `AffineFormat.fields` == those of an encode (kernel or reference), and
    `bits_per_element` (computed) == the measured one of `TileQuantizer`."""
    x = torch.randn(3, 1, head_dim, generator=torch.Generator().manual_seed(0))
    for name, kind, q in _affine(head_dim):
        fmt = q.format(head_dim)
        p = q.encode(x.expand(3, q.tile, head_dim).contiguous() + torch.randn(3, q.tile, head_dim))
        assert isinstance(p, AffineTiles) and p.fmt == fmt, (name, kind)
        got = [(k, tuple(t.shape[1:]), t.dtype) for k, t in p.items()]
        assert got == [(f.name, f.shape, f.dtype) for f in fmt.fields], (name, kind)
        assert p.nbytes == 3 * fmt.nbytes, (name, kind)
        assert q.bits_per_element(head_dim) == TileQuantizer.bits_per_element(q, head_dim), (name, kind)


def _probed_offsets(preset, head_dim: int) -> list[tuple[str, str, int, int]]:
    """The page layout as it was learned before typed tiles: encode a probe tile, align each field to its itemsize."""
    probe = torch.randn(1, preset.tile, head_dim, generator=torch.Generator().manual_seed(0))
    out, at = [], 0
    for kind, q in zip(("keys", "values"), preset.quantizers(head_dim)):
        for name, t in q.encode(probe).items():
            n = t[0].numel() * t.element_size()
            at = -(-at // t.element_size()) * t.element_size()
            out.append((kind, name, at, n))
            at += n
    return out


def test_vllm_layout_matches_the_probed_one():
    """Page bytes stay identical: offsets computed from the format equal those of the old probe encode."""
    from kvarn.integrations.vllm.layout import TileLayout

    for name in ("kvarn-k2v2-g128", "kvarn-k4v2-g64", "kvarn-auto-k2v2-g128", "kvarn-k2v2-g128-fp8"):
        if name not in preset_names():
            continue
        for d in (64, 128):
            lay = TileLayout(get_preset(name), d, torch.bfloat16)
            assert [(f.kind, f.name, f.offset, f.nbytes) for f in lay.fields] == _probed_offsets(get_preset(name), d)


def test_generic_methods_round_trip():
    q = get_preset("kvarn-auto-k2v2-g64").quantizers(64)[0]
    p = q.encode(torch.randn(6, 64, 64))
    u = p.unflatten((2, 3))
    assert u.axes(3)[:2] == (2, 3) and torch.equal(u.flatten(2).codes, p.codes)
    both = Tiles.cat([p.select(slice(0, 2)), Tiles(), p.select(slice(2, 6))])
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(both.items(), p.items()))
    again = q.template(64).with_tensors(p.tensors())
    assert again.fmt == p.fmt and again.names() == p.names() and again.nbytes == p.nbytes
    assert not Tiles() and len(Tiles()) == 0 and len(p) == 6
    zero = p.zeroed(torch.tensor([True, False, False, False, False, False]))
    assert not zero.codes[0].any() and torch.equal(zero.codes[1:], p.codes[1:])
