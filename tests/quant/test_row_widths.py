"""The lab's per-channel key widths (scripts/row_widths.py; docs/TASKS.md, "Bits spread over a key tile's
channels"): the widths' allocation against brute force, and the store's tiles against the widths it chose."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import torch

from kvarn.ops.packing import unpack_codes

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
row_widths = pytest.importorskip("row_widths")


def test_allocation_is_the_brute_force_optimum() -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(40):
        # errors not convex in the width (a first bit that buys little), which a greedy allocation gets wrong
        err = torch.rand(3, 4, 5, generator=g, dtype=torch.float64).sort(-1, descending=True).values
        err = err * torch.rand(3, 4, 1, generator=g, dtype=torch.float64) * 10
        w = row_widths.allocate_widths(err, 2.0)
        assert (w.sum(-1) == 8).all() and w.min() >= 0 and w.max() <= 4
        for n in range(3):
            best = min(sum(float(err[n, r, c[r]]) for r in range(4))
                       for c in itertools.product(range(5), repeat=4) if sum(c) == 8)
            got = sum(float(err[n, r, w[n, r]]) for r in range(4))
            assert got == pytest.approx(best, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("rule", ["mse", "query"])
def test_tiles_hold_their_widths_and_beat_two_bits(rule: str) -> None:
    """Each row's codes fit its width, the widths average 2 bits, and the keys err less than the 2-bit preset's."""
    from kvarn.presets import get_preset

    g = torch.Generator().manual_seed(1)
    d = 64
    spread = torch.linspace(0.1, 3.0, d)
    x = torch.randn(4, 128, d, generator=g) * spread
    sigma = torch.diag(spread).expand(4, d, d).contiguous()
    kq = row_widths.widths_preset(2.0, rule).key(d)
    p = kq.encode(x, sigma)
    codes = unpack_codes(p.codes, 4).long()  # [N, R, C]
    used = torch.where(codes.amax(-1) == 0, 0, (codes.amax(-1) + 1).float().log2().ceil().long())
    assert used.sum(-1).max() <= 2 * d  # a row's largest code needs at most its width
    base = get_preset("kvarn-auto-k2v2-g128-qar-clip").key(d)
    err = (kq.decode(p) - x).square().sum()
    assert err < 0.8 * (base.decode(base.encode(x, sigma)) - x).square().sum()
    assert kq.packed_bits_per_element(d) == pytest.approx(base.bits_per_element(d) + 3 / 128)
