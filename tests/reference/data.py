"""Test inputs: heavy-tailed random tiles and real activations of the embedded model."""

from __future__ import annotations

import functools

import torch


def heavy_tailed(*shape: int, generator: torch.Generator | None = None, df: int = 3) -> torch.Tensor:
    """Student-t(df) entries times log-normal row and column scales, float64: heavy tails on both axes."""
    z = torch.randn(*shape, generator=generator, dtype=torch.float64)
    chi2 = (torch.randn(*shape, df, generator=generator, dtype=torch.float64) ** 2).sum(-1)
    t = z / (chi2 / df).sqrt()
    rows = (torch.randn(*shape[:-1], 1, generator=generator, dtype=torch.float64)).exp()
    cols = (torch.randn(*shape[:-2], 1, shape[-1], generator=generator, dtype=torch.float64)).exp()
    return t * rows * cols


@functools.lru_cache(maxsize=2)
def _real_kv(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    from kvarn.eval.text import load_tokens
    from kvarn.models import load_model

    model, tok = load_model("default")
    ids = load_tokens(tok, None, tokens)
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache = out.get("cache")
        cache = out.past_key_values if cache is None else cache  # older transformers
    keys = torch.stack([layer.keys[0] for layer in cache.layers])  # [L, H, T, D]
    values = torch.stack([layer.values[0] for layer in cache.layers])
    return keys, values


def real_kv(tokens: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Post-RoPE keys and values of SmolLM2-135M on the default text (pydoc_data.topics),
    [layers, kv_heads, tokens, head_dim] float32."""
    return _real_kv(tokens)


def real_tiles(tile: int, kind: str = "keys", tokens: int = 256, layers: tuple[int, ...] = (1, 14, 28),
               skip: int = 1) -> torch.Tensor:
    """Tiles [N, tile, D] of real keys or values from a few layers (all KV heads), starting at `skip`."""
    k, v = real_kv(tokens)
    x = (k if kind == "keys" else v)[list(layers)]  # [l, H, T, D]
    n = (x.shape[2] - skip) // tile
    return x[:, :, skip: skip + n * tile].reshape(-1, tile, x.shape[-1]).contiguous()
