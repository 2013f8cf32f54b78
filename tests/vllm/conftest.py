"""tests/vllm: the engine-free tests (test_paged.py) run everywhere; the ones that start vLLM (test_engine_*.py) only
where vLLM is installed, i.e. in the .venv-vllm made by `make vllm-venv` (`make test-vllm`)."""

from __future__ import annotations

import importlib.util


def _vllm_installed() -> bool:
    # with tests/ on sys.path this very folder is an implicit namespace package named "vllm" (no origin): not it
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


collect_ignore_glob = [] if _vllm_installed() else ["test_engine_*.py"]
