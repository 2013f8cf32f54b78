"""What vLLM's attention registry resolves to with the plugin, by platform (mocked: this vLLM is the CPU build).

The CUDA platform's selector (vllm/platforms/cuda.py `get_attn_backend_cls`, not importable in a CPU build) walks
its priority list, resolving each name through the registry (`AttentionBackendEnum[name].get_class()`) and keeping
the first class whose `validate_configuration(...)` returns no reason; `_cuda_selects` does the same here. Needs
vLLM (the vLLM venv, `make vllm-venv`); fast (no engine start).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed: the backend selection is not tested")

from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.selector import AttentionSelectorConfig

import kvarn.integrations.vllm as plugin
from kvarn.integrations.vllm import select

CUDA_PRIORITY = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION", "TURBOQUANT")  # vLLM 0.32, SM 9.0


@pytest.fixture
def on_cuda(monkeypatch):
    """The plugin registered as in a process of vLLM's CUDA platform, kvarn enabled; the registry restored after."""
    names = [n for n in (*select.NOT_CPU, select.CUSTOM_SLOT) if n in AttentionBackendEnum.__members__]
    before = {n: AttentionBackendEnum[n].is_overridden() for n in names}
    monkeypatch.setattr(plugin, "_on_cpu", lambda: False)
    monkeypatch.setattr(select, "_on_cuda", lambda: True)
    monkeypatch.setattr(select, "_enabled", lambda: True)
    plugin.register()
    yield
    for n, was in before.items():
        if not was:
            AttentionBackendEnum[n].clear_override()


def _cuda_selects(selected: str | None = None, **config) -> type:
    """The class CUDA's selector ends with (see the module docstring), or ValueError with every reason."""
    cfg = AttentionSelectorConfig(**{"head_size": 64, "dtype": torch.bfloat16, "kv_cache_dtype": "auto",
                                     "block_size": 128, **config})
    reasons = {}
    for name in (selected,) if selected else CUDA_PRIORITY:
        cls = AttentionBackendEnum[name].get_class()
        why = cls.validate_configuration(device_capability=DeviceCapability(9, 0), **cfg._asdict())
        if not why:
            return cls
        reasons[name] = why
    raise ValueError(f"no valid backend: {reasons}")


def test_cuda_resolves_to_the_kvarn_cuda_backend(on_cuda) -> None:
    """With kvarn enabled on CUDA, the selector's first choice and an explicit CUSTOM (or FLASH_ATTN) give the kvarn
    CUDA backend, which shares the CPU backend's page, builder and impl and names a registry member."""
    from kvarn.integrations.vllm.backend import KVarNAttentionBackend, KVarNCudaAttentionBackend

    for selected in (None, "CUSTOM", "FLASH_ATTN", "TRITON_ATTN"):
        assert _cuda_selects(selected) is KVarNCudaAttentionBackend, selected
    cuda, cpu = KVarNCudaAttentionBackend, KVarNAttentionBackend
    assert cuda.get_builder_cls() is cpu.get_builder_cls() and cuda.get_impl_cls() is cpu.get_impl_cls()
    assert AttentionBackendEnum[cuda.get_name()] is AttentionBackendEnum.CUSTOM
    assert cuda.supported_kv_cache_layouts() == cpu.supported_kv_cache_layouts()
    with pytest.raises(ValueError, match="sliding window not supported"):  # named by vLLM's selector
        _cuda_selects(has_sliding_window=True)


def test_rocm_xpu_and_mla_are_refused(on_cuda, monkeypatch) -> None:
    with pytest.raises(ValueError, match="ROCm/XPU"):
        select.ROCM_ATTN  # noqa: B018
    with pytest.raises(ValueError, match="MLA"):
        select.TRITON_MLA  # noqa: B018
    with pytest.raises(ValueError, match="MLA"):
        select.CPU_MLA  # noqa: B018
    monkeypatch.setattr(select, "_on_cuda", lambda: False)  # XPU: the same backend names, another platform
    with pytest.raises(ValueError, match="ROCm/XPU"):
        select.FLASH_ATTN  # noqa: B018


def test_disabled_kvarn_leaves_the_registry_stock(on_cuda, monkeypatch) -> None:
    """Not enabled: every name resolves to vLLM's own class path; CUSTOM (kvarn's slot) says whose it is."""
    monkeypatch.setattr(select, "_enabled", lambda: False)
    import vllm.utils.import_utils as iu

    monkeypatch.setattr(iu, "resolve_obj_by_qualname", lambda path: path)  # GPU backends do not import here
    assert select.FLASH_ATTN == "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend"
    with pytest.raises(ValueError, match="CUSTOM attention backend slot is kvarn's"):
        select.CUSTOM  # noqa: B018


def test_another_plugins_custom_backend_is_left_alone(monkeypatch) -> None:
    from vllm.v1.attention.backends.registry import register_backend

    monkeypatch.setattr(plugin, "_on_cpu", lambda: False)
    register_backend(AttentionBackendEnum.CUSTOM, "someone.else.Backend")
    try:
        plugin.register()
        assert AttentionBackendEnum.CUSTOM.get_path() == "someone.else.Backend"
    finally:
        for n in (*select.NOT_CPU, select.CUSTOM_SLOT):
            if n in AttentionBackendEnum.__members__:
                AttentionBackendEnum[n].clear_override()
