"""The paged kvarn cache's CUDA path (`paged.decode_kernel` -> "triton") on the CPU through TRITON_INTERPRET=1.

The stand-in engine of test_paged.py (real `SlotTable.plan`, `LayerPool` over a uint8 page pool, chunked prefill,
decode rows of different lengths, a completing block, a prefix-cache hit on a sink block) with the pool's kernels
switched to Triton, as a CUDA pool gets them: the step's decode rows in one `paged.triton_decode` launch (fixed
`MAX_SPLITS`), completed blocks written by the Triton store kernel; prefill pieces take PyTorch, as on the CPU.

Tolerances. Against the float64 oracle of test_paged.py: 1e-4, the same as the CPU paths (float32 accumulation over
<= 96 keys of magnitude ~N(0, 1); the -inf padding becomes lengths of exact regions, weights exactly 0 either way);
this holds only if the Triton store writes the codes the oracle's `encode` writes, which it does here bit for bit
(asserted: page bytes equal to those of the CPU store). Against the C++ batched decode on the same pages: 1e-5 (two
float32 online softmaxes in different orders: splits, then dense regions merged by log-sum-exp).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # conftest sets it first (before anything imports triton)

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the Triton paged decode is not tested")

from kvarn.integrations.vllm import paged
from tests.integrations.vllm.test_paged import Engine, _mixed_steps


def _on_triton(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """CPU pools take the CUDA path (Triton kernels under the interpreter); returns the batch sizes of the Triton
    decode calls, and asserts below that the store kernel ran."""
    monkeypatch.setattr(paged, "decode_kernel", lambda device: "triton")
    sizes: list[int] = []
    real = paged.triton_decode
    monkeypatch.setattr(paged, "triton_decode", lambda pool, batch, *a: sizes.append(len(batch.requests)) or
                        real(pool, batch, *a))
    return sizes


def test_triton_path_matches_oracle_and_cpu_kernels(monkeypatch) -> None:
    """Every step's decode rows in one Triton launch, completed blocks through the Triton store: outputs match the
    float64 oracle (1e-4) and the same steps on the C++ kernels (1e-5), whose page bytes the Triton store reproduces
    bit for bit (so both decodes read the same pages; module docstring)."""
    from kvarn.kernels.triton import ops

    if not paged.kernel.available():
        pytest.skip("the CPU kernel cannot be built here")
    monkeypatch.setenv("KVARN_KERNEL", "cpu")  # no silent fallback: a kernel that cannot serve raises
    stores = []
    real_store = ops.store_tiles
    monkeypatch.setattr(ops, "store_tiles", lambda x, *a, **k: stores.append(x.shape[0]) or real_store(x, *a, **k))
    cpu = Engine(sink_blocks=1)
    out_c = _mixed_steps(cpu, torch.Generator().manual_seed(13), check=False)
    assert not stores
    sizes = _on_triton(monkeypatch)
    eng = Engine(sink_blocks=1)
    out_t = _mixed_steps(eng, torch.Generator().manual_seed(13), check=True)
    assert sizes == [3, 4, 5, 5, 5], sizes  # a, c, e (b is prefilling); then a, c, b, e; then all five
    assert stores, "the Triton store kernel wrote no block"
    assert torch.equal(eng.kv, cpu.kv)
    for oc, ot in zip(out_c, out_t):
        for rid in oc:
            torch.testing.assert_close(ot[rid], oc[rid], rtol=1e-5, atol=1e-5, msg=f"request {rid}")


def test_kernel_selection_by_device(monkeypatch) -> None:
    """CPU pools take the C++ kernels, CUDA pools the Triton ones, anything else is refused by name; KVARN_KERNEL=cpu
    on a pool the Triton decode cannot read raises instead of running PyTorch silently."""
    assert paged.decode_kernel(torch.device("cpu")) == "cpu"
    assert paged.decode_kernel(torch.device("cuda", 0)) == "triton"
    with pytest.raises(ValueError, match="xpu"):
        paged.decode_kernel(torch.device("xpu"))
    monkeypatch.setattr(paged, "decode_kernel", lambda device: "triton")
    monkeypatch.setenv("KVARN_KERNEL", "cpu")
    eng = Engine(preset_bits=(4, 2), sink_blocks=1)
    monkeypatch.setattr(paged, "triton_unsupported", lambda pool: "3-bit codes")
    eng.add("a")
    with pytest.raises(RuntimeError, match=r"Triton paged decode cannot serve.*3-bit"):
        eng.step({"a": 17}, torch.Generator().manual_seed(1))
