"""Check one stored tile against the float64 oracle of docs/SPEC.md §3 (`quantize_tile_ref`), at a stated tolerance.

Compared in the tile's rows domain (rotated back with the reference H where rotated), per element:
  * 3 half-ulps of fp16 of (|q a| + |z|) |t|: the stored a, z, t are fp16-rounded;
  * 2^bits * 2^-24 |t|: fp16 scales below 2^-14 are subnormal, absolute spacing 2^-24 (tiny and denormal inputs);
  * 1e-5 of the tile's largest reconstruction: float32 arithmetic of the fast path;
  * one step |a t| where the reference's position (B - lo) / delta lies within 1e-3 of a rounding tie.
"""

from __future__ import annotations

import math

import torch

from .affine import quantize_tile_ref
from .hadamard import hadamard_reference


def tile_error_excess(x: torch.Tensor, got: torch.Tensor, bits: int, axis: str, rotate: bool,
                      use_varn: bool) -> float:
    """x, got [G, D] (the tile's input, the store's reconstruction): max over elements of |got - want| - tol
    (<= 0 when the tile matches the oracle)."""
    ref = quantize_tile_ref(x.double(), bits, axis, rotate, use_varn=use_varn)
    g = got.double()
    g = g @ hadamard_reference(g.shape[1]) if rotate else g
    g = g.T if axis == "channel" else g  # [R, C]
    q = torch.tensor(ref.codes, dtype=torch.float64)
    a = torch.tensor(ref.a, dtype=torch.float64).unsqueeze(1)
    z = torch.tensor(ref.z, dtype=torch.float64).unsqueeze(1)
    t = torch.tensor(ref.t, dtype=torch.float64).unsqueeze(0)
    want = (q * a + z) * t
    tie = torch.tensor([[abs(p - math.floor(p) - 0.5) < 1e-3 for p in row] for row in ref.positions])
    u = 2.0**-11
    tol = (3 * u * (q * a.abs() + z.abs()) * t.abs() + 2**bits * 2.0**-24 * t.abs() + 1e-5 * want.abs().max()
           + tie * (a * t).abs())
    return float(((g - want).abs() - tol).max())
