"""Where kvarn keeps what it builds and converts: one folder, `$KVARN_CACHE` (default ~/.cache/kvarn).

Low in the house so the kernel build (compiled extensions) and the model zoo (converted models) share it
without the core importing the lab."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("KVARN_CACHE", Path.home() / ".cache" / "kvarn"))
