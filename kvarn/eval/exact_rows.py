"""Oracle mixes for `kvarn eval attribute`: a KVarNCache on the reference read path whose reads take chosen rows of
the quantized region exact (issue 20, item 1: the loss by token and by KV head).

A spec is `PART:WHICH`, PART `keys` or `kv` (keys and values), WHICH one of:
  none          nothing exact (a control: equals the preset on the reference path)
  gold-line     the tokens of the context line that holds the gold answer (needle tasks)
  other-line    a line as long, ten lines away (a control for gold-line)
  head<h>       KV head h, every token
  top-err<r>    in every 128-token tile, per KV head, the r rows with the largest squared quantization error
  top-norm<r>   the same with the largest exact row norm (massive-activation tokens)
  top-qerr<r>   the same with the largest query-weighted error e^T E[q q^T] e (the running query second moment of a
                query-aware preset, as of the read: an upper bound of a choice made at the tile's store)
  top-mass<r>   the same with the largest attention mass received from the queries up to the tile's end (mid-sequence
                sinks: the softmax weights of the tile's own prompt chunk and earlier ones, summed over the query
                heads of the KV head; exact keys, scale 1/sqrt(D)): what a store could choose when it quantizes the
                tile, if the attention of that chunk handed it its weights
The per-tile choices see only the tile itself: a store could make them when the tile is quantized (what keeping r
rows exact would cost: r x 16 bits per head_dim elements, plus an index, per 128-token tile).

The exact rows are the ones the store was handed (its frame: post-RoPE unless the preset stores keys pre-RoPE), kept
beside the store; a read replaces the selected rows of `LayerStore.full()` with them. Only rows in [tiles_start,
tail_start) are selected: the sink and the tail are exact already.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import NamedTuple

import torch

PARTS = ("keys", "kv")
WHICH = re.compile(r"^(none|gold-line|other-line|head(\d+)|top-(err|norm|qerr|mass)(\d+))$")


class Seen(NamedTuple):
    """What the queries left as of a read: E[q q^T] [B, H, D, D] of a query-aware preset, and the attention mass
    [B, H, T] each row received from the queries up to its tile's end (None where not kept)."""
    cov: torch.Tensor | None = None
    mass: torch.Tensor | None = None


NOT_SEEN = Seen()
# (exact, decoded, tiles_start, tail_start) [B, H, T, D], Seen -> bool [B, H, T]
Selector = Callable[[torch.Tensor, torch.Tensor, int, int, Seen], torch.Tensor]


def parse(spec: str) -> tuple[str, str]:
    part, _, which = spec.partition(":")
    if part not in PARTS or not WHICH.match(which):
        raise ValueError(f"exact-row spec {spec!r}: expected PART:WHICH with PART in {PARTS} and WHICH one of none, "
                         "gold-line, other-line, head<h>, top-err<r>, top-norm<r>, top-qerr<r>, top-mass<r>")
    return part, which


def selector(which: str, lines: dict[str, list[int]] | None, tile: int) -> Selector:
    """The mask of rows to read exact; `lines` maps gold-line/other-line to token positions."""
    m = WHICH.match(which)
    if m is None:
        raise ValueError(f"exact-row selection {which!r}: expected none, gold-line, other-line, head<h>, top-err<r>, "
                         "top-norm<r>, top-qerr<r> or top-mass<r>")

    def select(ex: torch.Tensor, dec: torch.Tensor, lo: int, hi: int, seen: Seen = NOT_SEEN) -> torch.Tensor:
        mask = torch.zeros(ex.shape[:3], dtype=torch.bool, device=ex.device)
        inner = mask[:, :, lo:hi]  # a view: writes land in mask
        if which == "none" or hi <= lo:
            return mask
        if which in ("gold-line", "other-line"):
            if lines is None or which not in lines:
                raise ValueError(f"{which} needs a needle task whose gold answer sits on one context line")
            pos = torch.tensor([p for p in lines[which] if lo <= p < hi], dtype=torch.long)
            mask[:, :, pos] = True
            return mask
        if m.group(2) is not None:
            h = int(m.group(2))
            if h >= ex.shape[1]:
                raise ValueError(f"head{h}: the model has {ex.shape[1]} KV heads")
            inner[:, h] = True
            return mask
        r = int(m.group(4))
        seg = slice(lo, hi)
        err = (dec[:, :, seg] - ex[:, :, seg]).float()  # [B, H, hi - lo, D]
        if m.group(3) == "qerr":
            if seen.cov is None:
                raise ValueError(f"{which}: no running query statistics (a query-aware preset, e.g. one ending in "
                                 "-qar, keeps them)")
            score = ((err @ seen.cov.float()) * err).sum(-1)  # e^T C e per row
        elif m.group(3) == "mass":
            if seen.mass is None:
                raise ValueError(f"{which}: no queries were observed (the attention function hands them over)")
            score = seen.mass[:, :, seg]
        else:
            score = (err ** 2).sum(-1) if m.group(3) == "err" else ex[:, :, seg].float().norm(dim=-1)
        b, h, n = score.shape
        tiles = score.view(b, h, n // tile, tile)  # the region is whole tiles
        top = tiles.topk(min(r, tile), dim=-1).indices
        inner.view(b, h, n // tile, tile).scatter_(-1, top, True)
        return mask

    select.needs_mass = m.group(3) == "mass"  # type: ignore[attr-defined]  # `_ExactReads` then tracks the mass
    return select


def open_tile_mass(q: torch.Tensor, k: torch.Tensor, sink: int, tile: int) -> torch.Tensor:
    """q [B, Hq, t, D], the queries of the last t of the n positions of keys k [B, Hk, n, D] (post-RoPE both) -> the
    softmax weight [B, Hk, n] (float32) each key row gets from them: causal, scale 1/sqrt(D), summed over the query
    heads of its KV head and the t queries, counting a row only while its tile is open (the query's position before
    the end of the row's tile: tiles of `tile` rows after a sink of `sink`; sink rows count throughout)."""
    b, hk, n, d = k.shape
    t, g = q.shape[2], q.shape[1] // hk
    qpos, kpos = torch.arange(n - t, n, device=k.device), torch.arange(n, device=k.device)
    s = (q.float().view(b, hk, g, t, d) @ k.float()[:, :, None].transpose(-1, -2)) * d ** -0.5  # [B, Hk, g, t, n]
    w = s.masked_fill(kpos > qpos[:, None], float("-inf")).softmax(-1)
    end = torch.where(kpos >= sink, sink + ((kpos - sink) // tile + 1) * tile, n)  # each row's tile end
    return (w * (qpos[:, None] < end)).sum((2, 3))


def exact_cache(config, preset: str, spec: str, lines: dict[str, list[int]] | None = None, sink: int | None = None):
    """A fresh KVarNCache of `preset` on the reference read path that reads the rows `spec` (PART:WHICH) picks
    exact; `lines` as `selector` takes them."""
    from kvarn.integrations.transformers import KVarNCache

    part, which = parse(spec)
    cache = KVarNCache(config, preset, sink=sink, attention="reference")
    mix_exact(cache, part, selector(which, lines, cache.preset.policy.tile))
    return cache


def mix_exact(cache, part: str, select: Selector) -> None:
    """Make every quantized KVarNLayer of `cache` (attention="reference", nothing cached yet) read the rows `select`
    picks exact: keys, or keys and values (`part` "kv")."""
    if getattr(cache, "attention", None) != "reference":
        raise ValueError("exact-row mixes patch the reference read path: build the KVarNCache with "
                         "attention='reference'")
    for layer in cache.layers:
        store = getattr(layer, "store", None)
        if store is not None and store.keys.quantizer is not None:
            _ExactReads(layer, part, select)


class _ExactReads:
    """The patch of one layer. Bound methods, not closures: `copy.deepcopy(cache)` (the gold answer's copy) copies
    them with their layer, store and kept rows, so the copy's reads and appends never reach the original's."""

    def __init__(self, layer, part: str, select: Selector) -> None:
        self.part, self.select = part, select
        self.kept: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        self.append, self.full, self.store = layer._append, layer.store.full, layer.store
        layer._append, layer.store.full = self._append, self._full
        self.mass: torch.Tensor | None = None  # [B, H, T] float32, for top-mass
        if getattr(select, "needs_mass", False):
            if layer.rope is not None:
                raise ValueError("top-mass weighs the stored keys with post-RoPE queries: not for a preset that "
                                 "stores keys pre-RoPE")
            self.tile, self.observe = layer.policy.tile, layer.store.observe_queries
            layer.store.observe_queries = self._observe

    def _append(self, k, v, positions, pad) -> None:
        self.kept[0].append(k.detach().clone())
        self.kept[1].append(v.detach().clone())
        self.append(k, v, positions, pad)

    def _observe(self, q: torch.Tensor) -> None:
        """q [B, Hq, t, D], the queries of the newest t positions (post-RoPE, as attention sees them): add the softmax
        weights they give each exact key row, counting a row's only while its tile is still open (the query's
        position before the tile's end), then hand them on to the store."""
        k = torch.cat(self.kept[0], dim=2)  # [B, Hk, n, D], post-RoPE
        mass = open_tile_mass(q.detach(), k, self.store.keys.sink_len, self.tile)
        if self.mass is not None:
            mass[:, :, :self.mass.shape[2]] += self.mass
        self.mass = mass
        self.observe(q)

    def _full(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = list(self.full())
        queries = self.store.queries
        cov = queries.covariance() if queries is not None and hasattr(queries, "covariance") else None
        for j, ts in enumerate((self.store.keys, self.store.values)[:2 if self.part == "kv" else 1]):
            ex = torch.cat(self.kept[j], dim=2).to(out[j].dtype)
            mass = self.mass
            if mass is not None and mass.shape[2] < ex.shape[2]:  # rows appended since the last queries
                mass = torch.nn.functional.pad(mass, (0, ex.shape[2] - mass.shape[2]))
            mask = self.select(ex, out[j], ts.tiles_start, ts.tail_start, Seen(cov, mass))
            out[j] = torch.where(mask[..., None], ex, out[j])
        return out[0], out[1]


def needle_lines(tok, prompt_text: str, ids: torch.Tensor, gold_ref: str, away: int = 10) -> dict[str, list[int]]:
    """Token positions (in `ids`, whose start is `prompt_text` tokenized) of the context line holding `gold_ref`
    and of the line `away` lines after it (before it near the end)."""
    enc = tok(prompt_text, add_special_tokens=False, return_offsets_mapping=True)
    n = len(enc["input_ids"])
    if ids[0, :n].tolist() != enc["input_ids"]:
        raise ValueError("the prompt's tokens differ from its text tokenized with offsets; cannot place its lines")
    at = prompt_text.find(f" {gold_ref}.")
    if at < 0 or prompt_text.find(f" {gold_ref}.", at + 1) >= 0:
        raise ValueError(f"the gold answer {gold_ref!r} is not on exactly one line of the prompt")
    starts = [0] + [i + 1 for i, c in enumerate(prompt_text) if c == "\n"]
    line = max(i for i, s in enumerate(starts) if s <= at)
    other = line + away if line + away < len(starts) - 1 else line - away

    def tokens(i: int) -> list[int]:
        lo, hi = starts[i], (starts[i + 1] - 1 if i + 1 < len(starts) else len(prompt_text))
        return [t for t, (a, b) in enumerate(enc["offset_mapping"]) if a < hi and b > lo]

    return {"gold-line": tokens(line), "other-line": tokens(other)}
