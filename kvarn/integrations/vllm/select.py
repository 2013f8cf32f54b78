"""What vLLM's backend registry resolves to, decided per process from the current vLLM config.

The plugin points CPU_ATTN (and the CPU MLA backends) at attributes of this module. Resolving one reads the config
vLLM is being built with: without `additional_config["kvarn"]` it returns vLLM's own class object, unchanged (so an
installed but disabled plugin leaves vLLM exactly as stock); with it, the kvarn backend, or a clear refusal for MLA.
"""

from __future__ import annotations

from typing import Any

from kvarn.integrations.vllm.config import settings_of

# registry name -> vLLM's own class path (the enum's value, which register_backend overrides)
STOCK = {
    "CPU_ATTN": "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend",
}
MLA = ("CPU_MLA", "AMX_MLA")
# the backends of vLLM's other platforms (CUDA, ROCm, XPU): kvarn has no backend there yet, so an enabled kvarn
# refuses them instead of running stock attention silently (registered off the CPU platform only, see `register`)
NOT_CPU = ("FLASH_ATTN", "FLASH_ATTN_DIFFKV", "TRITON_ATTN", "TRITON_ATTN_DIFFKV", "FLASHINFER", "FLEX_ATTENTION",
           "ROCM_ATTN", "ROCM_AITER_FA", "ROCM_AITER_UNIFIED_ATTN", "TRITON_MLA", "CUTLASS_MLA", "FLASHMLA",
           "FLASHINFER_MLA", "FLASH_ATTN_MLA", "ROCM_AITER_MLA", "TURBOQUANT")


def _enabled() -> bool:
    from vllm.config import get_current_vllm_config_or_none

    cfg = get_current_vllm_config_or_none()
    return cfg is not None and settings_of(cfg) is not None


def stock_path(name: str) -> str:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return STOCK.get(name) or AttentionBackendEnum[name].value


def __getattr__(name: str) -> Any:
    from vllm.utils.import_utils import resolve_obj_by_qualname

    if name not in STOCK and name not in MLA and name not in NOT_CPU:
        raise AttributeError(name)
    if not _enabled():
        return resolve_obj_by_qualname(stock_path(name))
    if name in NOT_CPU:
        raise ValueError(f"kvarn: the kvarn vLLM backend exists for vLLM's CPU platform only (this run selected "
                         f"{name}); there is no kvarn backend for CUDA/ROCm/XPU yet (docs/VLLM.md, 'Not supported "
                         "yet'): run without additional_config['kvarn']")
    if name in MLA:
        raise ValueError("kvarn: multi-head latent attention (MLA) models are not supported by the kvarn vLLM "
                         "backend; run this model without additional_config['kvarn']")
    from kvarn.integrations.vllm.backend import KVarNAttentionBackend

    return KVarNAttentionBackend
