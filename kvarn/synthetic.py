"""Synthetic key/value activations with the structure that makes KV quantization hard, seeded.

Per head, a sequence of T tokens, D channels (token-major [H, T, D]):

    keys (pre-RoPE)  k[t, d] = m_t * (mu_d + s_d * e[t, d])
    values           v[t, d] = n_t * (nu_d + r_d * f[t, d])

    e, f    Student-t noise (heavy tails, `df`), divided by its std so s_d and r_d are stds
    s_d     per-channel spread, log-normal (median 1); `outlier_channels` key channels get `outlier_scale`
    mu_d    per-channel offset: outlier channels have a large consistent offset (as in real keys)
    m_t     per-token norm: log-normal jitter, and a fraction `rare_tokens` of tokens multiplied by
            `large_norm` or `small_norm` (half each): the tokens whose magnitude RTN gets wrong
    token 0 attention-sink-like: key `sink_scale` x longer along the outlier channels, value near zero

Keys are returned after RoPE (Llama's rotate-half convention, base `rope_base`) and before it.
Everything comes from one `torch.Generator(seed)`, so a seed names a dataset.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class SyntheticConfig:
    df: int = 4  # Student-t degrees of freedom, an integer > 2 (lower: heavier tails)
    channel_spread: float = 0.4  # std of log s_d
    outlier_channels: int = 4
    outlier_scale: float = 4.0
    key_offset: float = 1.0  # offsets mu_d ~ N(0, key_offset) * s_d
    value_spread: float = 0.3
    token_jitter: float = 0.25  # std of log m_t
    rare_tokens: float = 0.02
    large_norm: float = 3.0
    small_norm: float = 0.2
    sink_scale: float = 3.0
    rope_base: float = 10000.0


class SyntheticKV(NamedTuple):
    keys: torch.Tensor  # [H, T, D] after RoPE
    values: torch.Tensor  # [H, T, D]
    keys_pre_rope: torch.Tensor  # [H, T, D]


def apply_rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotate-half RoPE over the last axis of x [..., T, D] (D even): pairs (i, i + D/2) are rotated by
    angle pos * base^(-2i/D). Inverse: apply_rope(x, -positions)."""
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {d}")
    inv = base ** (-torch.arange(0, d // 2, dtype=torch.float64, device=x.device) * 2 / d)
    ang = positions.to(torch.float64).unsqueeze(-1) * inv  # [T, D/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(x.dtype), torch.cat([ang.sin()] * 2, -1).to(x.dtype)
    rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
    return x * cos + rot * sin


def _student_t(shape: tuple[int, ...], df: int, g: torch.Generator) -> torch.Tensor:
    # t = z / sqrt(chi2_df / df) with chi2_df a sum of df squared normals, scaled to unit std (df > 2)
    z = torch.randn(shape, generator=g, dtype=torch.float64)
    chi2 = (torch.randn((*shape, df), generator=g, dtype=torch.float64) ** 2).sum(-1)
    return z / (chi2 / df).sqrt() / (df / (df - 2)) ** 0.5


def _token_norms(h: int, t: int, cfg: SyntheticConfig, g: torch.Generator) -> torch.Tensor:
    m = (cfg.token_jitter * torch.randn(h, t, generator=g, dtype=torch.float64)).exp()
    u = torch.rand(h, t, generator=g, dtype=torch.float64)
    m = torch.where(u < cfg.rare_tokens / 2, m * cfg.large_norm, m)
    m = torch.where((u >= cfg.rare_tokens / 2) & (u < cfg.rare_tokens), m * cfg.small_norm, m)
    return m  # [H, T]


def synthetic_kv(tokens: int, head_dim: int, heads: int = 1, seed: int = 0,
                 config: SyntheticConfig | None = None, dtype: torch.dtype = torch.float32) -> SyntheticKV:
    """Keys and values of `heads` KV heads over `tokens` positions, [H, T, D] each (see module doc)."""
    cfg = config or SyntheticConfig()
    if tokens < 1 or head_dim < 2 or head_dim % 2 or heads < 1:
        raise ValueError(f"need tokens >= 1, heads >= 1 and an even head_dim >= 2; got tokens={tokens}, "
                         f"head_dim={head_dim}, heads={heads}")
    if int(cfg.df) != cfg.df or cfg.df <= 2:
        raise ValueError(f"df must be an integer > 2 (finite variance), got {cfg.df}")
    g = torch.Generator().manual_seed(seed)
    h, t, d = heads, tokens, head_dim
    # keys: channel spreads and offsets, a few outlier channels with large consistent offsets
    s = (cfg.channel_spread * torch.randn(h, 1, d, generator=g, dtype=torch.float64)).exp()
    out_ch = torch.rand(h, d, generator=g).argsort(-1)[:, : min(cfg.outlier_channels, d)]
    boost = torch.ones(h, d, dtype=torch.float64).scatter_(1, out_ch, cfg.outlier_scale).unsqueeze(1)
    s = torch.where(boost > 1, boost, s)  # outlier channels: exactly `outlier_scale` x the median spread (1)
    mu = cfg.key_offset * torch.randn(h, 1, d, generator=g, dtype=torch.float64) * s
    mu = mu + (boost > 1) * s.abs() * torch.sign(mu)  # outlier channels sit far from zero
    k = _token_norms(h, t, cfg, g).unsqueeze(-1) * (mu + s * _student_t((h, t, d), int(cfg.df), g))
    # values: milder channel structure, small offsets
    r = (cfg.value_spread * torch.randn(h, 1, d, generator=g, dtype=torch.float64)).exp()
    nu = 0.3 * torch.randn(h, 1, d, generator=g, dtype=torch.float64) * r
    v = _token_norms(h, t, cfg, g).unsqueeze(-1) * (nu + r * _student_t((h, t, d), int(cfg.df), g))
    # attention-sink-like first token: a long key along the outlier channels, a near-zero value
    sink_dir = torch.zeros(h, d, dtype=torch.float64).scatter_(1, out_ch, 1.0) * torch.sign(mu[:, 0])
    k[:, 0] = cfg.sink_scale * (s[:, 0] * sink_dir + 0.1 * k[:, 0])
    v[:, 0] = 0.05 * v[:, 0]
    k_rope = apply_rope(k, torch.arange(t), cfg.rope_base)
    return SyntheticKV(k_rope.to(dtype), v.to(dtype), k.to(dtype))


def as_tiles(x: torch.Tensor, tile: int) -> torch.Tensor:
    """[..., T, D] -> [N, tile, D], dropping an incomplete last tile (as the cache's tail would hold it)."""
    if tile < 1:
        raise ValueError(f"tile must be positive, got {tile}")
    t, d = x.shape[-2:]
    n = t // tile
    if n == 0:
        raise ValueError(f"{t} tokens hold no complete tile of {tile}")
    return x[..., : n * tile, :].reshape(-1, tile, d)
