"""The k4v2 OpenAI server and its one-at-a-time answers, one of each per session, shared by test_engine_server.py and
test_engine_load.py (each vLLM start costs 1-2 minutes on 2 cores). engine_common is imported inside the fixtures:
importing it skips a module where vLLM is not installed, which a conftest must not do to the CPU-only tests beside
it."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    from .engine_common import start_server

    with start_server(tmp_path_factory.mktemp("server")) as s:
        yield s


@pytest.fixture(scope="session")
def sequential(server) -> list[tuple[list[int], list[float]]]:
    """engine_common.prompts()' greedy tokens (MAX_NEW) and top-2 gaps, one request at a time."""
    from .engine_common import prompts

    return [server.greedy(p) for p in prompts()]
