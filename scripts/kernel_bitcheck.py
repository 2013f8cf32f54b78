"""Bit-identity of a C++ kernel change: saves the fused kernels' outputs on fixed inputs, or compares them with a saved
run (`torch.equal`), for a refactor meant to change no arithmetic.

    python scripts/kernel_bitcheck.py save [FILE]       (with the old kernel source checked out; it rebuilds)
    python scripts/kernel_bitcheck.py compare [FILE]    (with the new one)
    python scripts/kernel_bitcheck.py save|compare --store [FILE]    (the tile store on real tiles, below)

Inputs: `tests.helpers.kernel_outputs` (7 presets x float32/bf16/fp16 x GQA ratios 1/3/4, with padding masks,
through the kernels: KVARN_KERNEL=cpu); plus the vLLM backend's batched
decode over the page pool of `scripts/vllm_layer_step.py` (fp slot rows read through row ids) and the outputs of the
paged engine of tests/integrations/vllm/test_paged.py (chunked prefill pieces and decode rows, both prefill routes), so
a refactor of the backend's Python is checked to the bit as well. FILE defaults to
/tmp/kvarn-kernel-bitcheck.pt. The float64-oracle tests (tests/kernels) bound the arithmetic; this shows that a
change kept it to the bit.

--store: every tensor the C++ tile store left in a `KVarNCache` (`save_cache`) after 1,280 tokens of kvarn's default
text fed in chunks of 128 (the serving protocol: the running query statistics weigh kvarn-auto's choice and
query-aware rounding), for `kvarn-w2.5` on the embedded SmolLM2 and on Qwen2.5-Coder-0.5B; FILE defaults to
/tmp/kvarn-store-bitcheck.pt.
"""

from __future__ import annotations

import os
import sys
import tempfile
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


def engine_outputs() -> dict[str, torch.Tensor]:
    """The paged engine of tests/integrations/vllm/test_paged.py (G = 16) over chunked prefill and decode steps of two
    requests, float32 and bf16, sink blocks 0 and 1, with prefill pieces served by folding the tiles into the logits
    (FOLD_MAX_ROWS 128) and by SDPA over the decoded past (8): the backend's own arithmetic around the kernels."""
    import kvarn.attention.packed as packed_mod
    from tests.integrations.vllm.test_paged import Engine, G

    outs, fold = {}, packed_mod.FOLD_MAX_ROWS
    try:
        for rows in (128, 8):
            packed_mod.FOLD_MAX_ROWS = rows
            for dtype in (torch.float32, torch.bfloat16):
                for sink in (0, 1):
                    gen = torch.Generator().manual_seed(5)
                    eng = Engine(sink_blocks=sink, dtype=dtype)
                    eng.add("a")
                    eng.add("b")
                    for n, work in enumerate(({"a": 5 * G + 3, "b": 2 * G + 1}, {"a": 1, "b": 3 * G}, {"a": 1, "b": 1},
                                              {"b": 2 * G + 7, "a": 4 * G})):
                        for rid, o in eng.step(work, gen).items():
                            outs[f"vllm engine fold {rows} {dtype} sink {sink} step {n} {rid}"] = o
    finally:
        packed_mod.FOLD_MAX_ROWS = fold
    return outs


STORE_RUNS = (("default", "kvarn-w2.5"), ("qwen2.5-coder-0.5b", "kvarn-w2.5"))


def store_outputs(tokens: int = 1280) -> dict[str, torch.Tensor]:
    """--store: the stored tensors of `STORE_RUNS` (module docstring), keyed "model/preset:tensor"."""
    from safetensors.torch import load_file

    from kvarn.eval.text import load_tokens
    from kvarn.integrations.serialize import save_cache
    from kvarn.integrations.serving import prefill
    from kvarn.integrations.transformers import KVarNCache
    from kvarn.models import load_model

    os.environ.pop("KVARN_KERNEL")  # the kernels where they serve: the store always here, SDPA for the chunks
    outs = {}
    for name, preset in STORE_RUNS:
        model, tok = load_model(name)
        cache = KVarNCache(model.config, preset)
        prefill(model, load_tokens(tok, None, tokens), cache, 128)
        with tempfile.TemporaryDirectory() as d:
            save_cache(cache, f"{d}/c.safetensors")
            outs.update({f"{name}/{preset}:{k}": t for k, t in load_file(f"{d}/c.safetensors").items()})
    return outs


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--store"]
    store = len(args) < len(sys.argv) - 1
    if not args or args[0] not in ("save", "compare"):
        sys.exit(__doc__)
    path = args[1] if len(args) > 1 else f"/tmp/kvarn-{'store' if store else 'kernel'}-bitcheck.pt"
    warnings.filterwarnings("ignore", message="kvarn. key tiles stored before any query")
    if store:
        outs = store_outputs()
    else:
        outs = kernel_outputs()
        outs["vllm batched decode"] = paged_output()
        outs.update(engine_outputs())
    if args[0] == "save":
        torch.save(outs, path)
        print(f"saved {len(outs)} outputs to {path}")
        return
    ref = torch.load(path)
    differ = [key for key in ref if key not in outs or not torch.equal(ref[key], outs[key])]
    print(f"compared {len(ref)} outputs: {len(differ)} differ" + (f": {differ}" if differ else " (bit-identical)"))
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
