"""The C++ decode kernel (decode.cpp) behind the packed-decode op seat for CPU tensors (`kvarn.kernels.cpu.register`).
Its typed launch wrapper, shared by every caller and device, is `kvarn.attention.launch`. Beside it, `write_rows`:
the vLLM backend's decode-step write of fresh rows into their fp slots, in the same extension."""

from __future__ import annotations

import torch

from kvarn.kernels.cpu.build import load


def available() -> bool:
    """Whether the extension is built and loaded (builds it on first call; warns once when it cannot)."""
    return load() is not None


def write_rows(rows: torch.Tensor, key: torch.Tensor, value: torch.Tensor, tok: torch.Tensor, blk: torch.Tensor,
               sub: torch.Tensor) -> bool:
    """rows[blk[b, 0], :, sub[b, 0]] = key[tok[b]] and rows[blk[b, 1], :, sub[b, 1]] = value[tok[b]] (decode.cpp's
    `write_rows`: one call instead of a stack and an indexed write) for rows [N, H, R, D] and key, value [T, H, D]
    on the CPU in rows' dtype; tok int64 [B], blk and sub int64 [B, 2]. False, with nothing written, where it does
    not apply (no extension, another device or dtype): the caller's PyTorch path."""
    m = load()
    if m is None or rows.device.type != "cpu" or key.dtype != rows.dtype or value.dtype != rows.dtype:
        return False
    m.write_rows(rows, key, value, tok, blk, sub)
    return True
