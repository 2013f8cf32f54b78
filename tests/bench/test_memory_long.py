"""Long run (issue 9): bytes really held stay on nbytes()'s formula (within 5%) at every step of a long stream of
decode steps and chunks. The short version runs by default; the full one (32k tokens, the embedded model's 30
layers) is `kvarn bench memory-long` (and the slow test below)."""

from __future__ import annotations

import pytest
import torch

from kvarn.bench.memory import largest_deviation, long_run


def check(rows: list[dict]) -> None:
    for r in rows:
        assert r["nbytes_content"] <= r["held"] <= r["nbytes_total"] * 1.0001, r
        assert r["held_vs_content"] <= 1.05, r
        assert r["exact_tiles"] == 0, r


def test_long_run_short():
    # the embedded model's heads and head_dim, 4 of its 30 layers, rtn (same stored layout as kvarn, cheaper encode)
    rows = long_run("rtn-k2v2-g128", tokens=4096, every=512, layers=4, kv_heads=3, head_dim=64,
                    dtype=torch.float16, progress=False)
    assert [r["tokens"] for r in rows] == list(range(512, 4097, 512))
    check(rows)
    assert largest_deviation(rows)["vs_content"] <= 0.05


@pytest.mark.slow
def test_long_run_32k_embedded_shapes():
    rows = long_run("kvarn-k2v2-g128", tokens=32768, every=1024, layers=30, kv_heads=3, head_dim=64,
                    dtype=torch.float16, progress=False)
    check(rows)
    assert rows[-1]["held_vs_fp16"] <= 0.2
