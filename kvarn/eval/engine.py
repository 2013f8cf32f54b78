"""Block-by-block runs of one token sequence on several caches in lockstep with the reference.

The sequence ids [1, T] is cut into blocks of b tokens. For each block, the reference (a transformers
`DynamicCache`, full precision) runs first; then every quantized run appends the same block to its own
`KVarNCache` and is compared with the reference on that block:

    cumulative  the run's own K/V enter its cache, so quantization errors feed forward: later blocks
                attend to corrupted K/V and produce corrupted K/V themselves
    static      before the block, `set_store_override(l, k_ref, v_ref)` makes every layer store the
                reference K/V of the block instead of its own, so the cache always holds the quantized
                *reference* K/V and nothing accumulates across blocks (the block itself still attends
                its own fresh K/V)

Per position p and run:   kl[p]   = KL(p_ref(.|<=p) || p_run(.|<=p)) in float64 (ops.metrics; the
                                    reference's log softmax is computed once per block)
                          nll[p]  = -log p_run(ids[p+1] | <=p)   (NaN at the last position)
                          top1[p] = argmax p_run == argmax p_ref
Per block j, layer l:     mae[j, l] = mean over the block's tokens and hidden units of |o_run - o_ref|,
                          o = output of the layer's self_attn (after o_proj)
Running in lockstep keeps only one block of reference logits and attention outputs in memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from kvarn.cache.store import Bytes
from kvarn.eval.forward import (
    AttentionRecorder,
    forward_block,
    inference,
    newest_kv,
    override_store,
    quantized_cache,
    reference_cache,
)
from kvarn.eval.progress import progress
from kvarn.ops.metrics import kl_from_log_probs, log_probs
from kvarn.presets import Preset

Mode = Literal["static", "cumulative"]
MODES: tuple[Mode, ...] = ("static", "cumulative")


@dataclass(frozen=True)
class RunSpec:
    """One quantized run: a label, the preset (or a derived one) and the mode."""

    method: str
    preset: Preset
    mode: Mode = "cumulative"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")

    @property
    def label(self) -> str:
        return f"{self.method}/{self.mode}"


@dataclass
class Trace:
    """Results of one run over T positions cut into blocks (see the module docstring)."""

    spec: RunSpec | None  # None for the reference
    block: int
    kl: list[torch.Tensor] = field(default_factory=list)  # per block [t] float64
    nll: list[torch.Tensor] = field(default_factory=list)  # per block [t] float64
    top1: list[torch.Tensor] = field(default_factory=list)  # per block [t] bool
    mae: list[torch.Tensor] = field(default_factory=list)  # per block [L] float64
    seconds: float = 0.0  # wall time of this run's forwards
    nbytes: Bytes | None = None  # the cache's bytes at the end
    extra: dict = field(default_factory=dict)  # what `run_blocks(inspect=...)` read from the cache at the end

    def positions(self, name: str) -> torch.Tensor:
        """kl, nll or top1 over all positions, [T]."""
        return torch.cat(getattr(self, name))

    def per_block(self, name: str) -> torch.Tensor:
        """Block means of kl, nll (NaN-free) or top1, [n_blocks]; mae -> [n_blocks, L]."""
        if name == "mae":
            return torch.stack(self.mae)
        return torch.stack([x.double().nanmean() for x in getattr(self, name)])

    @property
    def block_ends(self) -> list[int]:
        """Context length after each block (the x axis of the error-vs-length plots)."""
        ends, n = [], 0
        for k in self.kl:
            n += k.numel()
            ends.append(n)
        return ends


def _nll(lp: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-lp[target] per position (lp: float64 log-probabilities [t, V]); NaN where target < 0."""
    out = -lp.gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return torch.where(targets >= 0, out, torch.full_like(out, float("nan")))


def _mae(outs: list[torch.Tensor], refs: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([(o.double() - r.double()).abs().mean() for o, r in zip(outs, refs)])


def run_blocks(model: nn.Module, ids: torch.Tensor, specs: list[RunSpec], block: int, *, sink: int | None = None,
               desc: str = "blocks", show_progress: bool = True,
               inspect: Callable[[object], dict] | None = None) -> tuple[Trace, list[Trace]]:
    """Run ids [1, T] in blocks of `block` on the reference and on every spec; returns (reference, runs)."""
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"expected token ids of shape [1, T], got {tuple(ids.shape)}")
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    n = ids.shape[1]
    targets = torch.cat([ids[0, 1:], ids.new_full((1,), -1)])  # next token; -1 = none
    ref = Trace(None, block)
    traces = [Trace(s, block) for s in specs]
    need_kv = any(s.mode == "static" for s in specs)
    with inference(model), AttentionRecorder(model) as rec:
        ref_cache = reference_cache(model)
        caches = [quantized_cache(model, s.preset, sink) for s in specs]
        for start in progress(range(0, n, block), desc=desc, unit="block", disable=not show_progress):
            x = ids[:, start:start + block]
            t, tgt = x.shape[1], targets[start:start + block]
            t0 = time.perf_counter()
            ref_logits = forward_block(model, x, ref_cache)[0]
            ref.seconds += time.perf_counter() - t0
            ref_out = rec.take()
            ref.kl.append(torch.zeros(t, dtype=torch.float64))
            ref_lp = log_probs(ref_logits)  # [t, V] float64, shared by every run's KL
            ref.nll.append(_nll(ref_lp, tgt).cpu())
            ref.top1.append(torch.ones(t, dtype=torch.bool))
            ref.mae.append(torch.zeros(len(ref_out), dtype=torch.float64))
            ref_top = ref_logits.argmax(-1)
            # clone: the cache may keep a view, which would pin the reference's whole tensor
            kv = [(k.clone(), v.clone()) for k, v in newest_kv(ref_cache, t)] if need_kv else []
            for spec, cache, tr in zip(specs, caches, traces):
                t0 = time.perf_counter()
                if spec.mode == "static":
                    override_store(cache, kv)
                logits = forward_block(model, x, cache)[0]
                tr.seconds += time.perf_counter() - t0
                lp = log_probs(logits)
                tr.kl.append(kl_from_log_probs(ref_lp, lp).cpu())
                tr.nll.append(_nll(lp, tgt).cpu())
                tr.top1.append((logits.argmax(-1) == ref_top).cpu())
                tr.mae.append(_mae(rec.take(), ref_out).cpu())
        for cache, tr in zip(caches, traces):
            tr.nbytes = cache.nbytes()
            if inspect is not None:  # e.g. the stored rotation choices (kvarn eval decode)
                tr.extra = inspect(cache)
    return ref, traces
