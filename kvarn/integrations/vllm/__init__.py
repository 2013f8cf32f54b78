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
