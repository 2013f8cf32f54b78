"""The KVARN_KERNEL rule, once: whether a call takes a kernel registered behind an op seat or the PyTorch reference.

    auto   (default) the kernel wherever it serves the call, else the reference
    torch  the reference everywhere (no extension is ever built)
    cpu    the kernel, or a RuntimeError naming why it cannot serve the call

`use_kernel(why, what)` applies it: `why()` (called only when the mode is not torch, so the reference path never
builds an extension) returns None when the kernel can serve the call, else the reason.
"""

from __future__ import annotations

import os
from collections.abc import Callable

MODES = ("auto", "torch", "cpu")


def mode() -> str:
    m = os.environ.get("KVARN_KERNEL", "auto")
    if m not in MODES:
        raise ValueError(f"KVARN_KERNEL must be 'auto', 'torch' or 'cpu', got {m!r}")
    return m


def take(why: str | None, what: str, optional: tuple[str, ...] = ()) -> bool:
    """Whether a call takes a kernel that gave `why` (None: it can serve the call), by KVARN_KERNEL: torch never, auto
    when it can, cpu always: a RuntimeError says why it cannot (`what`: which kernel and call), except for the reasons
    in `optional`, where there is nothing for a kernel to do."""
    m = mode()
    if m == "torch":
        return False
    if why is None:
        return True
    if m == "cpu" and why not in optional:
        raise RuntimeError(f"KVARN_KERNEL=cpu, but {what}: {why}")
    return False


def use_kernel(why: Callable[[], str | None], what: str, optional: tuple[str, ...] = ()) -> bool:
    """`take(why(), what, optional)`, with `why` not called under KVARN_KERNEL=torch."""
    if mode() == "torch":
        return False
    return take(why(), what, optional)
