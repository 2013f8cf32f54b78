"""Undo and redo RoPE on cached keys, for presets that quantize keys before RoPE (`CachePolicy.key_pre_rope`, KVQuant).

Transformers' convention (`rotate_half`), on the first r = rotary_dim channels of a key (channels past r pass through):

    theta_i(p) = p * inv_freq_i (i < r/2),  cos = cat(cos theta, cos theta) * s,  sin = cat(sin theta, sin theta) * s
    k_rope = k * cos + rotate_half(k) * sin,  rotate_half(x) = cat(-x[r/2:], x[:r/2])

with s the rope type's attention scaling. Each channel pair (i, i + r/2) is rotated by theta_i and scaled by s, so

    k = (k_rope * cos - rotate_half(k_rope) * sin) / s^2

undoes it exactly up to floating-point rounding (the products are computed in float32, float64 for float64 input).

Only rope types whose frequencies are fixed are accepted: default, linear, llama3, yarn, proportional. "dynamic" and
"longrope" change their frequencies with the current sequence length, so the rotation a key received cannot be
re-created at read time from its position alone; they raise ValueError, as do multimodal (mrope) position layouts.
"""

from __future__ import annotations

import torch

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")


def _rope_parameters(config, layer_type: str | None) -> tuple[dict, str | None]:
    params = getattr(config, "rope_parameters", None)
    if params is None:
        raise ValueError(f"config of model type {getattr(config, 'model_type', '?')!r} has no rope_parameters; "
                         "key_pre_rope presets need a RoPE model")
    if layer_type is not None and layer_type in params and isinstance(params[layer_type], dict):
        params = params[layer_type]  # per-layer-type RoPE (Gemma3)
    else:
        layer_type = None
    return params, layer_type


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """cat(-x2, x1) of the two halves of the last axis (the transformers convention)."""
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class Rope:
    """RoPE of one attention layer type, built from a model config (text config)."""

    def __init__(self, config, layer_type: str | None = "full_attention") -> None:
        params, layer_type = _rope_parameters(config, layer_type)
        rope_type = params.get("rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            raise ValueError(f"RoPE type {rope_type!r} cannot be undone exactly at read time (its frequencies depend "
                             f"on the sequence length); key_pre_rope presets support {', '.join(STATIC_ROPE_TYPES)}")
        if params.get("mrope_section") is not None:
            raise ValueError("multimodal RoPE (mrope_section) is not supported by key_pre_rope presets")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
        self.rotary_dim = int(head_dim * factor)
        if rope_type == "default":
            base = params["rope_theta"]
            d = self.rotary_dim
            inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None, layer_type=layer_type)
        if 2 * inv_freq.numel() != self.rotary_dim:
            raise ValueError(f"RoPE has {inv_freq.numel()} frequencies for a rotary dim of {self.rotary_dim}")
        self.inv_freq = inv_freq.float()
        self.scaling = float(scaling)
        self.rope_type = rope_type

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, sin [B, 1, T, r] in `dtype` (float32 or float64)."""
        inv = self.inv_freq.to(device=positions.device, dtype=dtype)
        freqs = positions.to(dtype).unsqueeze(-1) * inv  # [B, T, r/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).unsqueeze(1), (emb.sin() * self.scaling).unsqueeze(1)

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool) -> torch.Tensor:
        if positions.dim() != 2 or positions.shape[-1] != x.shape[-2]:
            raise ValueError(f"positions {tuple(positions.shape)} do not match keys {tuple(x.shape)} ([B, T] vs "
                             "[B, H, T, D])")
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        r = self.rotary_dim
        cos, sin = self.cos_sin(positions, work)
        xr = x[..., :r].to(work)
        if inverse:
            out = (xr * cos - rotate_half(xr) * sin) / (self.scaling * self.scaling)
        else:
            out = xr * cos + rotate_half(xr) * sin
        out = out.to(x.dtype)
        return out if r == x.shape[-1] else torch.cat((out, x[..., r:]), dim=-1)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, H, T, D] pre-RoPE keys at positions [B, T] -> post-RoPE keys."""
        return self._rotate(x, positions, inverse=False)

    def invert(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, H, T, D] post-RoPE keys at positions [B, T] -> pre-RoPE keys."""
        return self._rotate(x, positions, inverse=True)
