"""Bit-identity of a C++ decode-kernel change: saves the fused kernel's outputs on fixed inputs, or compares them with
a saved run (`torch.equal`), for a refactor meant to change no arithmetic.

    python scripts/kernel_bitcheck.py save [FILE]       (with the old kernel source checked out; it rebuilds)
    python scripts/kernel_bitcheck.py compare [FILE]    (with the new one)

Inputs: `tests.helpers.kernel_outputs` (7 presets x float32/bf16/fp16 x GQA ratios 1/3/4, with padding masks,
through the kernels: KVARN_KERNEL=cpu); plus the vLLM backend's batched
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

from tests.helpers import kernel_outputs  # noqa: E402


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
    outs = kernel_outputs()
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
