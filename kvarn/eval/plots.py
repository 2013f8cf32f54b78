"""PNG plots of the analyses (matplotlib, Agg), drawn from their JSON results so `report` can redraw them.

Each function takes the result dict an analysis writes and a path, and returns the path. Figures are
kept small (about 8x3.5 inches at 100 dpi) so they can be committed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


class _Pyplot:
    """matplotlib.pyplot (Agg), imported at first use: the analyses' discovery imports this module, and `kvarn`'s
    other commands must not need matplotlib (the `lab` extra)."""

    def __getattr__(self, name: str) -> Any:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot

        return getattr(matplotlib.pyplot, name)


plt = _Pyplot()
DPI = 100
STYLE = {"cumulative": "-", "static": "--"}


def _save(fig, path: str | Path) -> Path:
    """Write the figure as a palette PNG (256 colors): the plots use a few colors, and it is ~3x smaller."""
    from PIL import Image

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    with Image.open(path) as im:
        small = im.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    small.save(path, optimize=True)
    return path


def _grid(n: int, w: float = 3.3, h: float = 2.9, cols: int = 3, **kw):
    """A figure with n panels, up to `cols` per row; returns (fig, the n axes); spare axes are hidden."""
    cols = min(cols, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(w * cols, h * rows), squeeze=False, **kw)
    flat = list(axes.flat)
    for ax in flat[n:]:
        ax.axis("off")
    return fig, flat[:n]


def _colors(methods: list[str]) -> dict[str, Any]:
    cmap = plt.get_cmap("tab10")
    return {m: cmap(i % 10) for i, m in enumerate(methods)}


def _methods(runs: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["method"] for r in runs))


# --- pseudo-decode ------------------------------------------------------------------------------------


def error_vs_length(result: dict, path: str | Path) -> Path:
    """Attention-output MAE (mean over layers) and next-token KL per block vs context length."""
    runs, x = result["runs"], result["block_ends"]
    colors = _colors(_methods(runs))
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    for r in runs:
        kw = dict(color=colors[r["method"]], ls=STYLE[r["mode"]], lw=1.0)
        axes[0].plot(x, r["mae_mean"], label=f"{r['method']} ({r['mode']})", **kw)
        axes[1].plot(x, r["kl"], **kw)
    axes[0].set(xlabel="context length (tokens)", ylabel="attention-output MAE (mean over layers)")
    axes[1].set(xlabel="context length (tokens)", ylabel="next-token KL vs reference")
    axes[1].set_yscale("symlog", linthresh=1e-3)
    axes[1].legend(*axes[0].get_legend_handles_labels(), fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1))
    fig.suptitle("pseudo-decoding: solid = cumulative, dashed = static", fontsize=10)
    return _save(fig, path)


def static_vs_cumulative(result: dict, path: str | Path) -> Path:
    """One panel per method: MAE per block in both modes, and their ratio (cumulative / static) on a twin axis."""
    runs, x = result["runs"], result["block_ends"]
    # methods run in both modes that show an error at all (fp16 would be a flat zero)
    methods = [m for m in _methods(runs) if {r["mode"] for r in runs if r["method"] == m} == {"static", "cumulative"}
               and any(max(r["mae_mean"]) > 0 for r in runs if r["method"] == m)] or _methods(runs)
    fig, axes = _grid(len(methods), w=3.6, h=2.8)
    for ax, m in zip(axes, methods):
        by_mode = {r["mode"]: np.asarray(r["mae_mean"]) for r in runs if r["method"] == m}
        for mode, y in by_mode.items():
            ax.plot(x, y, ls=STYLE[mode], color="C0" if mode == "cumulative" else "C1", label=mode)
        if len(by_mode) == 2:
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = np.where(by_mode["static"] > 0, by_mode["cumulative"] / by_mode["static"], np.nan)
            tw = ax.twinx()
            tw.plot(x, ratio, color="C2", lw=0.8, alpha=0.7)
            tw.set_ylabel("cum / static", color="C2", fontsize=7)
            tw.tick_params(labelsize=7)
        ax.set_title(m, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6, loc="upper left")
    fig.suptitle("attention-output MAE vs context length, static vs cumulative", fontsize=9)
    return _save(fig, path)


def kivi_gap(result: dict, path: str | Path, kivi: str, kvarn: str) -> Path:
    """KIVI-like vs KVarN: both modes, and the gap MAE(kivi) - MAE(kvarn) per block."""
    runs, x = result["runs"], result["block_ends"]
    get = {(r["method"], r["mode"]): np.asarray(r["mae_mean"]) for r in runs}
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for (m, mode), y in get.items():
        if m in (kivi, kvarn):
            axes[0].plot(x, y, ls=STYLE[mode], color="C3" if m == kivi else "C0", label=f"{m} ({mode})")
    for mode in ("static", "cumulative"):
        if (kivi, mode) in get and (kvarn, mode) in get:
            axes[1].plot(x, get[(kivi, mode)] - get[(kvarn, mode)], ls=STYLE[mode], color="k", label=mode)
    axes[1].axhline(0, color="grey", lw=0.6)
    axes[0].set(xlabel="context length (tokens)", ylabel="attention-output MAE")
    axes[1].set(xlabel="context length (tokens)", ylabel=f"MAE({kivi}) - MAE({kvarn})")
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=7)
    return _save(fig, path)


def mae_per_layer(result: dict, path: str | Path) -> Path:
    """MAE of each layer's attention output, averaged over the last quarter of the blocks."""
    runs = result["runs"]
    colors = _colors(_methods(runs))
    fig, ax = plt.subplots(figsize=(8, 3.4))
    for r in runs:
        mae = np.asarray(r["mae"])
        q = mae[-max(1, len(mae) // 4):].mean(0)
        ax.plot(np.arange(len(q)), q, ls=STYLE[r["mode"]], color=colors[r["method"]],
                label=f"{r['method']} ({r['mode']})")
    ax.set(xlabel="layer", ylabel="attention-output MAE (last quarter)", yscale="log")
    ax.legend(fontsize=6, ncol=2)
    return _save(fig, path)


# --- decompose ----------------------------------------------------------------------------------------


def norm_error_vs_norm(samples: dict[str, dict[str, list[float]]], path: str | Path, kind: str, layer: int) -> Path:
    """Per-token signed norm error ||x^|| - ||x|| against ||x|| (the paper's Fig. 1b), one panel per method."""
    fig, axes = _grid(len(samples), sharey=True)
    x = kind[0]
    for ax, (m, s) in zip(axes, samples.items()):
        ax.scatter(s["norm"], s["norm_error"], s=1, alpha=0.25, color="C0", rasterized=True)
        ax.axhline(0, color="grey", lw=0.6)
        ax.set_title(m, fontsize=8)
        ax.set_xlabel(f"||{x}||", fontsize=8)
        ax.set_ylabel(f"||{x}^|| - ||{x}||", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.suptitle(f"{kind}, layer {layer} (all heads, quantized tokens): per-token norm error vs norm", fontsize=9)
    return _save(fig, path)


def joint_error(samples: dict[str, dict[str, list[float]]], path: str | Path, kind: str, layer: int) -> Path:
    """Joint scatter of magnitude error E_M against direction error E_D per token (log-log), top 1% marked."""
    fig, axes = _grid(len(samples), sharey=True)
    floor = 1e-12
    for ax, (m, s) in zip(axes, samples.items()):
        e_m, e_d = np.maximum(np.asarray(s["e_m"]), floor), np.maximum(np.asarray(s["e_d"]), floor)
        top = np.asarray(s["top1pct"], dtype=bool)
        ax.scatter(e_d[~top], e_m[~top], s=1, alpha=0.2, color="C0", rasterized=True, label="others")
        ax.scatter(e_d[top], e_m[top], s=3, alpha=0.7, color="C3", rasterized=True, label="top 1% by E_T")
        lo, hi = e_d.min() / 10, max(e_d.max(), e_m.max())  # the diagonal over the range of E_D
        ax.plot([lo, hi], [lo, hi], color="grey", lw=0.6)
        ax.set(xscale="log", yscale="log")
        ax.set_title(m, fontsize=8)
        ax.set_xlabel("E_D (direction)", fontsize=8)
        ax.set_ylabel("E_M (magnitude)", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0].legend(fontsize=6, markerscale=4)
    fig.suptitle(f"{kind}, layer {layer}: magnitude vs direction error per token (grey: E_M = E_D)", fontsize=9)
    return _save(fig, path)


# --- outliers, ppl, lines -----------------------------------------------------------------------------


def grouped_bars(groups: list[str], series: dict[str, list[float]], path: str | Path, ylabel: str,
                 title: str, errors: dict[str, list[float]] | None = None, log: bool = False) -> Path:
    """Bars of several series per group (methods on the x axis)."""
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(groups) + 2), 3.4))
    width = 0.8 / max(1, len(series))
    x = np.arange(len(groups))
    for i, (name, ys) in enumerate(series.items()):
        err = None if errors is None else errors.get(name)
        ax.bar(x + (i - (len(series) - 1) / 2) * width, ys, width, yerr=err, label=name, capsize=2)
    ax.set_xticks(x, groups, fontsize=7, rotation=15)
    ax.set(ylabel=ylabel, title=title)
    if log:
        ax.set_yscale("log")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=7)
    return _save(fig, path)


def accuracy_vs_lines(result: dict, path: str | Path) -> Path:
    """Line-retrieval accuracy vs number of lines, per method (solid cumulative, dashed static)."""
    rows = result["results"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    colors = _colors(methods)
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    for m in methods:
        for mode in ("static", "cumulative", "reference"):
            pts = sorted((r["lines"], r["accuracy"]) for r in rows if r["method"] == m and r["mode"] == mode)
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o", ms=3, ls=STYLE.get(mode, ":"), color=colors[m], label=f"{m} ({mode})")
    ax.set(xlabel="lines in the prompt", ylabel="exact-match accuracy", ylim=(-0.02, 1.02))
    ax.legend(fontsize=6)
    return _save(fig, path)


# --- decode ---------------------------------------------------------------------------------------------


def kl_vs_position(result: dict, path: str | Path, window: int = 32) -> Path:
    """Next-token KL vs position per method (`kvarn eval decode`): running mean over `window` positions."""
    runs = result["runs"]
    colors = _colors(_methods(runs))
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for r in runs:
        kl = np.asarray(r["kl"], dtype=np.float64)
        w = max(1, min(window, len(kl)))
        smooth = np.convolve(kl, np.ones(w) / w, mode="valid")  # mean of positions [p - w + 1, p]
        ax.plot(np.arange(w - 1, len(kl)), smooth, color=colors[r["method"]], lw=1.2,
                label=f"{r['method']} (mean {kl.mean():.3g})")
    ax.set(xlabel="position (tokens)", ylabel=f"KL(ref || method), mean of {window}")
    ax.set_yscale("symlog", linthresh=1e-3)
    ax.legend(fontsize=7)
    ax.set_title(f"decode protocol: {result['model']}, one token at a time", fontsize=9)
    return _save(fig, path)


# --- tasks ----------------------------------------------------------------------------------------------


def task_accuracy_vs_lines(result: dict, path: str | Path) -> Path:
    """`kvarn eval tasks`: line-retrieval accuracy vs lines per method and protocol, with Wilson 95% bars."""
    rows = [r for r in result["rows"] if r["task"] == "lines"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    colors = _colors(methods)
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    span = max((int(r["variant"].removeprefix("L=")) for r in rows), default=1)
    for i, m in enumerate(methods):
        dodge = (i - (len(methods) - 1) / 2) * 0.012 * span  # side by side, so equal accuracies stay visible
        for protocol, ls in (("serving", "-"), ("generate", "--")):
            pts = sorted((int(r["variant"].removeprefix("L=")), r["accuracy"], r["wilson"]) for r in rows
                         if r["method"] == m and r["protocol"] == protocol)
            if not pts:
                continue
            xs, ys, ci = zip(*pts)
            xs = [x + dodge for x in xs]
            err = [[y - lo for y, (lo, _) in zip(ys, ci)], [hi - y for y, (_, hi) in zip(ys, ci)]]
            ax.errorbar(xs, ys, yerr=err, marker="o", ms=3, ls=ls, capsize=2, color=colors[m],
                        label=f"{m} ({protocol})")
    ax.set(xlabel="lines in the prompt", ylabel="exact-match accuracy", ylim=(-0.02, 1.02))
    ax.legend(fontsize=6)
    return _save(fig, path)
