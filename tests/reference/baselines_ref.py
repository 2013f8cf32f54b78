"""Float64 oracles of the baselines (docs/SPEC.md §5), written plainly from each method's description, not from kvarn.

Every function takes token-major tiles x [N, G, D] (any float dtype, computed in float64 Python floats) and
returns plain lists/tensors: the codes, the scales as computed (unrounded), and for each code a *margin*: how
far, in code units, the unrounded value was from a decision boundary of the quantizer (a rounding tie for RTN,
a bin edge for binning, a midpoint between levels for a codebook). Tests allow a code to differ from the
reference only where that margin is below a stated tolerance.
"""

from __future__ import annotations

import itertools
import math

import torch

from .hadamard import hadamard_reference
from .rtn import rtn_row


def _tiles(x: torch.Tensor) -> list[list[list[float]]]:
    return x.double().tolist()


def _transpose(m: list[list[float]]) -> list[list[float]]:
    return [list(col) for col in zip(*m)]


def _rtn_margins(positions: list[float]) -> list[float]:
    """Distance of each unrounded position to the nearest .5 (a tie of round-to-nearest)."""
    return [abs(abs(p - math.floor(p)) - 0.5) for p in positions]


def rtn_range_row(row: list[float], bits: int, lo: float, hi: float) -> tuple[list[int], float, list[float]]:
    """RTN with a given range: delta = max((hi - lo)/(2^b - 1), 1e-10), q = clamp(round((clamp(x) - lo)/delta))."""
    levels = 2**bits - 1
    delta = max((hi - lo) / levels, 1e-10)
    codes, margins = [], []
    for v in row:
        pos = (min(max(v, lo), hi) - lo) / delta
        codes.append(min(max(round(pos), 0), levels))
        margins.append(abs(abs(pos - math.floor(pos)) - 0.5))
    return codes, delta, margins


# --- KIVI keys (per channel over the tile) -------------------------------------------------------------------

def kivi_keys_ref(x: torch.Tensor, bits: int) -> dict:
    """Per tile, per channel d: rtn over the G values x[0..G-1][d]. codes [N][D][G], scale/zero [N][D]."""
    out = {"codes": [], "scale": [], "zero": [], "margin": []}
    for tile in _tiles(x):
        codes, scale, zero, margin = [], [], [], []
        for channel in _transpose(tile):
            q, delta, lo, pos = rtn_row(channel, bits)
            codes.append(q)
            scale.append(delta)
            zero.append(lo)
            margin.append(_rtn_margins(pos))
        for k, v in zip(("codes", "scale", "zero", "margin"), (codes, scale, zero, margin)):
            out[k].append(v)
    return out


def channel_rows_recon(codes, scale, zero) -> torch.Tensor:
    """x^[n][g][d] = codes[n][d][g] * scale[n][d] + zero[n][d] (rows = channels)."""
    out = []
    for c_t, s_t, z_t in zip(codes, scale, zero):
        rows = [[q * s_t[d] + z_t[d] for q in c_t[d]] for d in range(len(c_t))]
        out.append(_transpose(rows))
    return torch.tensor(out, dtype=torch.float64)


# --- per-token RTN in channel groups (KIVI values, QuaRot, PolarQuant values) ------------------------------

def token_rtn_ref(x: torch.Tensor, bits: int, group: int, rotate: bool = False, clip: float | None = None) -> dict:
    """Per token: w = x @ H if rotate; groups of `group` channels; range [min, max] or, with clip r,
    [r min(min, 0), r max(max, 0)] with values clamped. codes [N][G][D], scale/zero [N][G][D/group]."""
    d = x.shape[-1]
    w = x.double() @ hadamard_reference(d) if rotate else x.double()
    out = {"codes": [], "scale": [], "zero": [], "margin": []}
    for tile in _tiles(w):
        t_codes, t_scale, t_zero, t_margin = [], [], [], []
        for token in tile:
            codes, scale, zero, margin = [], [], [], []
            for start in range(0, d, group):
                row = token[start:start + group]
                if clip is None:
                    q, delta, lo, pos = rtn_row(row, bits)
                    m = _rtn_margins(pos)
                else:
                    lo = clip * min(min(row), 0.0)
                    hi = clip * max(max(row), 0.0)
                    q, delta, m = rtn_range_row(row, bits, lo, hi)
                codes += q
                margin += m
                scale.append(delta)
                zero.append(lo)
            t_codes.append(codes)
            t_scale.append(scale)
            t_zero.append(zero)
            t_margin.append(margin)
        for k, v in zip(("codes", "scale", "zero", "margin"), (t_codes, t_scale, t_zero, t_margin)):
            out[k].append(v)
    return out


def token_rtn_recon(codes, scale, zero, group: int, rotate: bool) -> torch.Tensor:
    """x^[n][g][c] = codes * scale[group of c] + zero[group of c], then @ H if rotated."""
    out = [[[q * s_tok[c // group] + z_tok[c // group] for c, q in enumerate(c_tok)]
            for c_tok, s_tok, z_tok in zip(c_t, s_t, z_t)] for c_t, s_t, z_t in zip(codes, scale, zero)]
    t = torch.tensor(out, dtype=torch.float64)
    return t @ hadamard_reference(t.shape[-1]) if rotate else t


# --- KVQuant dense-and-sparse ------------------------------------------------------------------------------

def dense_sparse_ref(x: torch.Tensor, bits: int, axis: str, k: int) -> dict:
    """Rows = channels over the tile (axis "channel") or tokens (axis "token"). Per row: the k values farthest
    from the row mean are outliers (positions ascending); the rest set the RTN range; outliers take code 0."""
    levels = 2**bits - 1
    out = {"codes": [], "scale": [], "zero": [], "index": [], "outliers": [], "margin": []}
    for tile in _tiles(x):
        rows = _transpose(tile) if axis == "channel" else tile
        t = {key: [] for key in out}
        for row in rows:
            mean = sum(row) / len(row)
            by_distance = sorted(range(len(row)), key=lambda i: -abs(row[i] - mean))
            chosen = sorted(by_distance[:k])
            inliers = [v for i, v in enumerate(row) if i not in chosen]
            lo, hi = min(inliers), max(inliers)
            delta = max((hi - lo) / levels, 1e-10)
            codes, margin = [], []
            for i, v in enumerate(row):
                if i in chosen:
                    codes.append(0)
                    margin.append(0.5)
                    continue
                pos = (v - lo) / delta
                codes.append(min(max(round(pos), 0), levels))
                margin.append(abs(abs(pos - math.floor(pos)) - 0.5))
            for key, v in zip(t, (codes, delta, lo, chosen, [row[i] for i in chosen], margin)):
                t[key].append(v)
        for key in out:
            out[key].append(t[key])
    return out


def dense_sparse_recon(codes, scale, zero, index, outliers, axis: str) -> torch.Tensor:
    out = []
    for c_t, s_t, z_t, i_t, o_t in zip(codes, scale, zero, index, outliers):
        rows = []
        for c_r, s, z, idx, vals in zip(c_t, s_t, z_t, i_t, o_t):
            row = [q * s + z for q in c_r]
            for i, v in zip(idx, vals):
                row[i] = v
            rows.append(row)
        out.append(_transpose(rows) if axis == "channel" else rows)
    return torch.tensor(out, dtype=torch.float64)


# --- PolarQuant keys --------------------------------------------------------------------------------------

def _bin_row(row: list[float], bits: int) -> tuple[list[int], float, float, list[float]]:
    """Binning: s = max((max - min)/2^b, 1e-10), q = min(floor((v - min)/s), 2^b - 1); margin to a bin edge."""
    lo = min(row)
    s = max((max(row) - lo) / 2**bits, 1e-10)
    codes, margin = [], []
    for v in row:
        pos = (v - lo) / s
        codes.append(min(max(math.floor(pos), 0), 2**bits - 1))
        margin.append(abs(pos - round(pos)))
    return codes, s, lo, margin


def polar_ref(x: torch.Tensor, radius_bits: int, angle_bits: int) -> dict:
    """Pairs (d, d + D/2): rho = sqrt(a^2 + b^2), phi = atan2(b, a) in [0, 2 pi); each binned per pair over the
    tile's tokens. Fields [N][D/2][G] (codes, margins) and [N][D/2] (scales, minima)."""
    keys = ("r_codes", "r_scale", "r_min", "r_margin", "t_codes", "t_scale", "t_min", "t_margin")
    out = {k: [] for k in keys}
    for tile in _tiles(x):
        half = len(tile[0]) // 2
        t = {k: [] for k in keys}
        for p in range(half):
            rho = [math.sqrt(tok[p] ** 2 + tok[p + half] ** 2) for tok in tile]
            phi = []
            for tok in tile:
                angle = math.atan2(tok[p + half], tok[p])
                phi.append(angle + 2 * math.pi if angle < 0 else angle)
            for prefix, vals, bits in (("r", rho, radius_bits), ("t", phi, angle_bits)):
                codes, s, lo, margin = _bin_row(vals, bits)
                t[f"{prefix}_codes"].append(codes)
                t[f"{prefix}_scale"].append(s)
                t[f"{prefix}_min"].append(lo)
                t[f"{prefix}_margin"].append(margin)
        for k in keys:
            out[k].append(t[k])
    return out


def polar_recon(r_codes, r_scale, r_min, t_codes, t_scale, t_min) -> torch.Tensor:
    """rho^ = (q + 1/2) s + min, same for phi; x^_p = rho^ cos phi^, x^_{p + D/2} = rho^ sin phi^."""
    out = []
    for n in range(len(r_codes)):
        half, g = len(r_codes[n]), len(r_codes[n][0])
        tile = [[0.0] * (2 * half) for _ in range(g)]
        for p in range(half):
            for j in range(g):
                rho = (r_codes[n][p][j] + 0.5) * r_scale[n][p] + r_min[n][p]
                phi = (t_codes[n][p][j] + 0.5) * t_scale[n][p] + t_min[n][p]
                tile[j][p] = rho * math.cos(phi)
                tile[j][p + half] = rho * math.sin(phi)
        out.append(tile)
    return torch.tensor(out, dtype=torch.float64)


# --- TurboQuant -------------------------------------------------------------------------------------------

def _matvec(m: list[list[float]], v: list[float]) -> list[float]:
    return [sum(m_ij * v_j for m_ij, v_j in zip(row, v)) for row in m]


def turbo_ref(x: torch.Tensor, codebook: list[float], rotation: torch.Tensor, sketch: torch.Tensor | None = None
              ) -> dict:
    """Per token: n = ||x||, u = x/n, y = Pi u, q_i = nearest level; with a sketch S: r = u - Pi^T c[q],
    signs = [S r >= 0], gamma = ||r||. Margin: distance of y_i to the nearest midpoint, in units of the
    local level spacing."""
    pi = rotation.double().tolist()
    pi_t = _transpose(pi)
    s = sketch.double().tolist() if sketch is not None else None
    mids = [(a + b) / 2 for a, b in itertools.pairwise(codebook)]
    gap = min(b - a for a, b in itertools.pairwise(codebook)) if len(codebook) > 1 else 1.0
    out = {"codes": [], "norm": [], "margin": [], "signs": [], "rnorm": [], "sign_margin": []}
    for tile in _tiles(x):
        t = {k: [] for k in out}
        for tok in tile:
            n = math.sqrt(sum(v * v for v in tok))
            u = [v / n if n > 0 else 0.0 for v in tok]
            y = _matvec(pi, u)
            codes = [min(range(len(codebook)), key=lambda j, yi=yi: abs(yi - codebook[j])) for yi in y]
            t["codes"].append(codes)
            t["norm"].append(n)
            t["margin"].append([min(abs(yi - m) for m in mids) / gap if mids else 1.0 for yi in y])
            if s is not None:
                u_hat = _matvec(pi_t, [codebook[q] for q in codes])
                r = [a - b for a, b in zip(u, u_hat)]
                proj = _matvec(s, r)
                t["signs"].append([1 if p >= 0 else 0 for p in proj])
                t["rnorm"].append(math.sqrt(sum(v * v for v in r)))
                t["sign_margin"].append([abs(p) for p in proj])
        for k in out:
            out[k].append(t[k])
    return out


def turbo_recon(codes, norm, codebook, rotation, signs=None, rnorm=None, sketch=None) -> torch.Tensor:
    """x^ = n (Pi^T c[q] + sqrt(pi/2)/D * gamma * S^T (2 signs - 1))."""
    pi_t = _transpose(rotation.double().tolist())
    s_t = _transpose(sketch.double().tolist()) if sketch is not None else None
    out = []
    for n_i in range(len(codes)):
        tile = []
        for j, q in enumerate(codes[n_i]):
            u = _matvec(pi_t, [codebook[c] for c in q])
            if s_t is not None:
                d = len(q)
                corr = _matvec(s_t, [2.0 * b - 1.0 for b in signs[n_i][j]])
                u = [a + math.sqrt(math.pi / 2) / d * rnorm[n_i][j] * c for a, c in zip(u, corr)]
            tile.append([norm[n_i][j] * v for v in u])
        out.append(tile)
    return torch.tensor(out, dtype=torch.float64)


def sphere_coordinate_density(dim: int):
    """Unnormalized density of one coordinate of a uniform unit vector in R^dim: (1 - t^2)^((dim-3)/2)."""
    return lambda t: (1.0 - t * t).clamp_min(0.0) ** ((dim - 3) / 2)


def _simpson(f, a: float, b: float, n: int = 800) -> float:
    """Composite Simpson's rule on [a, b] with n (even) intervals, float64."""
    t = torch.linspace(a, b, n + 1, dtype=torch.float64)
    w = torch.ones(n + 1, dtype=torch.float64)
    w[1:-1:2], w[2:-1:2] = 4.0, 2.0
    return float((f(t) * w).sum() * (b - a) / (3 * n))


def lloyd_max_ref(dim: int, bits: int, iters: int = 5000, tol: float = 1e-11) -> list[float]:
    """Lloyd's algorithm, cell by cell with Simpson's rule, started from levels evenly spaced over +-2 sigma."""
    f = sphere_coordinate_density(dim)
    levels = 2**bits
    sigma = 1 / math.sqrt(dim)
    c = [-2 * sigma + 4 * sigma * (j + 0.5) / levels for j in range(levels)]
    for _ in range(iters):
        edges = [-1.0] + [(a + b) / 2 for a, b in itertools.pairwise(c)] + [1.0]
        new = []
        for a, b in itertools.pairwise(edges):
            mass = _simpson(f, a, b)
            new.append(_simpson(lambda t: t * f(t), a, b) / mass)
        moved = max(abs(p - q) for p, q in zip(new, c))
        c = new
        if moved < tol * sigma:
            break
    return c


def coordinate_mse_ref(dim: int, codebook: list[float]) -> float:
    """E[(y - c(y))^2] for one coordinate y of a uniform unit vector in R^dim, c the nearest level."""
    f = sphere_coordinate_density(dim)
    edges = [-1.0] + [(a + b) / 2 for a, b in itertools.pairwise(codebook)] + [1.0]
    total = _simpson(f, -1.0, 1.0, 20000)
    err = 0.0
    for (a, b), c in zip(itertools.pairwise(edges), codebook):
        err += _simpson(lambda t, c=c: (t - c) ** 2 * f(t), a, b, 4000)
    return err / total


# --- Kitty keys -------------------------------------------------------------------------------------------

def kitty_ref(x: torch.Tensor, bits: int, high_bits: int, k: int) -> dict:
    """Per tile: channels ranked by mean |x| over the tile's tokens; the top k (ascending) use high_bits;
    every channel is RTN over its G tokens. codes [N][D][G], scale/zero [N][D], promoted [N][k]."""
    out = {"codes": [], "scale": [], "zero": [], "promoted": [], "margin": []}
    for tile in _tiles(x):
        channels = _transpose(tile)
        score = [sum(abs(v) for v in ch) / len(ch) for ch in channels]
        promoted = sorted(sorted(range(len(channels)), key=lambda d: -score[d])[:k])
        t = {key: [] for key in out}
        t["promoted"] = promoted
        for d, ch in enumerate(channels):
            q, delta, lo, pos = rtn_row(ch, high_bits if d in promoted else bits)
            t["codes"].append(q)
            t["scale"].append(delta)
            t["zero"].append(lo)
            t["margin"].append(_rtn_margins(pos))
        for key in out:
            out[key].append(t[key])
    return out
