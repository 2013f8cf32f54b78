"""The k4v2 OpenAI server, one per session, shared by test_engine_server.py and test_engine_load.py (each vLLM start
costs 1-2 minutes on 2 cores). engine_common is imported inside the fixture: importing it skips a module where vLLM
is not installed, which a conftest must not do to the CPU-only tests beside it."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    from .engine_common import start_server

    with start_server(tmp_path_factory.mktemp("server")) as s:
        yield s
