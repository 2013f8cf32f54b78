"""How much key error non-uniform (Lloyd-Max) levels or a few exact outliers could take off the 2-bit key grid
(issue 20's "Lloyd-Max levels with a few exact outliers per tile" lever), measured on the task model's real keys.

The keys of a `niah_multikey_2` prompt (full precision, one forward; post-RoPE, as the cache stores them) are cut
into the cache's 128-token tiles after the 128-token sink. Each tile goes through the paper's key path up to the
rounding: Hadamard rotation over the channels, rows = channels (axis "channel"), VarN (X = B s_col s_row). Then each
balanced row B is put on a 4-level grid in several ways (nearest rounding) and taken back to keys; each tile takes
the basis (plain or rotated) in which the preset's grid errs less under the prompt's E[q q^T], as kvarn-auto chooses
(`PRESETS` are encoded by their own quantizers, for scale). Reported, relative
to the clipped uniform grid the preset stores (clip 0.8): the squared key error over all quantized tiles, and the
attention-output proxy that chose that clip (`scripts/key_output_error.py`: |o(K^) - o(K)|^2 / |o(K)|^2 over the last
64 queries, values and other layers exact, summed over layers). The ways, with what they would cost:

    uniform clip c      lo + delta {0..3} over the row's range shrunk to c (same bytes)
    uniform best clip   the clip of each row that minimises its error, from a grid (same bytes plus a few bits)
    gauss Lloyd-Max     mean + std {-1.510, -0.4528, 0.4528, 1.510} (the 4-level Lloyd-Max levels of a normal;
                        two numbers a row, the same bytes as lo and delta)
    row Lloyd-Max       the row's own 4 optimal levels (1-D k-means; 4 numbers a row: +2 fp16 a row, an upper bound)
    + exact outliers    clip 0.8 with the tile's largest-error entries (a share of the tile) kept exact
    3 / 4 bits          uniform, clip tuned per row as above: the scale of what more key bits buy
    query-whitened      the issue's "query-whitened basis" as a candidate: keys stored as W k, W = E[q q^T]^(1/2) of
                        the whole prompt's queries per layer and head (an oracle), with or without a Hadamard after

    PYTHONPATH=$PWD .venv/bin/python scripts/lloyd_max_bound.py --seed 7 --indices 0,1 [--length 4096]
(run as a script: it takes `attend` and `recorded` from scripts/key_output_error.py)
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import torch
from budget_variants import register_variants
from key_output_error import ROWS, attend, recorded

from kvarn.eval.tasks import ruler
from kvarn.eval.tasks.base import encode
from kvarn.eval.tasks.haystack import resolve_haystack
from kvarn.models import load_model
from kvarn.ops.hadamard import hadamard_transform
from kvarn.ops.rtn import rtn_dequantize, rtn_quantize
from kvarn.ops.varn import varn
from kvarn.presets import get_preset

GAUSS_LM = torch.tensor([-1.510, -0.4528, 0.4528, 1.510], dtype=torch.float64)  # Max (1960), 4 levels, unit normal
# anchors: the lab's nearest-rounding preset with the same clipped grid, and the registered query-aware one
PRESETS = ["kvarn-auto-k2v2-g128-kc0.8-vc0.8", "kvarn-auto-k2v2-g128-qar-clip"]
WHITENED = {"query-whitened basis, clip 0.8, nearest": False, "query-whitened + Hadamard, clip 0.8, nearest": True}
CLIPS = [x / 20 for x in range(8, 21)]  # 0.40 .. 1.00


def uniform(b: torch.Tensor, bits: int, clip: float) -> torch.Tensor:
    q, delta, lo = rtn_quantize(b, bits, clip)
    return rtn_dequantize(q, delta, lo)


def best_clip(b: torch.Tensor, bits: int, w: torch.Tensor) -> torch.Tensor:
    """Per row, the uniform grid of the clip (from CLIPS) with the least weighted error."""
    best = err = None
    for c in CLIPS:
        x = uniform(b, bits, c)
        e = (((x - b) ** 2) * w).sum(-1, keepdim=True)
        best, err = (x, e) if best is None else (torch.where(e < err, x, best), torch.minimum(e, err))
    return best


def nearest(b: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """b [..., C] onto levels [..., L] (per row)."""
    i = (b[..., None] - levels[..., None, :]).abs().argmin(-1)
    return levels.gather(-1, i)


def row_lloyd_max(b: torch.Tensor, iters: int = 30) -> torch.Tensor:
    """Each row's own 4 optimal levels (1-D k-means from the row's quantiles)."""
    lv = torch.quantile(b, torch.tensor([0.125, 0.375, 0.625, 0.875], dtype=b.dtype), dim=-1).movedim(0, -1)
    for _ in range(iters):
        i = (b[..., None] - lv[..., None, :]).abs().argmin(-1)  # [..., C]
        one = torch.nn.functional.one_hot(i, 4).to(b.dtype)  # [..., C, 4]
        n = one.sum(-2)
        lv = torch.where(n > 0, (one * b[..., None]).sum(-2) / n.clamp_min(1), lv)
    return nearest(b, lv)


def with_outliers(b: torch.Tensor, base: torch.Tensor, w: torch.Tensor, share: float) -> torch.Tensor:
    """base with the tile's `share` of entries of largest weighted error exact ([N, R, C] tiles)."""
    n, r, c = b.shape
    k = max(1, round(share * r * c))
    e = (((base - b) ** 2) * w).reshape(n, -1)
    idx = e.topk(k, dim=-1).indices
    out = base.reshape(n, -1).clone()
    out.scatter_(1, idx, b.reshape(n, -1).gather(1, idx))
    return out.view(n, r, c)


def whitened(x: torch.Tensor, sigma: torch.Tensor, n: int, rotate: bool) -> torch.Tensor:
    """Tiles x [H n, G, D] stored in the query-whitened basis k' = W k, W = E[q q^T]^(1/2) of their KV head (sigma
    [H, D, D]; eigenvalues floored at 1e-6 of the largest), optionally Hadamard-rotated after: there the squared error
    is the score error the queries see, e'^T e' = e^T Sigma e. VarN, the preset's clipped 2-bit grid, nearest
    rounding, then back to keys. An oracle: W from the whole prompt's queries, one D x D matrix per layer and head."""
    lam, vec = torch.linalg.eigh(sigma)
    lam = lam.clamp_min(1e-6 * lam[..., -1:])
    w = (vec * lam.sqrt()[..., None, :]) @ vec.transpose(-1, -2)  # [H, D, D], symmetric
    w_inv = (vec * lam.rsqrt()[..., None, :]) @ vec.transpose(-1, -2)
    xw = x @ w.repeat_interleave(n, 0)
    xw = hadamard_transform(xw) if rotate else xw
    b, s_col, s_row = varn(xw.transpose(-1, -2))
    xh = (uniform(b, 2, 0.8) * s_col[..., None, :] * s_row[..., :, None]).transpose(-1, -2)
    xh = hadamard_transform(xh) if rotate else xh
    return xh @ w_inv.repeat_interleave(n, 0)


def bound_parser(description: str) -> argparse.ArgumentParser:
    """The bound scripts' arguments: which prompts, and the cache's tile and sink."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--task", default="niah_multikey_2")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--indices", default="0,1")
    ap.add_argument("--tile", type=int, default=128)
    ap.add_argument("--sink", type=int, default=128)
    return ap


def layer_tiles(args: argparse.Namespace) -> Iterator[tuple[torch.Tensor, ...]]:
    """Per layer of each prompt: (q [Hq, T, D], k, v [H, T, D], E[q q^T] of the tile's KV head [N, D, D], the key tiles
    past the sink x [N, G, D]), float64 (N = H n, the tiles of a head next to each other)."""
    torch.manual_seed(0)
    model, tok = load_model(args.model)
    hay = resolve_haystack("auto")
    for i in (int(x) for x in args.indices.split(",")):
        s = ruler.fit(args.task, args.length, args.seed, i, lambda s: encode(tok, s).shape[1] + s.new_tokens, hay)
        ids = encode(tok, s)
        print(f"sample {args.seed}/{i}: {ids.shape[1]} tokens", flush=True)
        for q, k, v in recorded(model, ids, torch.float64):
            h, t, d = k.shape
            n, g = (t - args.sink) // args.tile, args.tile
            qg = q.reshape(h, -1, d)
            sigma = (qg.transpose(1, 2) @ qg / qg.shape[1]).repeat_interleave(n, 0)  # E[q q^T] [N, D, D]
            yield q, k, v, sigma, k[:, args.sink:args.sink + n * g].reshape(h * n, g, d)


def score(chosen: dict[str, torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor,
          sink: int, key_err: dict[str, float], out_err: dict[str, float]) -> None:
    """Add each way's squared key error and attention-output proxy (keys of the tiles x replaced by its own)."""
    h, _, d = k.shape
    group = q.shape[0] // h
    exact = attend(q, k, v, group)
    for name, xh in chosen.items():
        key_err[name] = key_err.get(name, 0.0) + float((xh - x).square().sum())
        kh = k.clone()
        kh[:, sink:sink + x.shape[0] // h * x.shape[1]] = xh.reshape(h, -1, d)
        err = float((attend(q, kh, v, group) - exact).square().sum() / exact.square().sum())
        out_err[name] = out_err.get(name, 0.0) + err


def report(key_err: dict[str, float], out_err: dict[str, float], ref: str, what: str, head: str) -> None:
    """The table of both errors relative to `ref`'s, `ref` first."""
    print(f"squared key error and attention-output proxy (last {ROWS} queries, summed over layers and samples), "
          f"relative to {what}")
    print(f"| {head} | key error | output proxy |\n| --- | --- | --- |")
    for name in [ref] + [x for x in key_err if x != ref]:
        print(f"| {name} | {key_err[name] / key_err[ref]:.3f} | {out_err[name] / out_err[ref]:.3f} |")
    print(f"(the reference: output proxy {out_err[ref]:.4f} summed)")


def main() -> None:
    args = bound_parser(__doc__.splitlines()[0]).parse_args()
    register_variants()
    names = ["uniform clip 1.0 (no clip)", "uniform clip 0.8 (the preset's grid)", "uniform, best clip per row",
             "gauss Lloyd-Max (mean, std)", "row Lloyd-Max (4 levels a row)", "clip 0.8 + 0.5% exact outliers",
             "clip 0.8 + 1.0% exact outliers", "3 bits, best clip per row", "4 bits, best clip per row"]
    key_err: dict[str, float] = {}
    out_err: dict[str, float] = {}
    for q, k, v, sigma, x in layer_tiles(args):
        n, d = x.shape[0] // k.shape[0], x.shape[2]
        ways = {}
        for rotated in (False, True):  # each way in both bases (the tile's choice below)
            xb = hadamard_transform(x) if rotated else x
            b, s_col, s_row = varn(xb.transpose(-1, -2))  # rows = channels [N, D, G]
            scale = s_col[..., None, :] * s_row[..., :, None]
            w = scale ** 2  # the balanced error's weight on the keys' own scale
            base = uniform(b, 2, 0.8)
            grids = (uniform(b, 2, 1.0), base, best_clip(b, 2, w),
                     nearest(b, b.mean(-1, keepdim=True) + b.std(-1, keepdim=True) * GAUSS_LM), row_lloyd_max(b),
                     with_outliers(b, base, w, 0.005), with_outliers(b, base, w, 0.01), best_clip(b, 3, w),
                     best_clip(b, 4, w))
            for name, bh in zip(names, grids):
                xh = (bh * scale).transpose(-1, -2)
                ways.setdefault(name, []).append(hadamard_transform(xh) if rotated else xh)
        e = [((ways[names[1]][r] - x) @ sigma * (ways[names[1]][r] - x)).sum((1, 2)) for r in (0, 1)]
        rot = (e[1] < e[0])[:, None, None]  # [N, 1, 1]: the query-weighted choice, as kvarn-auto's
        chosen = {name: torch.where(rot, pair[1], pair[0]) for name, pair in ways.items()}
        for name, rotate in WHITENED.items():  # another basis: the score error is the plain error there
            chosen[name] = whitened(x, sigma[::n], n, rotate)
        for p in PRESETS:
            kq = get_preset(p).quantizers(d)[0]
            cov = getattr(kq, "takes_covariance", False)
            wt = (sigma if cov else sigma.diagonal(dim1=-2, dim2=-1)).float()
            chosen[p] = kq.decode(kq.encode(x.float(), wt)).double()
        score(chosen, q, k, v, x, args.sink, key_err, out_err)
    report(key_err, out_err, names[1], "the preset's grid with nearest rounding; each tile in the basis (plain or "
           "Hadamard) where that grid's query-weighted error is less", "grid")


if __name__ == "__main__":
    main()
