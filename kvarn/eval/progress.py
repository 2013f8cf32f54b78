"""Progress bars of the long runs (tqdm: the `lab` extra)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def progress(iterable: Iterable[Any] | None = None, **kwargs: Any):
    """tqdm on stderr (set TQDM_DISABLE=1 to silence)."""
    from tqdm.auto import tqdm

    return tqdm(iterable, dynamic_ncols=True, **kwargs)
