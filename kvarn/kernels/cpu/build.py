"""Building and loading the C++/OpenMP extension (torch.utils.cpp_extension, compiled once per machine, torch and
Python environment).

One module holds both kernels: decode attention (decode.cpp) and the tile store (store.cpp); module.cpp binds them.
Both obey KVARN_KERNEL (`kvarn.ops.dispatch`): auto (the kernel where it applies), torch (the PyTorch reference
everywhere), cpu (the kernel or an error naming why not).

The build goes to `$KVARN_CACHE/torch_extensions/<machine tag>` (~/.cache/kvarn by default) with -O3 -march=native:
the tag hashes the CPU's flags, so a cache shared between machines never runs code built for another CPU, and the
environment's prefix: two venvs' builds name different torch include folders, and one build folder shared by both
would be rebuilt each time the other venv loads it. Needs a C++
compiler and ninja (a dependency of kvarn). When the build fails, `load()` returns None and warns once, saying why.
"""

from __future__ import annotations

import hashlib
import platform
import sys
import warnings
from pathlib import Path
from types import ModuleType

import torch

from kvarn.ops.dispatch import mode, take  # noqa: F401 (the KVARN_KERNEL rule, re-exported)
from kvarn.paths import cache_dir

SOURCES = [Path(__file__).with_name(n) for n in ("decode.cpp", "store.cpp", "module.cpp")]
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fno-math-errno", "-std=c++17"]

_module: ModuleType | None = None
_error: str | None = None


def _machine_tag() -> str:
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    digest = hashlib.sha1(f"{platform.machine()} {flags} {torch.__version__} {sys.prefix}".encode()).hexdigest()[:12]
    return f"{platform.machine()}-{digest}"


def build_dir() -> Path:
    return cache_dir() / "torch_extensions" / _machine_tag()


def load() -> ModuleType | None:
    """The compiled extension, or None (after one warning) when it cannot be built here."""
    global _module, _error
    if _module is not None or _error is not None:
        return _module
    try:
        from torch.utils.cpp_extension import load as load_extension

        folder = build_dir()
        folder.mkdir(parents=True, exist_ok=True)
        _module = load_extension(name="kvarn_cpu_decode", sources=[str(s) for s in SOURCES], extra_cflags=FLAGS,
                                 extra_ldflags=["-fopenmp"], build_directory=str(folder), verbose=False)
    except Exception as e:  # no compiler, no ninja, a failed compile: the PyTorch path still works
        lines = [ln for ln in str(e).splitlines() if "error" in ln.lower()] or str(e).splitlines() or [""]
        _error = f"{type(e).__name__}: {lines[0].strip()[:300]}"
        warnings.warn(f"kvarn: the fused CPU kernels could not be built ({_error}); attention and the tile "
                      "store take the PyTorch path (kvarn.attention.packed, kvarn.quant.affine), which is slower",
                      stacklevel=2)
    return _module


def error() -> str | None:
    """Why the extension is unavailable (None when it loaded or was not tried yet)."""
    return _error
