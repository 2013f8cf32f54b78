"""Per-tile choice of the key rotation (issue 6), from statistics available online.

Why a choice: quantizing keys per channel adapts to each channel's range. The Hadamard rotation mixes
the channels; it helps when their scales are moderate (SmolLM2) and hurts when a few key channels have far
higher variance than the rest and the queries barely read those channels (Qwen2: k_proj bias): the
rotation spreads the large channels' quantization error into every channel, including those the queries
weigh most.

What is compared: a tile's error in attention logits. For a query q and a key k quantized to k^, the logit
moves by q . (k^ - k). Over the queries that will read the tile, with per-channel query energy
w_d = E[q_d^2] and errors treated as uncorrelated across channels,

    E_q[(q . e_g)^2] ~= sum_d w_d e_{g,d}^2,      e = x^ - x   (one key token g)
    err(x^) = sum_g sum_d w_d (x^_{g,d} - x_{g,d})^2                                          [N]

and the rotated encoding is kept where err(rotated) < err(plain). w is not known in advance; the cache
keeps a running mean of q_d^2 over the queries seen so far for each KV head (`QueryEnergy`, the query
heads of a GQA group pooled), which is causal and costs D numbers per head. A prompt's own queries count:
the cache defers its key tiles until the attention function has observed them (`LayerStore.observe_queries`).
With no query at all (an attention implementation that cannot observe, e.g. "eager"), w = 1: plain squared
error (the cache warns).

Policies share one signature: (x, x_rot, x_plain, weight) -> keep_rotation, with x, x_rot, x_plain
[N, G, D] token-major (the tile, its rotated encoding decoded, its plain encoding decoded), weight
[N, D] or None, and keep_rotation bool [N].
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch

RotationPolicy = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def weighted_error(x: torch.Tensor, x_hat: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """sum_g sum_d weight_d (x^ - x)^2 per tile: x, x_hat [N, G, D], weight [N, D] or None (= 1) -> [N]."""
    e2 = (x_hat.float() - x.float()).square().sum(dim=-2)  # [N, D]: squared error per channel
    return (e2 * weight.float()).sum(-1) if weight is not None else e2.sum(-1)


def query_weighted(x: torch.Tensor, x_rot: torch.Tensor, x_plain: torch.Tensor,
                   weight: torch.Tensor | None = None) -> torch.Tensor:
    """Keep the rotation where it gives the lower expected squared logit error (module docstring)."""
    return weighted_error(x, x_rot, weight) < weighted_error(x, x_plain, weight)


def squared_error(x: torch.Tensor, x_rot: torch.Tensor, x_plain: torch.Tensor,
                  weight: torch.Tensor | None = None) -> torch.Tensor:
    """Ablation: plain squared error, ignoring the queries (all channels weigh the same)."""
    return weighted_error(x, x_rot, None) < weighted_error(x, x_plain, None)


def channel_normalized(x: torch.Tensor, x_rot: torch.Tensor, x_plain: torch.Tensor,
                       weight: torch.Tensor | None = None) -> torch.Tensor:
    """Ablation: squared error with each channel divided by its variance over the tile (queries ignored)."""
    w = x.float().var(dim=-2).clamp_min(1e-12).reciprocal()  # [N, D]
    return weighted_error(x, x_rot, w) < weighted_error(x, x_plain, w)


def always(x: torch.Tensor, x_rot: torch.Tensor, x_plain: torch.Tensor,
           weight: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ones(x.shape[0], dtype=torch.bool, device=x.device)


def never(x: torch.Tensor, x_rot: torch.Tensor, x_plain: torch.Tensor,
          weight: torch.Tensor | None = None) -> torch.Tensor:
    return torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)


POLICIES: dict[str, RotationPolicy] = {
    "query": query_weighted,
    "mse": squared_error,
    "chnorm": channel_normalized,
    "always": always,
    "never": never,
}
DEFAULT_POLICY = "query"


def kernel_weighted(policy: RotationPolicy) -> bool | None:
    """For the fused store kernels, which compute the two policies they know: whether `policy` reads the weight
    (query: True, mse: False); None for any other policy (the PyTorch reference then encodes)."""
    return True if policy is query_weighted else False if policy is squared_error else None


def get_policy(name: str | RotationPolicy) -> RotationPolicy:
    if callable(name):
        return name
    if name not in POLICIES:
        raise ValueError(f"unknown rotation policy {name!r}; valid: {', '.join(POLICIES)}")
    return POLICIES[name]


class QueryEnergy:
    """Running mean of q_d^2 for each batch row, KV head and channel: the `weight` of `query_weighted`.

    update(q [B, Hq, t, D], kv_heads) pools the Hq / Hk query heads that share a KV head (GQA) and the t
    positions:  sum[b, h, d] += sum over the heads of group h and the positions of q^2,  count += (Hq / Hk) t
    weight() = sum / count  [B, Hk, D], or None before the first update.
    Accumulated in float32 (float64 stays float64); the scale of w does not matter to the comparison.
    (The full second moment E[q q^T], D x D per head, was measured too: no better under the decode protocol.)
    """

    def __init__(self) -> None:
        self.sum: torch.Tensor | None = None  # [B, Hk, D]
        self.count = 0

    def update(self, q: torch.Tensor, kv_heads: int) -> None:
        if q.dim() != 4:
            raise ValueError(f"expected queries [batch, heads, tokens, head_dim], got shape {tuple(q.shape)}")
        b, hq, t, d = q.shape
        if kv_heads < 1 or hq % kv_heads:
            raise ValueError(f"{hq} query heads do not split into {kv_heads} KV heads")
        if self.sum is not None and self.sum.shape != self._shape(b, kv_heads, d):
            raise ValueError(f"queries of shape {tuple(q.shape)} do not match the running statistics of shape "
                             f"{tuple(self.sum.shape)}")
        w = q.detach() if q.dtype == torch.float64 else q.detach().float()
        self.accumulate(self.moments(w.reshape(b, kv_heads, hq // kv_heads * t, d)), hq // kv_heads * t)

    @staticmethod
    def moments(w: torch.Tensor) -> torch.Tensor:
        """Queries pooled per KV head [B, Hk, n, D] -> their summed squares [B, Hk, D] (what `accumulate` adds)."""
        return w.square().sum(dim=2)

    @staticmethod
    def _shape(b: int, kv_heads: int, d: int) -> tuple[int, ...]:
        return b, kv_heads, d

    def accumulate(self, squares: torch.Tensor, count: int) -> None:
        """Add sums of squared queries already pooled per KV head, [B, Hk, D], over `count` (head, position) pairs:
        for callers that hold the squares anyway (vLLM's backend checks them for non-finite values first)."""
        if self.sum is not None and squares.shape != self.sum.shape:
            raise ValueError(f"query sums of shape {tuple(squares.shape)} do not match the running statistics "
                             f"[B, Hk, D] = {tuple(self.sum.shape)}")
        self.sum = squares if self.sum is None else self.sum + squares
        self.count += count

    def weight(self) -> torch.Tensor | None:
        return None if self.sum is None else self.sum / self.count

    def key_weight(self) -> torch.Tensor | None:
        """What the key quantizer's encode takes as its weight: the energy [B, Hk, D] here."""
        return self.weight()

    def index_batch(self, index: torch.Tensor) -> None:
        if self.sum is not None:
            self.sum = self.sum[index.to(self.sum.device)]


class QueryCovariance(QueryEnergy):
    """Running second moment E[q q^T] for each batch row and KV head: what query-aware rounding
    (`kvarn.quant.affine.QueryAwareQuantizer`, the `-qar` presets) weighs a key token's error with, e^T Sigma e.

    Pooled as `QueryEnergy` (the query heads of a GQA group and the positions); `weight()` is its diagonal, the
    query energy [B, Hk, D] (the rotation policy and the budget allocation read that), `covariance()` the full
    matrix [B, Hk, D, D], or None before the first update. Held as the upper triangle, row by row (`pack`):
    `sum` [B, Hk, D (D + 1) / 2], half the bytes of the matrix. Accumulated in float32 (float64 stays float64)."""

    _TRIANGLES: ClassVar[dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}

    @classmethod
    def _triangle(cls, d: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """([2, D (D + 1) / 2] the (row, column) of each packed entry, rows in order, column >= row; the same as flat
        indices into D x D; [D * D] the packed entry of each (row, column) of the symmetric matrix), cached per size
        and device: a decode step packs once per layer, a store unpacks once per layer."""
        key = (d, torch.device(device))
        if key not in cls._TRIANGLES:
            rc = torch.triu_indices(d, d, device=device)
            sym = torch.empty(d, d, dtype=torch.long, device=device)
            sym[rc[0], rc[1]] = sym[rc[1], rc[0]] = torch.arange(rc.shape[1], device=device)
            cls._TRIANGLES[key] = rc, rc[0] * d + rc[1], sym.flatten()
        return cls._TRIANGLES[key]

    @classmethod
    def pack(cls, full: torch.Tensor) -> torch.Tensor:
        """Symmetric [..., D, D] -> its upper triangle [..., D (D + 1) / 2]."""
        _, flat, _ = cls._triangle(full.shape[-1], full.device)
        return full.flatten(-2)[..., flat]

    @staticmethod
    def _dim(packed: torch.Tensor) -> int:
        """D of a packed triangle [..., D (D + 1) / 2]."""
        return round(((8 * packed.shape[-1] + 1) ** 0.5 - 1) / 2)

    @classmethod
    def unpack(cls, packed: torch.Tensor) -> torch.Tensor:
        """[..., D (D + 1) / 2] -> the symmetric matrix [..., D, D] (one gather)."""
        d = cls._dim(packed)
        _, _, sym = cls._triangle(d, packed.device)
        return packed.reshape(-1, packed.shape[-1]).index_select(1, sym).view(*packed.shape[:-1], d, d)  # 2-D: fast

    @classmethod
    def moments(cls, w: torch.Tensor) -> torch.Tensor:
        """Queries pooled per KV head [B, Hk, n, D] -> their summed outer products, packed [B, Hk, D (D + 1) / 2]."""
        return cls.pack(w.transpose(-1, -2) @ w)

    @staticmethod
    def _shape(b: int, kv_heads: int, d: int) -> tuple[int, ...]:
        return b, kv_heads, d * (d + 1) // 2

    def weight(self) -> torch.Tensor | None:
        if self.sum is None:
            return None
        (r, c), _, _ = self._triangle(self._dim(self.sum), self.sum.device)
        return self.sum[..., r == c] / self.count

    def covariance(self) -> torch.Tensor | None:
        return None if self.sum is None else self.unpack(self.sum) / self.count

    def key_weight(self) -> torch.Tensor | None:
        """E[q q^T] [B, Hk, D, D]: what query-aware key rounding takes."""
        return self.covariance()


def query_statistics(key: object) -> QueryEnergy | None:
    """The running query statistics a key quantizer takes (`key_weight` feeds its encode): E[q q^T] for query-aware
    rounding (`takes_covariance`), the energy for a weighted rotation choice (`takes_weight`), else None."""
    if getattr(key, "takes_covariance", False):
        return QueryCovariance()
    return QueryEnergy() if getattr(key, "takes_weight", False) else None
