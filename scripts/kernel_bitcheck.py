"""Bit-identity of a C++ decode-kernel change: saves the fused kernel's outputs on fixed inputs, or compares them with
a saved run (`torch.equal`), for a refactor meant to change no arithmetic.

    python scripts/kernel_bitcheck.py save [FILE]       (with the old kernel source checked out; it rebuilds)
    python scripts/kernel_bitcheck.py compare [FILE]    (with the new one)

Inputs: 7 presets (KVarN, kvarn-auto with and without query-aware rounding and clipping, RTN, Hadamard; 2/4-bit,
head dims 64/96/128) x float32/bf16/fp16 keys, values and queries (sinks and tails kept in that dtype) x GQA ratios
1/3/4, with padding masks (`packed_attention` through the kernel, KVARN_KERNEL=cpu); plus the vLLM backend's batched
decode over the page pool of `scripts/vllm_layer_step.py` (fp slot rows read through row ids). FILE defaults to
/tmp/kvarn-kernel-bitcheck.pt. The float64-oracle tests (tests/kernels) bound the arithmetic; this shows that a
change kept it to the bit.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["KVARN_KERNEL"] = "cpu"

PRESETS = [("kvarn-k2v2-g128", 64), ("kvarn-auto-k2v2-g128", 64), ("kvarn-auto-k4v2-g128", 128),
           ("kvarn-k4v4-g64", 96), ("rtn-k2v2-g64", 64), ("kvarn-auto-k2v2-g128-qar-clip", 64),
           ("hadamard-k4v4-g128", 64)]


def cache_outputs() -> dict:
    from kvarn.attention import packed_attention
    from kvarn.presets import get_preset
    from tests.helpers import build_past, make_inputs, padding_mask

    outs = {}
    for preset, d in PRESETS:
        t = 16 + 3 * get_preset(preset).tile + 7
        for dt in (torch.float32, torch.bfloat16, torch.float16):
            gen = torch.Generator().manual_seed(0)
            k, v = make_inputs("heavy", 3, 2, t, d, gen).to(dt), make_inputs("gauss", 3, 2, t, d, gen).to(dt)
            past = build_past(preset, k, v, sink=16)
            for groups in (1, 3, 4):
                q = make_inputs("heavy", 3, 2 * groups, 1, d, gen).to(dt)
                kn, vn = make_inputs("heavy", 3, 2, 1, d, gen).to(dt), make_inputs("gauss", 3, 2, 1, d, gen).to(dt)
                outs[(preset, str(dt), groups)] = packed_attention(q, kn, vn, past, padding_mask([0, 5, 20], 1, t + 1),
                                                                   d ** -0.5, None)
    return outs


def paged_output() -> torch.Tensor:
    """One batched decode call over `vllm_layer_step`'s prefilled page pool (this folder)."""
    from vllm_layer_step import HQ, D, R, decode_plan, prefilled

    from kvarn.integrations.vllm import paged

    b = prefilled("kvarn-k2v2-g128")
    plan = decode_plan(b.table, b.blocks, b.lens, [x + 1 for x in b.lens])
    q = torch.randn(R, HQ, D, generator=torch.Generator().manual_seed(3)).bfloat16()
    return paged.batched_decode(b.pools[0], paged.decode_batch(plan, b.pools[0]), q, D ** -0.5, None)


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in ("save", "compare"):
        sys.exit(__doc__)
    path = sys.argv[2] if len(sys.argv) > 2 else "/tmp/kvarn-kernel-bitcheck.pt"
    warnings.filterwarnings("ignore", message="kvarn. key tiles stored before any query")
    outs = cache_outputs()
    outs["vllm batched decode"] = paged_output()
    if sys.argv[1] == "save":
        torch.save(outs, path)
        print(f"saved {len(outs)} outputs to {path}")
        return
    ref = torch.load(path)
    differ = [key for key in ref if key not in outs or not torch.equal(ref[key], outs[key])]
    print(f"compared {len(ref)} outputs: {len(differ)} differ" + (f": {differ}" if differ else " (bit-identical)"))
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
