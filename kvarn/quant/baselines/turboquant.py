"""TurboQuant (Zandieh et al., 2025, arXiv 2504.19874): random rotation + Lloyd–Max scalar codebook per coordinate.

Per token and head, x in R^D (arithmetic in float32; float64 inputs stay float64):
    n = ||x||, u = x / n                         the norm is stored (fp16), the direction is quantized
    y = Pi u                                     Pi: random orthogonal D x D matrix, QR of a seeded Gaussian
                                                 matrix (signs fixed so it is Haar-distributed); y is uniform on
                                                 the sphere, whatever x was
    q_i = argmin_j |y_i - c_j|                   c: Lloyd–Max codebook (2^b levels) for the density of one
                                                 coordinate of a uniformly random unit vector in R^D,
                                                 f(t) ∝ (1 - t^2)^((D-3)/2) on [-1, 1] (≈ N(0, 1/D) for large D),
                                                 computed by Lloyd iterations when first needed, never typed in
    x^ = n * Pi^T c[q]
QJL residual (`qjl=True`, TurboQuant_prod): b - 1 bits for the codebook above, plus a 1-bit sketch of the
residual r = u - Pi^T c[q]: signs s = sign(S r) with S a seeded D x D standard Gaussian matrix, and ||r||
(fp16); the residual comes back as sqrt(pi/2) / D * ||r|| * S^T s, which makes <query, x^> unbiased.

Stored per token (tiles are one token: tokens are independent):
    codes [N, 1, D*b/8] (b-bit codes packed along D), norm [N, 1] fp16
    with QJL also signs [N, 1, D/8] and residual_norm [N, 1] fp16
The rotation, the sketch matrix and the codebook depend only on (D, b, seed); they are rebuilt, not stored, as
model constants would be, so they are not counted. Bits per element: b + 16/D (+ 16/D with QJL).
The `turboquant` preset is the KVarN paper's 3/3 setting: 3-bit keys and values, every token quantized as it
is written, and the first and last 2 layers kept in full precision (`fp_layers = (2, 2)`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from kvarn.ops.packing import pack_codes, unpack_codes
from kvarn.ops.rtn import check_bits
from kvarn.quant.base import TileQuantizer, check_tiles
from kvarn.quant.baselines.common import decode_dtype, dtype_name, work
from kvarn.quant.baselines.spec import PresetEntry, PresetSpec
from kvarn.quant.cache_policy import CachePolicy
from kvarn.quant.tiles import Tiles

LLOYD_GRID = 1 << 20  # cells of the tabulated density; centroids land far below 1e-6 sigma of the exact ones
LLOYD_TOL = 1e-12  # stop when no centroid moves more than this many sigmas
LLOYD_MAX_ITERS = 100_000


@functools.cache
def lloyd_max_codebook(dim: int, bits: int) -> torch.Tensor:
    """Lloyd–Max levels [2^bits] (float64, ascending) for f(t) ∝ (1 - t^2)^((dim-3)/2) on [-1, 1].

    The density is tabulated on a fine grid over [-min(1, 16 sigma), +min(1, 16 sigma)] (sigma = 1/sqrt(dim);
    beyond 16 sigma there is no mass worth a level), its running integrals F(t) = ∫ f and M(t) = ∫ t f are
    interpolated linearly, and Lloyd's two conditions are iterated from the quantiles: boundaries at the
    midpoints of neighbouring levels, each level the mean of its cell, c_j = ΔM / ΔF.
    """
    if dim < 2:
        raise ValueError(f"TurboQuant needs head_dim >= 2, got {dim}")
    if not 1 <= bits <= 8:
        raise ValueError(f"codebook bits must be in 1..8, got {bits}")
    sigma = 1.0 / math.sqrt(dim)
    half = min(1.0, 16.0 * sigma)
    edges = np.linspace(-half, half, LLOYD_GRID + 1)
    h = edges[1] - edges[0]
    mid = 0.5 * (edges[1:] + edges[:-1])
    logf = 0.5 * (dim - 3) * np.log1p(-mid * mid)
    f = np.exp(logf - logf.max())
    F = np.concatenate([[0.0], np.cumsum(f)])
    M = np.concatenate([[0.0], np.cumsum(f * mid)])

    def integral(table: np.ndarray, t: np.ndarray) -> np.ndarray:
        pos = (t + half) / h
        i = np.clip(np.floor(pos).astype(np.int64), 0, LLOYD_GRID - 1)
        return table[i] + (pos - i) * (table[i + 1] - table[i])

    levels = 1 << bits
    c = np.interp((np.arange(levels) + 0.5) / levels, F / F[-1], edges)
    for _ in range(LLOYD_MAX_ITERS):
        b = np.concatenate([[-half], 0.5 * (c[1:] + c[:-1]), [half]])
        new = np.diff(integral(M, b)) / np.diff(integral(F, b))
        moved = np.abs(new - c).max()
        c = new
        if moved <= LLOYD_TOL * sigma:
            break
    return torch.from_numpy(c)


@functools.cache
def random_rotation(dim: int, seed: int) -> torch.Tensor:
    """Haar-random orthogonal [dim, dim] float64: Q of the QR of a seeded Gaussian matrix, columns sign-fixed."""
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r)).unsqueeze(0)


@functools.cache
def gaussian_sketch(dim: int, seed: int) -> torch.Tensor:
    """QJL's [dim, dim] float64 matrix of i.i.d. N(0, 1) entries, seeded."""
    return torch.randn(dim, dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _matmul(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x [..., D] @ m [D, E] as one 2-D GEMM (a batched 3-D matmul of 1-token tiles is far slower on CPU)."""
    return (x.reshape(-1, x.shape[-1]) @ m).reshape(*x.shape[:-1], m.shape[-1])


@dataclass(frozen=True)
class TurboTiles(Tiles):
    """TurboQuant tokens (`TurboQuantizer`): codes [N, G, D*b/8] uint8, norm [N, G]; with QJL signs [N, G, D/8] uint8
    and residual_norm [N, G]."""

    codes: torch.Tensor | None
    norm: torch.Tensor | None
    signs: torch.Tensor | None = None
    residual_norm: torch.Tensor | None = None


class TurboQuantizer(TileQuantizer):
    """Random rotation, fp16 norm, Lloyd–Max codes per coordinate; optional 1-bit QJL residual."""

    tiles_type = TurboTiles

    def __init__(self, head_dim: int, bits: int = 3, qjl: bool = False, seed: int = 0, tile: int = 1,
                 norm_dtype: torch.dtype = torch.float16) -> None:
        self.mse_bits = bits - 1 if qjl else bits
        if self.mse_bits < 1:
            raise ValueError(f"TurboQuant with QJL needs at least 2 bits, got {bits}")
        check_bits(self.mse_bits)
        if head_dim * self.mse_bits % 8 or (qjl and head_dim % 8):
            raise ValueError(f"head_dim {head_dim} does not pack into whole bytes at {self.mse_bits} bits"
                             + (" plus 1-bit signs" if qjl else ""))
        self.bits, self.qjl, self.seed = bits, qjl, seed
        self.head_dim, self.tile, self.norm_dtype = head_dim, tile, norm_dtype
        self.codebook = lloyd_max_codebook(head_dim, self.mse_bits)
        self.rotation = random_rotation(head_dim, seed)
        self.sketch = gaussian_sketch(head_dim, seed + 1) if qjl else None
        self._consts: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, ...]] = {}
        self.name = f"turbo{'-qjl' if qjl else ''}{bits}"

    def _constants(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """(codebook, boundaries, Pi, S) on the inputs' device and dtype."""
        key = (device, dtype)
        if key not in self._consts:
            cb = self.codebook
            sk = self.sketch if self.sketch is not None else torch.zeros(0, 0, dtype=torch.float64)
            self._consts[key] = tuple(t.to(device=device, dtype=dtype) for t in
                                      (cb, 0.5 * (cb[1:] + cb[:-1]), self.rotation, sk))
        return self._consts[key]

    def encode(self, x: torch.Tensor) -> TurboTiles:
        check_tiles(x, self.tile, self.head_dim)
        w = work(x)
        cb, bounds, rot, sk = self._constants(w.device, w.dtype)
        norm = torch.linalg.vector_norm(w, dim=-1, keepdim=True)  # [N, G, 1]
        u = w / norm.clamp_min(torch.finfo(w.dtype).tiny)
        q = torch.bucketize(_matmul(u, rot.T), bounds)  # nearest level: boundaries are the midpoints
        codes, norm = pack_codes(q.to(torch.uint8), self.mse_bits), norm.squeeze(-1).to(self.norm_dtype)
        if not self.qjl:
            return TurboTiles(codes, norm)
        r = u - _matmul(cb[q], rot)
        return TurboTiles(codes, norm, pack_codes((_matmul(r, sk.T) >= 0).to(torch.uint8), 1),
                          torch.linalg.vector_norm(r, dim=-1).to(self.norm_dtype))

    def decode(self, packed: TurboTiles, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        norm = packed.norm
        ft = decode_dtype(norm)
        cb, _, rot, sk = self._constants(norm.device, ft)
        u = _matmul(cb[unpack_codes(packed.codes, self.mse_bits).long()], rot)  # [N, G, D]
        if self.qjl:
            s = unpack_codes(packed.signs, 1).to(ft) * 2 - 1
            coef = math.sqrt(math.pi / 2) / self.head_dim * packed.residual_norm.to(ft).unsqueeze(-1)
            u = u + coef * _matmul(s, sk)
        return (u * norm.to(ft).unsqueeze(-1)).to(dtype)

    def describe(self) -> Mapping[str, object]:
        return {"name": self.name, "tile": self.tile, "bits": self.bits, "codebook_bits": self.mse_bits,
                "qjl": self.qjl, "seed": self.seed, "rotation": "Haar (QR of seeded Gaussian)",
                "codebook": "Lloyd-Max, sphere-coordinate density", "norm_dtype": dtype_name(self.norm_dtype)}


def turboquant_preset(k_bits: int = 3, v_bits: int = 3, qjl: bool = False, fp_layers: tuple[int, int] = (2, 2),
                      seed: int = 0, name: str | None = None) -> PresetSpec:
    return PresetSpec(
        name=name or f"turboquant{'-qjl' if qjl else ''}-k{k_bits}v{v_bits}",
        description="TurboQuant: random rotation, fp16 norm, Lloyd-Max codes"
                    + (", 1-bit QJL residual on keys" if qjl else "") + f", fp layers {fp_layers}",
        key=lambda d: TurboQuantizer(d, k_bits, qjl=qjl, seed=seed),
        value=lambda d: TurboQuantizer(d, v_bits, seed=seed),
        policy=CachePolicy(tile=1, sink=0, value_window="block", fp_layers=fp_layers), family="turboquant",
        k_bits=k_bits, v_bits=v_bits, params={"qjl": qjl, "seed": seed}, notes={"paper": "arXiv:2504.19874"},
    )


PRESETS: tuple[PresetEntry, ...] = (
    ("turboquant-k3v3", turboquant_preset, ("turboquant",)),
    ("turboquant-qjl-k3v3", lambda: turboquant_preset(qjl=True), ("turboquant-qjl",)),
)
