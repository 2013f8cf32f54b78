"""What vLLM's backend registry resolves to, decided per process from the current vLLM config.

The plugin points CPU_ATTN (and the MLA backends) at attributes of this module, and off the CPU platform also vLLM's
GPU backends (`NOT_CPU`) and the CUSTOM slot. Resolving one reads the config vLLM is being built with: without
`additional_config["kvarn"]` it returns vLLM's own class object, unchanged (so an installed but disabled plugin leaves
vLLM exactly as stock); with it, the kvarn backend: `KVarNAttentionBackend` for CPU_ATTN, `KVarNCudaAttentionBackend`
for every non-MLA CUDA backend name and CUSTOM on the CUDA platform (whichever of its priority list vLLM tries first,
or the one asked by attention_backend=...), or a clear refusal: MLA everywhere, ROCm and XPU.
"""

from __future__ import annotations

from typing import Any

from kvarn.integrations.vllm.config import settings_of

# registry name -> vLLM's own class path (the enum's value, which register_backend overrides)
STOCK = {
    "CPU_ATTN": "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend",
}
MLA = ("CPU_MLA", "AMX_MLA")
GPU_MLA = ("TRITON_MLA", "CUTLASS_MLA", "FLASHMLA", "FLASHINFER_MLA", "FLASH_ATTN_MLA", "ROCM_AITER_MLA")
ROCM = ("ROCM_ATTN", "ROCM_AITER_FA", "ROCM_AITER_UNIFIED_ATTN")
# the backends of vLLM's other platforms: registered off the CPU platform only (`register`), so an enabled kvarn
# serves CUDA's (the non-MLA, non-ROCm ones) and refuses the rest instead of running stock attention silently
NOT_CPU = ("FLASH_ATTN", "FLASH_ATTN_DIFFKV", "TRITON_ATTN", "TRITON_ATTN_DIFFKV", "TRITON_FLASH_ATTN", "FLASHINFER",
           "TRITON_FLASHINFER", "FLEX_ATTENTION", "TURBOQUANT", *ROCM, *GPU_MLA)
CUSTOM_SLOT = "CUSTOM"  # vLLM's slot for third-party backends: kvarn's on CUDA when no other plugin holds it


def _enabled() -> bool:
    from vllm.config import get_current_vllm_config_or_none

    cfg = get_current_vllm_config_or_none()
    return cfg is not None and settings_of(cfg) is not None


def _on_cuda() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cuda()


def stock_path(name: str) -> str:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return STOCK.get(name) or AttentionBackendEnum[name].value


def __getattr__(name: str) -> Any:
    from vllm.utils.import_utils import resolve_obj_by_qualname

    if name not in STOCK and name not in MLA and name not in NOT_CPU and name != CUSTOM_SLOT:
        raise AttributeError(name)
    if not _enabled():
        if name == CUSTOM_SLOT:
            raise ValueError("kvarn: the CUSTOM attention backend slot is kvarn's; it serves only a run with "
                             "additional_config['kvarn'] (or pick another attention_backend)")
        return resolve_obj_by_qualname(stock_path(name))
    if name in MLA or name in GPU_MLA:
        raise ValueError("kvarn: multi-head latent attention (MLA) models are not supported by the kvarn vLLM "
                         "backend; run this model without additional_config['kvarn']")
    if name in ROCM or (name not in STOCK and not _on_cuda()):
        raise ValueError(f"kvarn: the kvarn vLLM backend exists for vLLM's CPU and CUDA platforms only (this run "
                         f"selected {name}); there is no kvarn backend for ROCm/XPU yet (docs/VLLM.md, 'CUDA'): "
                         "run without additional_config['kvarn']")
    from kvarn.integrations.vllm.backend import KVarNAttentionBackend, KVarNCudaAttentionBackend

    return KVarNAttentionBackend if name in STOCK else KVarNCudaAttentionBackend
