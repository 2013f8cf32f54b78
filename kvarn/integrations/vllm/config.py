"""The plugin's settings, read from vLLM's `additional_config["kvarn"]`, and the checks that refuse what it cannot do.

    LLM(model, additional_config={"kvarn": {"preset": "kvarn-auto-k2v2-g128"}})
    python -m vllm.entrypoints.openai.api_server --model M \
        --additional-config '{"kvarn": {"preset": "kvarn-auto-k2v2-g128"}}'

Keys of the "kvarn" mapping:
    preset       a kvarn preset of the affine family (kvarn-auto, the default kvarn-auto-k2v2-g128, with its rotation
                 chosen per tile from running query statistics (`paged`), and its `-qar` versions, keys rounded with
                 the running E[q q^T]; kvarn, rtn, hadamard, varn; k2v2/k4v2/k4v4; g128/g64): one vLLM block = one
                 tile of G tokens; or a budget preset (kvarn-b2.5, kvarn-b3.0 and their -qar versions: key widths
                 per layer, one allocation per engine chosen online, `budget`)
    sink         tokens kept exact at the start of every sequence (default: the preset's, 128); a multiple of G
    fp_slots     full-precision blocks per layer for sinks and blocks being filled, carved from the KV budget
                 (default: sized from the budget, `layout.choose_pool`: (sink/G + 1) * max_num_seqs + 1, what the
                 running sequences can need at once (`pool.fp_slots_for`), if that takes at most half of each kvarn
                 page; else half of it, and max_num_seqs lowered to what it holds, in the engine core too:
                 `backend.KVarNAttentionSpec`)
    prefill      the dtype of the SDPA that serves prefill pieces over their decoded past: "model" (default: bf16
                 when the model runs in bf16, as stock vLLM reads its bf16 pages; faster on a CPU with AMX-BF16) or
                 "float32" (as kvarn's transformers cache computes)

`additional_config` enters vLLM's config hash, so compiled graphs and caches never mix runs with and without kvarn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvarn.cache.allocation import OUTPUT_ROWS
from kvarn.presets import Preset, get_preset
from kvarn.quant.affine import AffineQuantizer

KEY = "kvarn"
_KNOWN = {"preset", "sink", "fp_slots", "prefill"}
PREFILL = ("model", "float32")


@dataclass(frozen=True)
class Settings:
    preset: Preset
    sink: int  # tokens, a multiple of the tile
    fp_slots: int | None  # None: sized from the KV budget (`layout.choose_pool`)
    prefill: str = "model"  # PREFILL: the prefill SDPA's dtype (module docstring)

    @property
    def tile(self) -> int:
        return self.preset.policy.tile

    @property
    def sink_blocks(self) -> int:
        return self.sink // self.tile


def raw_settings(vllm_config: Any) -> dict | None:
    """The "kvarn" mapping of `additional_config`, or None when the plugin is not enabled."""
    extra = getattr(vllm_config, "additional_config", None)
    if not isinstance(extra, dict) or KEY not in extra:
        return None
    raw = extra[KEY]
    if not isinstance(raw, dict):
        raise ValueError(f"additional_config['kvarn'] must be a mapping like {{'preset': 'kvarn-k4v2-g128'}}, "
                         f"got {raw!r}")
    return raw


def check_preset(preset: Preset) -> None:
    """Refuse presets the paged backend does not implement, naming why."""
    if not preset.quantized:
        raise ValueError(f"kvarn: preset {preset.name!r} does not quantize; run vLLM without the kvarn option instead")
    kq, vq = preset.quantizers(64)
    if not (isinstance(kq, AffineQuantizer) and isinstance(vq, AffineQuantizer)):
        raise ValueError(f"kvarn: preset {preset.name!r} is a baseline; the vLLM backend runs the affine family "
                         "(kvarn, rtn, hadamard, varn)")
    if kq.config.refine:
        raise ValueError(f"kvarn: preset {preset.name!r} stores refined key channels (two code widths in a tile), "
                         "which the vLLM backend's kernels do not read yet; serve kvarn-b2.5-qar or the default")
    if preset.key_high is not None:
        widths = [preset.key_high(64), *([] if preset.key_mid is None else [preset.key_mid(64)])]
        if not all(isinstance(q, AffineQuantizer) and q.tile == kq.tile for q in widths):
            raise ValueError(f"kvarn: budget preset {preset.name!r} promotes keys to a quantizer the vLLM backend "
                             "does not run (it needs the affine family at the preset's tile)")
        if kq.tile != OUTPUT_ROWS:
            raise ValueError(f"kvarn: budget preset {preset.name!r} has tiles of {kq.tile} tokens; the vLLM backend "
                             f"scores a layer's first tile with that tile's own queries, which needs {OUTPUT_ROWS}")
    policy = preset.policy
    if policy.value_window != "block" or any(policy.fp_layers) or policy.key_pre_rope:
        raise ValueError(f"kvarn: preset {preset.name!r} needs a sliding value window, full-precision layers or "
                         "pre-RoPE keys, which the vLLM backend does not support")
    if kq.tile != policy.tile or vq.tile != policy.tile:
        raise ValueError(f"kvarn: preset {preset.name!r} quantizes tiles of {kq.tile}/{vq.tile} tokens inside "
                         f"blocks of {policy.tile}; the vLLM backend needs one tile per block")


def parse(raw: dict) -> Settings:
    unknown = set(raw) - _KNOWN
    if unknown:
        raise ValueError(f"kvarn: unknown option(s) {sorted(unknown)} in additional_config['kvarn']; "
                         f"known: {sorted(_KNOWN)}")
    if "preset" not in raw:
        raise ValueError("kvarn: additional_config['kvarn'] needs a 'preset', e.g. 'kvarn-auto-k2v2-g128'")
    preset = get_preset(raw["preset"])
    check_preset(preset)
    sink = raw.get("sink", preset.policy.sink)
    if not isinstance(sink, int) or sink < 0 or sink % preset.policy.tile:
        raise ValueError(f"kvarn: sink must be a non-negative multiple of the tile ({preset.policy.tile}), got "
                         f"{sink!r}")
    fp_slots = raw.get("fp_slots")
    if fp_slots is not None and (not isinstance(fp_slots, int) or fp_slots < 1):
        raise ValueError(f"kvarn: fp_slots must be a positive integer, got {fp_slots!r}")
    prefill = raw.get("prefill", "model")
    if prefill not in PREFILL:
        raise ValueError(f"kvarn: prefill must be one of {list(PREFILL)}, got {prefill!r}")
    return Settings(preset, sink, fp_slots, prefill)


def settings_of(vllm_config: Any) -> Settings | None:
    raw = raw_settings(vllm_config)
    return None if raw is None else parse(raw)


def check_engine(vllm_config: Any, settings: Settings) -> None:
    """Refuse engine features the backend does not handle, at start-up (never a silent fallback)."""
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise ValueError("kvarn: speculative decoding is not supported by the kvarn vLLM backend yet")
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        raise ValueError("kvarn: KV transfer/offloading connectors copy vLLM pages, whose layout kvarn changes; "
                         "not supported")
    cache = vllm_config.cache_config
    if cache.block_size != settings.tile:
        raise ValueError(f"kvarn: vLLM's block size must equal the preset's tile ({settings.tile} tokens), got "
                         f"block_size={cache.block_size}; pass block_size={settings.tile}")
    pc = vllm_config.parallel_config
    if settings.preset.key_high is not None and getattr(pc, "pipeline_parallel_size", 1) > 1:
        raise ValueError("kvarn: budget presets choose key widths over all of a model's layers at once; pipeline "
                         "parallelism splits them over processes: not supported")
    if getattr(pc, "decode_context_parallel_size", 1) > 1 or getattr(pc, "prefill_context_parallel_size", 1) > 1:
        raise ValueError("kvarn: context parallelism is not supported")
