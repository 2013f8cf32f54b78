"""KVarN for stock vLLM: a `vllm.general_plugins` entry point and a packed paged KV cache for the CPU platform.

    pip install "kvarn[vllm]"    (on CPU: `make vllm-venv`, see docs/VLLM.md)
    LLM(model, additional_config={"kvarn": {"preset": "kvarn-k4v2-g128"}}, ...)

`register` runs in every vLLM process (front end, engine core, workers), possibly more than once: it only points
the registry entries of `select.MLA` and CPU_ATTN (off the CPU platform also `select.NOT_CPU`, and CUSTOM unless
another plugin holds it) at `kvarn.integrations.vllm.select`, which resolves to vLLM's own class unless the run's
config enables kvarn (then: the kvarn backend of the platform, CPU or CUDA, or a refusal). Modules: `config`
(options, refusals), `select` (the registry hook), `layout` (page bytes), `pool` (full-precision pool), `paged`
(store + attention), `backend` (vLLM's classes).
"""

from __future__ import annotations

SUPPORTED_VLLM = ("0.32",)  # minor versions whose backend API this plugin was written and tested against


def unavailable(command: str) -> str | None:
    """Why vLLM cannot run from this interpreter (None: it can); `command` names what to run from .venv-vllm."""
    import importlib.util
    import sys

    spec = importlib.util.find_spec("vllm")  # a folder named vllm on sys.path is a namespace package: no origin
    if spec is None or spec.origin is None:
        return f"vLLM is not importable from {sys.executable}: run `make vllm-venv`, then `.venv-vllm/bin/{command}`"
    return None


def cpu_engine_env(in_process: bool = False) -> dict[str, str]:
    """The environment of a CPU engine process that kvarn starts: vLLM's OpenMP threads on every core (unless
    VLLM_CPU_OMP_THREADS_BIND says otherwise), none reserved, and no VLLM_CPU_KVCACHE_SPACE (the caller gives the
    budget in bytes, `kv_cache_memory_bytes`). `in_process`: the engine core runs in that process, not in a second one
    that imports torch and vLLM again (about half of a start on a 2-core VM: scripts/vllm_start_time.py); for runs
    that time nothing."""
    import os

    n = os.cpu_count() or 1
    env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{n - 1}")}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def register() -> None:
    """The `vllm.general_plugins` entry point (idempotent)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from kvarn.integrations.vllm.select import CUSTOM_SLOT, MLA, NOT_CPU, STOCK

    names = (*STOCK, *MLA)
    if not _on_cpu():
        names += tuple(n for n in NOT_CPU if n in AttentionBackendEnum.__members__)
        custom = AttentionBackendEnum[CUSTOM_SLOT]
        if not custom.is_overridden():  # another plugin's CUSTOM backend is left alone
            names += (CUSTOM_SLOT,)
    for name in names:
        member = AttentionBackendEnum[name]
        path = f"kvarn.integrations.vllm.select.{name}"
        if not member.is_overridden() or member.get_path() != path:
            register_backend(member, path)
