"""Where the clipped 2-bit grid's share comes from (docs/TASKS.md, "Clipped 2-bit grids"; `AffineConfig.clip`).

    python scripts/clip_share.py gaussian
        the squared error of RTN on Gaussian rows of 128 values per share of the min-max range, at 2, 3 and 4 bits
        (20,000 rows, seed 0), and the best share of each width
    python scripts/clip_share.py per-row [--part keys|values] PRESET ...
        scripts/key_output_error.py with each row's range the MSE-best of the shares 1.0, 0.9, 0.8, 0.7, 0.6 instead
        of a fixed one (applied to the PRESETs' quantizers whose clip is below 1; the lab presets of
        scripts/budget_variants.py, e.g. kvarn-auto-k2v2-g128-qar-kc0.6-vc1; the PyTorch reference encodes, as
        KVARN_KERNEL=torch): the rule that was tried and not kept
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import torch

from kvarn.ops import rtn

SHARES = (1.0, 0.9, 0.8, 0.7, 0.6)


def gaussian() -> None:
    x = torch.randn(20000, 128, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for bits in (2, 3, 4):
        errors = {}
        for c in (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5):
            q, delta, lo = rtn.rtn_quantize(x, bits, c)
            errors[c] = float((q.double() * delta + lo - x).square().mean())
        best = min(errors, key=errors.get)
        print(f"{bits} bits: " + ", ".join(f"{c:g}: {e:.4f}" for c, e in errors.items()) + f"; best {best:g}")


def per_row_range(x: torch.Tensor, clip: float = 1.0, bits: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """The (lo, hi) of SHARES with the least squared error per row at `bits` (clip < 1; else min and max)."""
    if clip == 1.0:
        return rtn.row_range(x)
    levels = (1 << bits) - 1
    best = None
    for c in SHARES:
        lo, hi = rtn.row_range(x, c)
        delta = ((hi - lo) / levels).clamp_min(rtn.RANGE_GUARD)
        err = ((torch.round((x - lo) / delta).clamp(0, levels) * delta + lo) - x).square().sum(-1, keepdim=True)
        if best is None:
            best = err, lo, hi
        else:
            take = err < best[0]
            best = torch.where(take, err, best[0]), torch.where(take, lo, best[1]), torch.where(take, hi, best[2])
    return best[1], best[2]


def per_row(argv: list[str]) -> None:
    import os

    import kvarn.quant.affine as affine

    os.environ["KVARN_KERNEL"] = "torch"  # the store kernel clips by a fixed share: take the patched reference

    def targets(x: torch.Tensor, bits: int, clip: float = 1.0):
        lo, hi = per_row_range(x, clip, bits)
        delta = ((hi - lo) / torch.full_like(hi, (1 << bits) - 1)).clamp_min(rtn.RANGE_GUARD)
        return (x - lo) / delta, delta, lo

    def quantize(x: torch.Tensor, bits: int, clip: float = 1.0):
        u, delta, lo = targets(x, bits, clip)
        return torch.round(u).clamp_(0, (1 << bits) - 1).to(torch.uint8), delta, lo

    affine.rtn_targets, affine.rtn_quantize = targets, quantize  # the reference encode's two RTN entry points
    here = Path(__file__).parent
    sys.path.insert(0, str(here))
    sys.argv = [str(here / "key_output_error.py"), *argv]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    if sys.argv[1:2] == ["gaussian"]:
        gaussian()
    elif sys.argv[1:2] == ["per-row"]:
        per_row(sys.argv[2:])
    else:
        raise SystemExit(__doc__)
