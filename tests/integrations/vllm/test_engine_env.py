"""`cpu_engine_env`: the environment of the CPU engine processes kvarn starts (`kvarn eval tasks --protocols vllm`,
`kvarn bench vllm`), without vLLM."""

from __future__ import annotations

import pytest

from kvarn.integrations.vllm import cpu_engine_env


@pytest.fixture
def clean(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    return monkeypatch


def test_every_core_none_reserved_and_no_kv_space(clean: pytest.MonkeyPatch) -> None:
    clean.setattr("os.cpu_count", lambda: 6)
    env = cpu_engine_env()
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-5" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert "VLLM_CPU_KVCACHE_SPACE" not in env  # the caller gives the budget in bytes
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env  # vLLM's default: the engine core in its own process


def test_a_users_binding_is_kept(clean: pytest.MonkeyPatch) -> None:
    clean.setenv("VLLM_CPU_OMP_THREADS_BIND", "1")
    assert cpu_engine_env()["VLLM_CPU_OMP_THREADS_BIND"] == "1"


def test_in_process_turns_off_the_engine_core_process(clean: pytest.MonkeyPatch) -> None:
    assert cpu_engine_env(in_process=True)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
