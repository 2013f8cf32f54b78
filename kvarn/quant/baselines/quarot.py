"""QuaRot's KV-cache quantization (Ashkboos et al., NeurIPS 2024, arXiv 2404.00456), the "HK" rotation baseline.

Keys (after RoPE) and values are rotated along head_dim by the orthonormal Hadamard matrix (`ops.hadamard`;
block-diagonal for non-power-of-two D) and every token of every head is quantized on its own: asymmetric RTN
over its D rotated channels (one group per head, QuaRot's `groupsize = head_dim`), with QuaRot's range

    [lo, hi] = [r * min(min(w), 0), r * max(max(w), 0)]      r = clip ratio (1.0 for `quarot`, 0.95 for
                                                             `quarot-clip95`); values outside are clamped
    delta = (hi - lo) / (2^b - 1), q = clamp(round((w - lo) / delta), 0, 2^b - 1), w^ = q delta + lo.

One difference from QuaRot's code: it rounds the zero point to an integer (round(-lo / delta)); here lo is kept
as an fp16 float like KIVI's minimum (same two fp16 numbers per token and head; at least as accurate).
Every token is quantized as soon as it is written (quantizer tile 1, flush unit 1, no sink, no residual), as
QuaRot does; the attention-sink token is then at 2 bits too, which costs a small model dearly.
`quarot-sink128` is the same quantizer under KVarN's cache policy (128 exact sink tokens, exact tail until a
block of 128 completes), so that it differs from the `hadamard` ablation only by quantizing keys per token.
Bits per element of the quantized region: b + 32/D (2.25 at D = 128, 2.5 at D = 64).
"""

from __future__ import annotations

from kvarn.quant.baselines.common import TokenRTN
from kvarn.quant.baselines.spec import PresetEntry, PresetSpec
from kvarn.quant.cache_policy import CachePolicy


def quarot_preset(k_bits: int, v_bits: int, clip: float = 1.0, sink: int = 0, flush: int = 1,
                  name: str | None = None) -> PresetSpec:
    suffix = ("" if clip == 1.0 else f"-clip{round(clip * 100)}") + (f"-sink{sink}" if sink else "")
    return PresetSpec(
        name=name or f"quarot-k{k_bits}v{v_bits}{suffix}",
        description=f"QuaRot: Hadamard on K and V, per-token asymmetric RTN (clip ratio {clip})"
                    + (f", sink {sink}, blocks of {flush}" if sink else ""),
        key=lambda d: TokenRTN(k_bits, d, tile=1, rotate=True, clip=clip, name=f"quarot-k{k_bits}"),
        value=lambda d: TokenRTN(v_bits, d, tile=1, rotate=True, clip=clip, name=f"quarot-v{v_bits}"),
        policy=CachePolicy(tile=flush, sink=sink, value_window="block"), family="quarot", k_bits=k_bits,
        v_bits=v_bits, params={"clip": clip}, notes={"paper": "arXiv:2404.00456"},
    )


PRESETS: tuple[PresetEntry, ...] = (
    ("quarot-k2v2", lambda: quarot_preset(2, 2), ("quarot",)),
    ("quarot-k2v2-clip95", lambda: quarot_preset(2, 2, 0.95), ("quarot-clip95",)),
    ("quarot-k4v4", lambda: quarot_preset(4, 4), ()),
    ("quarot-k2v2-sink128", lambda: quarot_preset(2, 2, sink=128, flush=128), ("quarot-sink128",)),
)
