"""The kvarn attention backend for vLLM's CPU platform (it takes CPU_ATTN's place when the plugin is enabled), and its
CUDA twin `KVarNCudaAttentionBackend` (it takes the place of CUDA's backends and of the CUSTOM slot, `select`): the
same page, builder and impl; the kernels follow the tensors' device (`paged.decode_kernel`: C++ on CPU, Triton on
CUDA). The CUDA path has been tested on the CPU through the Triton interpreter only (docs/VLLM.md, "CUDA").

    KVarNAttentionBackend.customize_spec   a uint8 page of packed tiles + the fp pool share (`layout`), so vLLM sizes
                                           and reports its KV pool in kvarn's bytes
    KVarNMetadataBuilder.build             once per step: fp slots for every request (`pool.SlotTable`)
    KVarNAttentionImpl.forward             per layer: kvarn-auto's query statistics (one running mean per layer for
                                           the whole engine, `paged.observe_queries`), store, then attend (`paged`)

Sliding-window layers (Gemma 2/3-like hybrids) stay vLLM's: each keeps its FullAttentionSpec page in the model dtype
and is served by vLLM's own CPU attention (`WindowImpl`, `KVarNMetadataBuilder.__new__` hands its group vLLM's
builder); kvarn packs the full-attention layers. vLLM's hybrid KV cache manager must be off for such models
(`disable_hybrid_kv_cache_manager=True`): it would share page tensors between the two kinds of layers, and the
fp pool lives in the kvarn pages' bytes of every block.

Concurrency: `KVarNAttentionSpec` carries the sequences the fp pool holds to the engine core, which builds the
scheduler (the spec's `max_memory_usage_bytes` is the one kvarn hook that runs there before it; `cap_max_num_seqs`).

Refused at start-up, with a message: MLA (see `select`), attention sinks, ALiBi, encoder and cross attention, KV
sharing across layers, fp8 KV dtypes, speculative decoding, KV connectors, context parallelism, a block size other
than the preset's tile, a KV budget that vLLM must guess (one has to be given), and sliding-window layers with the
hybrid KV cache manager on.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, fields, replace
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
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, CPUAttentionMetadataBuilder
from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec, KVCacheLayout

from kvarn.integrations.vllm.budget import BudgetState, class_counts, class_spec_bytes, extra_page_bytes, step_layer
from kvarn.integrations.vllm.config import Settings, check_engine, settings_of
from kvarn.integrations.vllm.layout import (
    FP_SHARE_MAX,
    PageGeometry,
    TileLayout,
    choose_geometry,
    choose_pool,
    num_blocks_in,
)
from kvarn.integrations.vllm.paged import attend_step, observe_queries, write_step
from kvarn.integrations.vllm.pool import LayerPool, SlotTable, StepPlan, fp_slots_for, seq_fp_slots, write_stats

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


def crossing_requests(cfg: Any, seqs: int) -> int:
    """Requests of one step, of `seqs` running, that can complete a partly filled block and start the next
    (`pool.fp_slots_for`). vLLM's scheduler cuts a prefill at its token budget once a step (the budget is then spent),
    and the cut request continues first in the next, so one request continues a block at a time; a
    `long_prefill_token_threshold` cuts every long prefill, so then any running request may."""
    return seqs if getattr(cfg.scheduler_config, "long_prefill_token_threshold", 0) else 1


def default_fp_slots(cfg: Any, settings: Settings, max_num_seqs: int) -> int:
    return settings.fp_slots or fp_slots_for(settings.sink_blocks, max_num_seqs,
                                             crossing_requests(cfg, max_num_seqs))


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
        return True  # served by vLLM's own CPU attention (module docstring)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """One block = one tile: per head, G token slots of C bytes (packed tile + fp pool share), dtype uint8, as a
        `KVarNAttentionSpec`; a sliding-window layer's spec is vLLM's own."""
        cfg = _config()
        s = _settings(cfg)
        if getattr(spec, "sliding_window", None) is not None:
            packed = any(a.sliding_window is None for a in get_layers_from_vllm_config(cfg, Attention).values())
            if packed and not cfg.scheduler_config.disable_hybrid_kv_cache_manager:
                raise ValueError("kvarn: this model has sliding-window layers; pass "
                                 "disable_hybrid_kv_cache_manager=True (--disable-hybrid-kv-cache-manager): vLLM's "
                                 "hybrid KV cache manager would share page tensors between them and the kvarn layers, "
                                 "whose pages hold kvarn's full-precision pool")
            return spec
        if spec.block_size != s.tile:
            raise ValueError(f"kvarn: vLLM block size {spec.block_size} differs from the preset's tile {s.tile}; pass "
                             f"block_size={s.tile}")
        geo, seqs = page_geometry(cfg, s, spec.num_kv_heads, spec.head_size)
        base = {f.name: getattr(spec, f.name) for f in fields(spec) if f.init}
        return KVarNAttentionSpec(**{**base, "dtype": torch.uint8, "state_content_bytes": geo.c,
                                     "kvarn_max_num_seqs": seqs})


class KVarNCudaAttentionBackend(KVarNAttentionBackend):
    """The kvarn backend on vLLM's CUDA platform: the CPU backend's page (`KVarNAttentionSpec`), builder and impl.
    Sliding-window layers are not served there (on CPU vLLM's own CPU attention serves them; no CUDA twin of that
    yet): vLLM's selector is told so (`validate_configuration`) and names it."""

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # vLLM's third-party slot (a registry member: vLLM looks the name up)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False


@dataclass(frozen=True, kw_only=True)
class KVarNAttentionSpec(FullAttentionSpec):
    """A kvarn layer's spec (vLLM groups and manages it as full attention): the page of `customize_spec` and the
    sequences its fp pool holds. The engine core builds its scheduler from its own copy of the config right after it
    has sized the KV cache from these specs, calling `max_memory_usage_bytes` on each: the one point at which kvarn
    code runs there before, so that is where the scheduler's max_num_seqs is capped (`cap_max_num_seqs`)."""

    kvarn_max_num_seqs: int | None = None

    @classmethod
    def merge(cls, specs: list[Any]) -> KVarNAttentionSpec:
        """vLLM merges a group's layer specs into one (every uniform model: all its layers) by rebuilding it from
        the base fields: the sequence cap is carried over (the smallest), or the engine core's scheduler would never
        be capped and would schedule more sequences than the fp pool holds."""
        merged = super().merge(specs)
        caps = [s.kvarn_max_num_seqs for s in specs if getattr(s, "kvarn_max_num_seqs", None) is not None]
        return replace(merged, kvarn_max_num_seqs=min(caps)) if caps else merged

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        if self.kvarn_max_num_seqs is not None:
            cap_max_num_seqs(vllm_config, self.kvarn_max_num_seqs)
        return super().max_memory_usage_bytes(vllm_config)


def cap_max_num_seqs(cfg: Any, seqs: int) -> None:
    """Lower the config's max_num_seqs to what the fp pool holds, with one warning (a no-op at or below it)."""
    sched = cfg.scheduler_config
    if sched.max_num_seqs > seqs:
        log.warning("kvarn: the full-precision pool (at most %d%% of each kvarn page) holds the sink and filling "
                    "blocks of %d sequences: max_num_seqs lowered from %d to %d", round(FP_SHARE_MAX * 100), seqs,
                    sched.max_num_seqs, seqs)
        sched.max_num_seqs = seqs


def install_spec_hook() -> None:
    """Budget presets (`budget`): the kvarn layers' pages come in width classes, assigned in layer order, and vLLM's
    `customize_spec` is not told which layer it serves; so the model runner's spec dict (layer name -> spec, model
    order), which the engine core sizes each layer's tensor from, gets each kvarn layer's class bytes
    (`budget.class_spec_bytes`). Installed once per worker process, when a budget preset's layers are built; a
    no-op for runs without one."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner.get_kv_cache_spec
    if getattr(original, "kvarn_hook", False):
        return

    def get_kv_cache_spec(runner: Any) -> dict:
        specs = original(runner)
        s = settings_of(runner.vllm_config)
        ours = {n: spec for n, spec in specs.items() if isinstance(spec, KVarNAttentionSpec)}
        if s is None or s.preset.key_high is None or not ours:
            return specs
        first = next(iter(ours.values()))
        dtype = runner.vllm_config.model_config.dtype
        e = first.state_content_bytes - TileLayout(s.preset, first.head_size, dtype).c0
        sizes = class_spec_bytes(ours, s.preset, e, dtype)
        return {n: replace(spec, state_content_bytes=sizes[n]) if n in sizes else spec for n, spec in specs.items()}

    get_kv_cache_spec.kvarn_hook = True  # type: ignore[attr-defined]
    GPUModelRunner.get_kv_cache_spec = get_kv_cache_spec


def install_zeroing_guard() -> None:
    """vLLM zeroes each newly allocated block of its full-attention layers (slab kv[block] of each layer's tensor)
    when the cache mixes precisions, as a hybrid model's does (kvarn's uint8 pages beside the sliding-window layers'
    model dtype). A kvarn page tensor is not one slab per block (`pool.page_regions`: every block's packed runs, then
    the fp slots), and kvarn writes every byte before it reads it: so the kvarn layers are left out of that zeroing,
    which would wipe other blocks' tiles and running sequences' fp rows. Installed once per worker process."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    original = CPUModelRunner._zero_block_ids
    if getattr(original, "kvarn_hook", False):
        return

    def _zero_block_ids(runner: Any, block_ids: list[int]) -> None:
        cfg, ctx = runner.kv_cache_config, runner.compilation_config.static_forward_context
        groups = [replace(g, layer_names=[n for n in g.layer_names
                                          if not isinstance(getattr(ctx.get(n), "impl", None), KVarNAttentionImpl)])
                  for g in cfg.kv_cache_groups]
        runner.kv_cache_config = replace(cfg, kv_cache_groups=groups)
        try:
            original(runner, block_ids)
        finally:
            runner.kv_cache_config = cfg

    _zero_block_ids.kvarn_hook = True  # type: ignore[attr-defined]
    CPUModelRunner._zero_block_ids = _zero_block_ids


def window_page_bytes(cfg: Any, tile: int) -> int:
    """What one block costs in the sliding-window layers (vLLM's own pages, K and V in the model dtype)."""
    itemsize = cfg.model_config.dtype.itemsize
    return sum(2 * tile * a.num_kv_heads * a.head_size * itemsize
               for a in get_layers_from_vllm_config(cfg, Attention).values() if a.sliding_window is not None)


def page_geometry(cfg: Any, s: Settings, num_kv_heads: int, head_dim: int) -> tuple[PageGeometry, int]:
    """The kvarn page and the sequences its fp pool holds (`layout.choose_pool`; max_num_seqs with fp_slots set)."""
    budget = cfg.cache_config.kv_cache_memory_bytes
    if budget is None:
        raise ValueError("kvarn: give vLLM an explicit KV cache budget (VLLM_CPU_KVCACHE_SPACE in GiB, or "
                         "kv_cache_memory_bytes): the full-precision pool is carved from it")
    attn = get_layers_from_vllm_config(cfg, Attention)
    layers = sum(a.sliding_window is None for a in attn.values()) or cfg.model_config.get_num_layers(
        cfg.parallel_config)
    window = window_page_bytes(cfg, s.tile)
    lay = TileLayout(s.preset, head_dim, cfg.model_config.dtype)
    wider = 0 if s.preset.key_high is None else extra_page_bytes(  # a budget preset's wider key pages, per block
        s.preset, layers, num_kv_heads, head_dim, cfg.model_config.dtype)
    other = window + wider
    sched = cfg.scheduler_config
    if s.fp_slots:  # asked for: exactly that pool, or a refusal
        geo, seqs = choose_geometry(lay, num_kv_heads, layers, budget, s.fp_slots, other), sched.max_num_seqs
    else:
        geo, seqs = choose_pool(lay, num_kv_heads, layers, budget, sched.max_num_seqs,
                                lambda n: default_fp_slots(cfg, s, n), other)
        cap_max_num_seqs(cfg, seqs)  # this process's copy (the slot table's check); the engine core's: the spec
    seq = seq_fp_slots(s.sink_blocks)
    ratio = geo.tokens_ratio_vs_bf16() * layers * geo.page_bytes / (layers * geo.page_bytes + wider)
    msg = (f"kvarn: preset {s.preset.name}, {geo.layout.tile * geo.c} bytes per head per block ({lay.packed_bytes} "
           f"packed + {lay.tile * geo.e} fp pool share, {geo.blocks_per_slot} blocks per fp slot"
           + (f"; 2-bit key pages, wider ones {wider // num_kv_heads} bytes more per head and block over the "
              "layers" if wider else "")
           + f"); {ratio:.2f}x the tokens of a bf16 cache per byte; a running sequence holds {seq} fp "
           f"blocks per layer ({seq * lay.fp_bytes * num_kv_heads * layers / 2**20:.2f} MiB over {layers} layers; a "
           f"prefill continuing a block one more while it runs), "
           f"the pool {geo.fp_slots(num_blocks_in(geo, layers, budget, other))} per layer"
           + (f"; {len(attn) - layers} sliding-window layers kept by vLLM" if window else "")
           + (f"; key pages by layer: {class_counts(s.preset, layers, head_dim)} (budget preset: key widths "
              "chosen on the first request long enough)" if s.preset.key_high is not None else ""))
    if msg not in _LOGGED:  # customize_spec runs once per layer
        _LOGGED.add(msg)
        log.info(msg)
    return geo, seqs


def stats_path() -> str | None:
    """Where this worker writes its fp pool's state every step (`pool.PoolStats`, JSON): KVARN_POOL_STATS, suffixed
    ".rank<r>" on tensor-parallel ranks other than 0 (each rank has its own pool); None when unset."""
    path = os.environ.get("KVARN_POOL_STATS")
    if not path:
        return None
    from vllm.distributed import get_tensor_model_parallel_rank

    try:
        rank = get_tensor_model_parallel_rank()
    except (AssertionError, RuntimeError):  # no TP group in this process
        rank = 0
    return f"{path}.rank{rank}" if rank else path


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
    budget: BudgetState | None = None  # budget presets: the engine's key allocation and the pools it binds


class KVarNMetadataBuilder(AttentionMetadataBuilder[KVarNMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __new__(cls, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: Any,
                device: torch.device) -> Any:
        """A group of sliding-window layers gets vLLM's own CPU builder (their pages and attention are vLLM's)."""
        if getattr(kv_cache_spec, "sliding_window", None) is not None:
            return CPUAttentionMetadataBuilder(kv_cache_spec, layer_names, vllm_config, device)
        return super().__new__(cls)

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: Any,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.settings = _settings(vllm_config)
        check_engine(vllm_config, self.settings)
        self.vllm_config = vllm_config
        self.stats_path = stats_path()

    def _shared(self) -> SharedPool:
        """The fp pool's slot table (and a budget preset's key allocation) of this engine: one per worker process,
        shared by every kvarn builder (vLLM makes one per attention group; a budget preset's page classes make three
        groups)."""
        cfg = self.vllm_config
        key = id(cfg)
        if key not in _SHARED:
            _SHARED[key] = (cfg, _make_shared(cfg, self.settings, self.kv_cache_spec))
        return _SHARED[key][1]

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KVarNMetadata:
        m = common_attn_metadata
        shared = self._shared()
        if shared.last is not None and shared.last[0] is m:  # another attention group of this step: one plan
            plan = shared.last[1]
        else:
            n = m.num_reqs
            qsl = m.query_start_loc_cpu[:n + 1].tolist()
            seq = m.seq_lens[:n].cpu().tolist()
            g = self.settings.tile
            rows = [(qsl[i], qsl[i + 1]) for i in range(n)]
            computed = [seq[i] - (qsl[i + 1] - qsl[i]) for i in range(n)]
            bt = m.block_table_tensor.cpu()
            block_rows = [bt[i, :-(-seq[i] // g)].tolist() for i in range(n)]
            plan = shared.table.plan(rows, computed, seq, block_rows)
            shared.last = (m, plan)  # vLLM hands every attention group of a step the same object
            if self.stats_path:
                write_stats(self.stats_path, shared.table.stats(),
                            None if shared.budget is None else shared.budget.report())
        return KVarNMetadata(m.num_actual_tokens, m.max_query_len, m.max_seq_len, m.query_start_loc, m.seq_lens,
                             m.block_table_tensor, m.slot_mapping, plan, shared.budget)


@dataclass
class SharedPool:
    """What the kvarn builders of one engine (worker process) share: the slot table, a budget preset's key allocation,
    and the latest step's plan with the metadata object it was built from."""

    table: SlotTable
    budget: BudgetState | None
    last: tuple[Any, StepPlan] | None = None


_SHARED: dict[int, tuple[Any, SharedPool]] = {}  # id(vllm config) -> (the config, kept alive; its pool)


def _make_shared(cfg: Any, s: Settings, spec: AttentionSpec) -> SharedPool:
    names = [n for n, a in get_layers_from_vllm_config(cfg, Attention).items() if a.sliding_window is None]
    tensors = [_layer_tensor(cfg, name) for name in names]
    kv = tensors[0]
    lay = TileLayout(s.preset, spec.head_size, cfg.model_config.dtype)
    # a budget preset's tensors differ in their packed part (`budget.page_classes`), not in the share
    e = (page_geometry(cfg, s, spec.num_kv_heads, spec.head_size)[0].e if s.preset.key_high is not None
         else kv.shape[-1] - lay.c0)
    n_slots = PageGeometry(lay, spec.num_kv_heads, e).fp_slots(kv.shape[0])
    need = default_fp_slots(cfg, s, cfg.scheduler_config.max_num_seqs)
    if n_slots < need:
        raise ValueError(f"kvarn: vLLM allocated {kv.shape[0]} blocks, whose fp pool share holds {n_slots} "
                         f"full-precision blocks per layer; {need} are needed for max_num_seqs="
                         f"{cfg.scheduler_config.max_num_seqs}; lower max_num_seqs or raise the KV budget")
    log.info("kvarn: %d blocks of %d tokens, fp pool of %d blocks per layer", kv.shape[0], lay.tile, n_slots)
    table = SlotTable(n_slots, lay.tile, s.sink_blocks)
    bud = None
    if s.preset.key_high is not None:
        bud = BudgetState(s.preset, names, tensors, spec.head_size, e, cfg.model_config.dtype, table)
        table.keep_sinks, table.on_full = True, bud.decide_unscored
    return SharedPool(table, bud)


def _layer_tensor(cfg: Any, name: str) -> torch.Tensor:
    """The uint8 page tensor vLLM bound to layer `name`."""
    kv = cfg.compilation_config.static_forward_context[name].kv_cache
    return kv if isinstance(kv, torch.Tensor) else kv[0]


class WindowImpl(CPUAttentionBackendImpl):
    """A sliding-window layer under the kvarn backend class: vLLM's own CPU attention over its own pages. The kvarn
    class says its forward writes the cache (so vLLM does not call `do_kv_cache_update` itself): this one does, then
    attends as vLLM would."""

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Any, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if attn_metadata is not None and key is not None and value is not None:
            n = attn_metadata.num_actual_tokens
            self.do_kv_cache_update(layer, key[:n], value[:n], kv_cache, attn_metadata.slot_mapping[:n])
        return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                               output_block_scale)


class KVarNAttentionImpl(AttentionImpl):
    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """A sliding-window layer gets `WindowImpl` (vLLM's attention); every other layer the kvarn one."""
        from vllm.platforms import current_platform

        window = args[5] if len(args) > 5 else kwargs.get("sliding_window")
        if window is not None and current_platform.is_cpu():
            return WindowImpl(*args, **kwargs)
        return super().__new__(cls, *args, **kwargs)

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, sinks: torch.Tensor | None = None) -> None:
        from vllm.platforms import current_platform

        refused = {"ALiBi": alibi_slopes is not None,
                   "a logit soft cap off the CPU platform (the Triton decode has none yet)":
                       bool(logits_soft_cap) and not current_platform.is_cpu(),
                   "sliding-window layers off the CPU platform": sliding_window is not None
                       and not current_platform.is_cpu(),
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
        if self.settings.preset.key_high is not None:
            install_spec_hook()
        if current_platform.is_cpu():
            install_zeroing_guard()
        self._pool: LayerPool | None = None
        self._pool_key: int | None = None

    def _layer_pool(self, kv_cache: torch.Tensor, dtype: torch.dtype) -> LayerPool:
        key = kv_cache.data_ptr()
        if self._pool is None or self._pool_key != key:
            lay = TileLayout(self.settings.preset, self.head_size, dtype)
            geo = PageGeometry(lay, self.num_kv_heads, kv_cache.shape[-1] - lay.c0)
            kept = self._pool.queries if self._pool is not None else None  # the layer's running query energy
            self._pool, self._pool_key = LayerPool(kv_cache, geo, kept), key
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
        name = getattr(layer, "layer_name", "?")
        plan, bud = attn_metadata.plan, attn_metadata.budget
        if bud is not None:  # a budget preset: the engine's key allocation binds this layer's pool
            step_layer(bud, name, plan, query[:n], key[:n], value[:n], output[:n], self.scale, self.softcap,
                       self.settings.prefill)
            return output
        pool = self._layer_pool(kv_cache, query.dtype)
        observe_queries(pool, query[:n])  # kvarn-auto: before this step's key tiles are quantized
        exact = write_step(pool, plan, key[:n], value[:n], name)
        attend_step(pool, plan, query[:n], output[:n], exact, self.scale, self.softcap, name, self.settings.prefill)
        return output
