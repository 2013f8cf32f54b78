"""The kvarn attention backend for vLLM's CPU platform (it takes CPU_ATTN's place when the plugin is enabled).

    KVarNAttentionBackend.customize_spec   a uint8 page of packed tiles + the fp pool share (`layout`), so vLLM sizes
                                           and reports its KV pool in kvarn's bytes
    KVarNMetadataBuilder.build             once per step: fp slots for every request (`pool.SlotTable`)
    KVarNAttentionImpl.forward             per layer: store, then attend (`paged`)

Refused at start-up, with a message: MLA (see `select`), sliding-window layers, attention sinks, ALiBi, encoder and
cross attention, KV sharing across layers, fp8 KV dtypes, speculative decoding, KV connectors, context parallelism,
a block size other than the preset's tile, and a KV budget that vLLM must guess (one has to be given).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from vllm.config import get_current_vllm_config_or_none, get_layers_from_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from kvarn.integrations.vllm.config import Settings, check_engine, settings_of
from kvarn.integrations.vllm.layout import FP_SHARE_MAX, PageGeometry, TileLayout, choose_geometry, choose_pool
from kvarn.integrations.vllm.paged import attend_step, write_step
from kvarn.integrations.vllm.pool import LayerPool, SlotTable, StepPlan, seq_fp_slots

log = logging.getLogger("vllm.kvarn")  # a child of vLLM's logger: its handlers and format


# The config this worker process builds its model with, seen while the model's layers are made (vLLM sets it as
# "current" then) and kept for later hooks that run outside that context (customize_spec).
_CONFIG: list[Any] = []
_LOGGED: set[str] = set()


def _remember_config() -> None:
    cfg = get_current_vllm_config_or_none()
    if cfg is not None:
        _CONFIG[:] = [cfg]


def _config() -> Any:
    cfg = get_current_vllm_config_or_none()
    if cfg is not None and settings_of(cfg) is not None:
        return cfg
    if not _CONFIG:
        raise RuntimeError("kvarn: no vLLM config seen in this process yet")
    return _CONFIG[0]


def _settings(vllm_config: Any = None) -> Settings:
    cfg = vllm_config if vllm_config is not None else _config()
    s = settings_of(cfg) if cfg is not None else None
    if s is None:
        raise RuntimeError("kvarn: the kvarn backend is in use but additional_config['kvarn'] is not set")
    return s


def default_fp_slots(settings: Settings, max_num_seqs: int) -> int:
    return settings.fp_slots or seq_fp_slots(settings.sink_blocks) * max_num_seqs


class KVarNAttentionBackend(AttentionBackend):
    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"  # the slot it fills; the classes say kvarn

    @staticmethod
    def get_impl_cls() -> type[KVarNAttentionImpl]:
        return KVarNAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[KVarNMetadataBuilder]:
        return KVarNMetadataBuilder

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """One block = one tile: per head, G token slots of C bytes (packed tile + fp pool share), dtype uint8."""
        cfg = _config()
        s = _settings(cfg)
        if spec.block_size != s.tile:
            raise ValueError(f"kvarn: vLLM block size {spec.block_size} differs from the preset's tile {s.tile}; pass "
                             f"block_size={s.tile}")
        geo = page_geometry(cfg, s, spec.num_kv_heads, spec.head_size)
        return replace(spec, dtype=torch.uint8, state_content_bytes=geo.c)


def page_geometry(cfg: Any, s: Settings, num_kv_heads: int, head_dim: int) -> PageGeometry:
    budget = cfg.cache_config.kv_cache_memory_bytes
    if budget is None:
        raise ValueError("kvarn: give vLLM an explicit KV cache budget (VLLM_CPU_KVCACHE_SPACE in GiB, or "
                         "kv_cache_memory_bytes): the full-precision pool is carved from it")
    layers = len(get_layers_from_vllm_config(cfg, Attention)) or cfg.model_config.get_num_layers(cfg.parallel_config)
    lay = TileLayout(s.preset, head_dim, cfg.model_config.dtype)
    sched = cfg.scheduler_config
    if s.fp_slots:  # asked for: exactly that pool, or a refusal
        geo = choose_geometry(lay, num_kv_heads, layers, budget, s.fp_slots)
    else:
        geo, seqs = choose_pool(lay, num_kv_heads, layers, budget, sched.max_num_seqs,
                                lambda n: default_fp_slots(s, n))
        if seqs < sched.max_num_seqs:
            lower_max_num_seqs(cfg, seqs, budget)
    seq = seq_fp_slots(s.sink_blocks)
    msg = (f"kvarn: preset {s.preset.name}, {geo.layout.tile * geo.c} bytes per head per block ({lay.packed_bytes} "
           f"packed + {lay.tile * geo.e} fp pool share, {geo.blocks_per_slot} blocks per fp slot); "
           f"{geo.tokens_ratio_vs_bf16():.2f}x the tokens of a bf16 cache per byte; a running sequence holds {seq} fp "
           f"blocks per layer ({seq * lay.fp_bytes * num_kv_heads * layers / 2**20:.2f} MiB over {layers} layers), "
           f"the pool {geo.fp_slots(budget // (layers * geo.page_bytes))} per layer")
    if msg not in _LOGGED:  # customize_spec runs once per layer
        _LOGGED.add(msg)
        log.info(msg)
    return geo


def lower_max_num_seqs(cfg: Any, seqs: int, budget: int) -> None:
    """Cap the scheduler's max_num_seqs at what the fp pool holds, as vLLM caps its own limits: the engine core
    builds its scheduler from this very config after the KV cache spec is made (single-process executor). Ranks of a
    multi-process executor hold copies the scheduler never sees: refused there."""
    sched = cfg.scheduler_config
    if cfg.parallel_config.world_size > 1:
        raise ValueError(f"kvarn: the full-precision pool of a {budget / 2**30:.2f} GiB KV cache holds {seqs} "
                         f"sequences, fewer than max_num_seqs={sched.max_num_seqs}; with several ranks kvarn cannot "
                         f"lower it itself: pass max_num_seqs={seqs} (or raise the KV budget)")
    log.warning("kvarn: the full-precision pool (at most %d%% of the %.2f GiB KV cache) holds the sink and filling "
                "blocks of %d sequences: max_num_seqs lowered from %d to %d", round(FP_SHARE_MAX * 100),
                budget / 2**30, seqs, sched.max_num_seqs, seqs)
    sched.max_num_seqs = seqs


@dataclass
class KVarNMetadata:
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    plan: StepPlan


class KVarNMetadataBuilder(AttentionMetadataBuilder[KVarNMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: Any,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.settings = _settings(vllm_config)
        check_engine(vllm_config, self.settings)
        self.vllm_config = vllm_config
        self.table: SlotTable | None = None

    def _slot_table(self) -> SlotTable:
        if self.table is None:
            cfg, s = self.vllm_config, self.settings
            ctx = cfg.compilation_config.static_forward_context[self.layer_names[0]]
            kv = ctx.kv_cache if isinstance(ctx.kv_cache, torch.Tensor) else ctx.kv_cache[0]
            spec = self.kv_cache_spec
            lay = TileLayout(s.preset, spec.head_size, cfg.model_config.dtype)
            geo = PageGeometry(lay, spec.num_kv_heads, kv.shape[-1] - lay.c0)
            n_slots = geo.fp_slots(kv.shape[0])
            need = default_fp_slots(s, cfg.scheduler_config.max_num_seqs)
            if n_slots < need:
                raise ValueError(f"kvarn: vLLM allocated {kv.shape[0]} blocks, whose fp pool share holds {n_slots} "
                                 f"full-precision blocks per layer; {need} are needed for max_num_seqs="
                                 f"{cfg.scheduler_config.max_num_seqs}; lower max_num_seqs or raise the KV budget")
            log.info("kvarn: %d blocks of %d tokens, fp pool of %d blocks per layer", kv.shape[0], lay.tile, n_slots)
            self.table = SlotTable(n_slots, lay.tile, s.sink_blocks)
        return self.table

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KVarNMetadata:
        m = common_attn_metadata
        n = m.num_reqs
        qsl = m.query_start_loc_cpu[:n + 1].tolist()
        seq = m.seq_lens[:n].cpu().tolist()
        g = self.settings.tile
        rows = [(qsl[i], qsl[i + 1]) for i in range(n)]
        computed = [seq[i] - (qsl[i + 1] - qsl[i]) for i in range(n)]
        bt = m.block_table_tensor.cpu()
        block_rows = [bt[i, :-(-seq[i] // g)].tolist() for i in range(n)]
        plan = self._slot_table().plan(rows, computed, seq, block_rows)
        return KVarNMetadata(m.num_actual_tokens, m.max_query_len, m.max_seq_len, m.query_start_loc, m.seq_lens,
                             m.block_table_tensor, m.slot_mapping, plan)


class KVarNAttentionImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, sinks: torch.Tensor | None = None) -> None:
        refused = {"ALiBi": alibi_slopes is not None, "sliding-window attention": sliding_window is not None,
                   f"attention type {attn_type!r}": attn_type != AttentionType.DECODER,
                   "KV sharing across layers": kv_sharing_target_layer_name is not None,
                   "attention sink logits": sinks is not None,
                   f"kv_cache_dtype {kv_cache_dtype!r}": kv_cache_dtype != "auto"}
        bad = [k for k, v in refused.items() if v]
        if bad:
            raise ValueError(f"kvarn: the kvarn vLLM backend does not support {', '.join(bad)}; run this model "
                             "without additional_config['kvarn']")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads
        self.softcap = logits_soft_cap or None
        self.kv_sharing_target_layer_name = None
        _remember_config()
        self.settings = _settings()
        self._pool: LayerPool | None = None
        self._pool_key: int | None = None

    def _layer_pool(self, kv_cache: torch.Tensor, dtype: torch.dtype) -> LayerPool:
        key = kv_cache.data_ptr()
        if self._pool is None or self._pool_key != key:
            lay = TileLayout(self.settings.preset, self.head_size, dtype)
            geo = PageGeometry(lay, self.num_kv_heads, kv_cache.shape[-1] - lay.c0)
            self._pool, self._pool_key = LayerPool(kv_cache, geo), key
        return self._pool

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: KVarNMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("kvarn: fused output quantization is not supported")
        if attn_metadata is None:  # profiling / warm-up runs
            return output
        n = attn_metadata.num_actual_tokens
        pool = self._layer_pool(kv_cache, query.dtype)
        name = getattr(layer, "layer_name", "?")
        exact = write_step(pool, attn_metadata.plan, key[:n], value[:n], name)
        attend_step(pool, attn_metadata.plan, query[:n], output[:n], exact, self.scale, self.softcap, name)
        return output
