"""tests/vllm: the engine-free tests (test_paged.py) run everywhere; the ones that start vLLM (test_engine_*.py) only
where vLLM is importable, i.e. in the .venv-vllm made by `make vllm-venv` (`make test-vllm`)."""

from __future__ import annotations

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("vllm") is not None else ["test_engine_*.py"]
