"""Import every module of kvarn's core with the lab's dependencies blocked; exit non-zero naming the first that fails.

The core (ops, quant, presets, cache, attention, kernels, integrations) must work on a bare `pip install kvarn`:
torch and transformers only. Imports of the lab's packages are refused when kvarn itself asks (transformers needs
tqdm, and asks for accelerate and gguf on its own terms), so the check holds whatever the venv has installed. Run by
scripts/install_check.sh in a fresh venv and by tests/test_packaging.py on the checkout.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import pkgutil
import sys

LAB = ("matplotlib", "rich", "tqdm", "gguf", "accelerate")
CORE = ("ops", "quant", "presets", "cache", "attention", "kernels", "integrations", "paths")
# parts of the core behind their own extra, imported only where that package is installed
OPTIONAL = {"kvarn.kernels.triton.": "triton", "kvarn.integrations.vllm": "vllm",
            "kvarn.integrations.lm_eval": "lm_eval"}


class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in LAB and importer().startswith("kvarn"):
            raise ModuleNotFoundError(f"{name} is blocked: the core must not need it", name=name)
        return None


def importer() -> str:
    """The module whose code asked for the import (the first frame outside importlib and this file)."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not name.startswith(("importlib", "_frozen_importlib")) and name != __name__:
            return name
        frame = frame.f_back
    return ""


def main() -> int:
    sys.meta_path.insert(0, Block())
    names = []
    for sub in CORE:
        module = importlib.import_module(f"kvarn.{sub}")
        names.append(module.__name__)
        for info in pkgutil.walk_packages(getattr(module, "__path__", []), f"kvarn.{sub}."):
            needs = [pkg for prefix, pkg in OPTIONAL.items() if info.name.startswith(prefix)]
            if needs and importlib.util.find_spec(needs[0]) is None:
                continue
            importlib.import_module(info.name)
            names.append(info.name)
    import kvarn

    print(f"{len(names)} core modules of {kvarn.__file__} import with {', '.join(LAB)} blocked")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
