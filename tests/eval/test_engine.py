"""Block-by-block runs in lockstep with the reference (kvarn.eval.engine): invariants a wrong harness breaks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvarn.eval.engine import RunSpec, run_blocks
from kvarn.presets import CachePolicy, Preset, get_preset
from kvarn.quant.base import Identity
from tests.helpers import make_tiny_model

T, BLOCK, TILE = 256, 32, 64  # 8 blocks; with sink 0 the first tile is quantized after block 1


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=64, hidden=128, vocab=256)


def _ids(seed: int, n: int = T) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (1, n), generator=g)


def exact_preset(tile: int = TILE) -> Preset:
    """Tiles go through the cache's quantize/decode path but come back bit for bit (float32 Identity)."""
    q = lambda _d: Identity(tile, torch.float32)  # noqa: E731
    return Preset("exact-f32", "exact tiles", key=q, value=q, policy=CachePolicy(tile=tile), family="test")


def _both(preset: Preset) -> list[RunSpec]:
    return [RunSpec(preset.name, preset, "static"), RunSpec(preset.name, preset, "cumulative")]


def test_shapes_and_reference(model, seed):
    ref, (tr,) = run_blocks(model, _ids(seed), [RunSpec("rtn", get_preset("rtn-k2v2-g64"))], BLOCK, sink=0,
                            show_progress=False)
    n_blocks = T // BLOCK
    assert tr.per_block("mae").shape == (n_blocks, 2)
    assert tr.positions("kl").shape == (T,) and tr.positions("top1").dtype == torch.bool
    assert tr.block_ends == [BLOCK * (j + 1) for j in range(n_blocks)]
    assert torch.isnan(tr.positions("nll")[-1]) and not torch.isnan(tr.positions("nll")[:-1]).any()
    # the reference compares to itself: zero error, full agreement
    assert ref.positions("kl").abs().max() == 0 and ref.positions("top1").all()
    assert tr.nbytes.packed > 0 and tr.seconds > 0


@pytest.mark.parametrize("name", ["fp16"])
def test_fp16_has_no_error(model, seed, name):
    """The fp16 preset stores K/V as given: both modes must match the reference exactly (same values, same
    attention kernel on the same shapes, so bitwise equal)."""
    _, traces = run_blocks(model, _ids(seed), _both(get_preset(name)), BLOCK, show_progress=False)
    for tr in traces:
        assert tr.per_block("mae").abs().max() == 0, tr.spec.label
        assert tr.positions("kl").abs().max() == 0, tr.spec.label
        assert tr.positions("top1").all()


def test_exact_quantizer_reproduces_reference(model, seed):
    """Cumulative (and static) runs whose tiles round-trip exactly reproduce the reference: the cache path
    (sink, tiles, tail, concatenation) adds nothing. Tolerance 1e-6 on MAE and 1e-9 on KL only covers a
    kernel summing in another order; in practice both are 0."""
    _, traces = run_blocks(model, _ids(seed), _both(exact_preset()), BLOCK, sink=0, show_progress=False)
    for tr in traces:
        assert tr.nbytes.packed > 0  # tiles really went through the quantizer path
        assert tr.per_block("mae").max() <= 1e-6, tr.spec.label
        assert tr.positions("kl").abs().max() <= 1e-9, tr.spec.label


def test_static_equals_cumulative_until_errors_can_feed_forward(model, seed):
    """With sink 0 and tiles of 64, the first tile is quantized when block 1 is appended, so block 2 is the
    first to attend quantized K/V. Up to and including block 2 both modes hold the same cache (blocks 0 and
    1 computed their K/V from an exact past), so their results must be identical; block 2 must already
    show an error (the check is not vacuous), and afterwards the modes must differ somewhere."""
    p = get_preset("rtn-k2v2-g64")
    _, (st, cu) = run_blocks(model, _ids(seed), _both(p), BLOCK, sink=0, show_progress=False)
    first = 2
    for name in ("kl", "nll"):
        a, b = st.positions(name)[: (first + 1) * BLOCK], cu.positions(name)[: (first + 1) * BLOCK]
        assert torch.equal(a, b), name
    assert torch.equal(st.per_block("mae")[: first + 1], cu.per_block("mae")[: first + 1])
    assert st.per_block("mae")[:first].max() == 0  # nothing quantized is attended yet
    assert st.per_block("mae")[first].min() > 0
    assert not torch.equal(st.per_block("mae"), cu.per_block("mae"))


def test_static_override_stores_reference_kv(model, seed):
    """Static mode: what the cache stores is the reference K/V. Checked with the exact-but-lossy-free path:
    a static run of the exact preset and a static run of fp16 both equal the reference (no accumulation)."""
    _, traces = run_blocks(model, _ids(seed), [RunSpec("exact", exact_preset(), "static"),
                                                RunSpec("fp16", get_preset("fp16"), "static")], BLOCK, sink=0,
                           show_progress=False)
    for tr in traces:
        assert tr.positions("kl").abs().max() <= 1e-9


def test_deterministic(model, seed):
    ids = _ids(seed)
    specs = [RunSpec("kvarn", get_preset("kvarn-k2v2-g64"), "cumulative")]
    a = run_blocks(model, ids, specs, BLOCK, sink=0, show_progress=False)[1]
    b = run_blocks(model, ids, specs, BLOCK, sink=0, show_progress=False)[1]
    for x, y in zip(a, b):
        assert torch.equal(x.per_block("mae"), y.per_block("mae"))
        assert torch.equal(x.positions("kl"), y.positions("kl"))


def test_bad_input(model):
    with pytest.raises(ValueError, match=r"\[1, T\]"):
        run_blocks(model, torch.zeros(2, 8, dtype=torch.long), [], 4, show_progress=False)
    with pytest.raises(ValueError, match="mode"):
        RunSpec("x", get_preset("rtn"), "accumulated")
    with pytest.raises(ValueError, match="block"):
        run_blocks(model, torch.zeros(1, 8, dtype=torch.long), [], 0, show_progress=False)


def test_label():
    p = dataclasses.replace(get_preset("rtn"))
    assert RunSpec("rtn", p, "static").label == "rtn/static"
