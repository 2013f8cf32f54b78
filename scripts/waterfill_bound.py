"""What spending the same 2 bits per key element unevenly over a tile's channels could buy (transform coding: a basis
that concentrates the keys' energy, then reverse water-filling of the bits over its channels), measured on the task
model's real keys before building anything. Issue 20's "a rotation flattens channel differences" lever.

The keys of a `niah_multikey_2` prompt (full precision, one forward; post-RoPE, as the cache stores them) are cut
into the cache's 128-token tiles after the 128-token sink. Each tile is put in a basis, through VarN (rows =
channels), and each row gets a width of 0-4 bits: 0 keeps the row's mean, b > 0 the uniform grid with the row's best
clip. The widths are chosen per tile to minimise the weighted error, summing to 2 bits a row on average
(`kvarn.ops.widths.allocate_widths`; the preset's bytes plus 3 bits a row for the widths, +0.02 bits per element).
Weights: "mse" the keys' own squared error; "query" that error times the queries' energy on the channel (diag
E[q q^T] in the basis, the whole prompt's: an oracle for the running statistics a cache keeps). Bases:

    plain        the keys as they are
    hadamard     the cache's rotation
    pca-sink     per layer and KV head, the eigenbasis of the sink's keys (a decoder could derive it: no bytes)
    pca-prompt   per layer and KV head, the eigenbasis of the whole prompt's keys (an oracle)
    pca-tile     each tile's own eigenbasis (an oracle: D x D numbers a tile)

Reported as in scripts/lloyd_max_bound.py: squared key error and the attention-output proxy (last 64 queries, values
and other layers exact, summed over layers), relative to the preset's grid (2 bits every row, clip 0.8, nearest
rounding, each tile in the basis of plain or Hadamard that errs less under E[q q^T], as kvarn-auto chooses).

    PYTHONPATH=$PWD .venv/bin/python scripts/waterfill_bound.py --seed 7 --indices 0,1 [--length 4096]
"""

from __future__ import annotations

import torch
from lloyd_max_bound import bound_parser, layer_tiles, report, score, uniform

from kvarn.ops.hadamard import hadamard_transform
from kvarn.ops.varn import varn
from kvarn.ops.widths import width_targets


def eigenbasis(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns [.., D, D] of x [.., T, D]'s second moment, largest first."""
    _, vec = torch.linalg.eigh(x.transpose(-1, -2) @ x)
    return vec.flip(-1)


def coded(x: torch.Tensor, qdiag: torch.Tensor | None, mean_bits: float | None) -> torch.Tensor:
    """Tiles x [N, G, D] (in their basis) through VarN and per-row grids; mean_bits None: 2 bits every row, clip 0.8
    (the preset's grid), else the lab store's widths and clips (`kvarn.ops.widths.width_targets`, nearest rounding).
    qdiag [N, D]: the queries' energy per channel, weighting the allocation (None: mse)."""
    b, s_col, s_row = varn(x.transpose(-1, -2))  # rows = channels [N, D, G]
    scale = s_col[..., None, :] * s_row[..., :, None]
    if mean_bits is None:
        return (uniform(b, 2, 0.8) * scale).transpose(-1, -2)
    u, delta, lo, levels, _ = width_targets(b, s_col, s_row, qdiag, round(mean_bits * x.shape[2]))
    bh = torch.minimum(torch.round(u).clamp(min=0), levels[..., None]) * delta + lo
    return (bh * scale).transpose(-1, -2)


def main() -> None:
    ap = bound_parser(__doc__.splitlines()[0])
    ap.add_argument("--mean-bits", type=float, default=2.0)
    args = ap.parse_args()
    ref = "preset's grid (2 bits a row, clip 0.8; plain or hadamard)"
    key_err: dict[str, float] = {}
    out_err: dict[str, float] = {}
    for q, k, v, sigma, x in layer_tiles(args):
        n, d = x.shape[0] // k.shape[0], x.shape[2]
        eye = torch.eye(d, dtype=x.dtype).expand(x.shape[0], d, d)
        bases = {"plain": eye, "hadamard": hadamard_transform(eye),
                 "pca-sink": eigenbasis(k[:, :args.sink]).repeat_interleave(n, 0),
                 "pca-prompt": eigenbasis(k).repeat_interleave(n, 0), "pca-tile": eigenbasis(x)}
        chosen: dict[str, torch.Tensor] = {}
        grid = {}
        for name, u in bases.items():  # x = (x u) u^T, u orthonormal
            xu = x @ u
            qdiag = (u.transpose(-1, -2) @ sigma @ u).diagonal(dim1=-2, dim2=-1)
            if name in ("plain", "hadamard"):
                grid[name] = chosen[f"{name}, 2 bits every row"] = coded(xu, None, None) @ u.transpose(-1, -2)
            for rule in ("mse", "query"):
                xh = coded(xu, qdiag if rule == "query" else None, args.mean_bits)
                chosen[f"{name}, {rule} widths"] = xh @ u.transpose(-1, -2)
        e = [((grid[b] - x) @ sigma * (grid[b] - x)).sum((1, 2)) for b in ("plain", "hadamard")]
        rot = (e[1] < e[0])[:, None, None]  # kvarn-auto's choice of the two
        chosen[ref] = torch.where(rot, grid["hadamard"], grid["plain"])
        for rule in ("mse", "query"):
            chosen[f"plain or hadamard as the preset chose, {rule} widths"] = torch.where(
                rot, chosen[f"hadamard, {rule} widths"], chosen[f"plain, {rule} widths"])
        score(chosen, q, k, v, x, args.sink, key_err, out_err)
    report(key_err, out_err, ref, f"the preset's grid; widths average {args.mean_bits} bits a row", "keys")


if __name__ == "__main__":
    main()
