"""Shared fixtures: the test seed, the real model, and a device (CPU always, CUDA where present). Builders are in
tests/helpers.py, tolerances in tests/tolerances.py.

Seeds are fixed by default (SEED of tests/helpers.py, printed in the header), so a run is reproducible and CI is
deterministic. `KVARN_RANDOM_SEED=1` draws a fresh seed per session (printed) to explore other inputs; `KVARN_SEED=N`
replays one. Every test starts with Python's and torch's global generators seeded from it (`_seed_globals`), and
hypothesis runs derandomized unless a random seed was asked for."""

from __future__ import annotations

import os
import random

# The Triton kernel tests run on Triton's CPU interpreter, which must be chosen before anything (transformers, via
# tests.helpers) first imports triton: triton's own @jit library is decorated at import. CPU code never uses it.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from hypothesis import settings

from tests.helpers import TEST_SEED

# hypothesis draws its own examples: derandomized (a fixed sequence) unless random seeds are asked for
settings.register_profile("kvarn", derandomize=os.environ.get("KVARN_RANDOM_SEED") != "1")
settings.load_profile("kvarn")


def pytest_report_header(config) -> str:
    how = "random, KVARN_RANDOM_SEED=1" if os.environ.get("KVARN_RANDOM_SEED") == "1" else "fixed"
    return f"kvarn test seed: {TEST_SEED} ({how}; replay with KVARN_SEED={TEST_SEED})"


@pytest.fixture(autouse=True)
def _seed_globals() -> None:
    """Seed Python's and torch's global generators before every test, so no test depends on execution order."""
    random.seed(TEST_SEED)
    torch.manual_seed(TEST_SEED)


# One thread by default: on a loaded 2-core machine, OpenMP spin-waits make small ops up to 20x slower with 2.
torch.set_num_threads(int(os.environ.get("KVARN_TEST_THREADS", "1")))


@pytest.fixture
def seed() -> int:
    """The session's test seed (SEED unless KVARN_RANDOM_SEED=1 or KVARN_SEED=N); printed, so a failure shows it."""
    torch.manual_seed(TEST_SEED)
    print(f"seed={TEST_SEED} (replay with KVARN_SEED={TEST_SEED})")
    return TEST_SEED


_NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here (torch.cuda.is_available())")


@pytest.fixture(scope="session", params=["cpu", pytest.param("cuda", marks=_NO_CUDA)])
def device(request) -> torch.device:
    """Where a device-agnostic op runs: the CPU always, CUDA where present (skipped with the reason elsewhere).
    Session-scoped so hypothesis tests may take it."""
    return torch.device(request.param)


@pytest.fixture(scope="session")
def real_model():
    """The embedded SmolLM2-135M-Instruct (converted once to a HF folder under the kvarn cache)."""
    from kvarn.models import load_model

    return load_model("default")
