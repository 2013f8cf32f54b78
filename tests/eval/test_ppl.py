"""Strided perplexity windows and the block-by-block reference (kvarn.eval.ppl)."""

from __future__ import annotations

import pytest
import torch

from kvarn.eval.ppl import evaluate, windows
from kvarn.presets import get_preset
from tests.helpers import make_tiny_model


@pytest.mark.parametrize("n,window,stride", [(100, 30, 30), (100, 30, 10), (64, 64, 64), (65, 64, 16), (7, 10, 5)])
def test_windows_score_each_target_at_most_once(n, window, stride):
    wins = windows(n, window, stride)
    assert wins[0][0] == 0 and wins[-1][1] == n
    scored = []
    for begin, end, first in wins:
        assert end - begin <= window
        # position p of the window predicts the token at begin + p + 1 (targets inside the window only)
        scored += [begin + p + 1 for p in range(first, end - begin - 1)]
    assert len(scored) == len(set(scored))
    # every target is scored, except the first token of a window that starts right at the previous end
    missed = set(range(1, n)) - set(scored)
    assert missed <= {b for b, _, _ in wins}
    if stride < window:
        assert not missed


def test_stride_larger_than_window_is_refused():
    with pytest.raises(ValueError, match="stride"):
        windows(100, 10, 20)


def test_reference_matches_one_pass_and_fp16_matches_reference(seed):
    """The block-by-block reference scores the same NLL as one plain forward over the window (float32 sums
    in another order: rtol 1e-5); an unquantized KVarNCache gives exactly the reference (KL 0, same ppl)."""
    model = make_tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=64, hidden=64, vocab=128,
                            seed=seed)
    ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(seed))
    r = evaluate(model, ids, [get_preset("fp16"), get_preset("rtn-k2v2-g64")], window=100, stride=100, block=32,
                 sink=0)
    with torch.inference_mode():
        nll = []
        for begin in (0, 100):
            logits = model(input_ids=ids[:, begin:begin + 100]).logits[0, :-1].double()
            nll.append(torch.nn.functional.cross_entropy(logits, ids[0, begin + 1:begin + 100], reduction="none"))
    one_pass = torch.cat(nll).mean().item()
    assert r["reference"]["nll"] == pytest.approx(one_pass, rel=1e-5)
    assert r["reference"]["scored"] == 2 * 99
    fp, rtn = r["results"]
    assert fp["kl"] == 0 and fp["ppl"] == r["reference"]["ppl"]
    assert rtn["kl"] > 0 and len(rtn["ppl_windows"]) == 2 and rtn["ppl_std"] >= 0
    with pytest.raises(ValueError, match="context"):
        evaluate(model, ids, [], window=5000, stride=5000, block=32, sink=0)
