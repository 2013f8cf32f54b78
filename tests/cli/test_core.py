"""`kvarn presets` and `kvarn quantize-demo` through kvarn.cli.main, JSON parsed and checked."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvarn.cli import main
from kvarn.commands.quantize_demo import select_presets
from kvarn.presets import get_preset, preset_names
from kvarn.synthetic import SyntheticConfig, as_tiles, synthetic_kv


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # rich wraps to the terminal width; keep names on one line
    monkeypatch.setenv("TQDM_DISABLE", "1")


# --- kvarn presets ---------------------------------------------------------------------------------------


def test_presets_json_lists_every_preset_with_measured_bits(capsys):
    assert main(["presets", "--head-dim", "64", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == preset_names()
    for r in rows:
        assert {"name", "k_bits", "v_bits", "tile", "sink", "bits_per_element"} <= set(r)
        p = get_preset(r["name"])
        assert (r["k_bits"], r["v_bits"], r["tile"], r["sink"]) == (p.k_bits, p.v_bits, p.tile, p.sink)
        assert 0 < r["bits_per_element"] <= 16
    by_name = {r["name"]: r for r in rows}
    # docs/SPEC.md §3: 2.375 at D = G = 128, +0.1875 at D = 64; RTN without column scales: 2.25 + 0.125
    assert by_name["kvarn-k2v2-g128"]["bits_per_element"] == 2.5625
    assert by_name["kvarn-k4v4-g64"]["bits_per_element"] == 4.375 + 2 * 0.1875
    assert by_name["rtn-k4v2-g128"]["bits_per_element"] == 3.25 + 0.125
    assert by_name["fp16"]["bits_per_element"] == 16.0
    assert "kvarn" in by_name["kvarn-k2v2-g128"]["aliases"]


def test_presets_table_and_json_file(tmp_path, capsys):
    assert main(["presets", "--head-dim", "96"]) == 0
    out = capsys.readouterr().out
    for name in preset_names():
        assert name in out
    assert "head_dim 96" in out
    path = tmp_path / "presets.json"
    assert main(["presets", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())
    assert len(rows) == len(preset_names())


@pytest.mark.parametrize("bad", ["0", "-4"])
def test_presets_bad_head_dim_is_a_clean_error(bad, capsys):
    assert main(["presets", "--head-dim", bad]) == 2
    err = capsys.readouterr().err
    assert "kvarn presets: error:" in err and "head-dim" in err and "Traceback" not in err


def test_presets_head_dim_some_presets_cannot_store(capsys):
    # 2-bit value codes are packed 4 per byte along D: D = 30 cannot be stored by them; the row says why
    assert main(["presets", "--head-dim", "30", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["kvarn-k2v2-g128"]["bits_per_element"] is None
    assert "multiple of 4" in rows["kvarn-k2v2-g128"]["error"]


# --- kvarn quantize-demo ---------------------------------------------------------------------------------


def recompute(name: str, d: int, tiles: int, heads: int, seed: int) -> dict[str, dict[str, float]]:
    """The demo's numbers for one preset, computed here with plain float64 arithmetic."""
    kv = synthetic_kv(tiles * 128, d, heads=heads, seed=seed)
    kq, vq = get_preset(name).quantizers(d)
    out = {}
    for kind, x, q in (("keys", kv.keys, kq), ("values", kv.values, vq)):
        t = as_tiles(x, q.tile)
        xh = q.decode(q.encode(t)).double()
        t = t.double()
        n, nh = t.norm(dim=-1), xh.norm(dim=-1)
        out[kind] = {"rel_mse": ((t - xh) ** 2).sum().item() / (t**2).sum().item(),
                     "norm_err_mean": ((nh - n).abs() / n).mean().item(),
                     "norm_err_max": ((nh - n).abs() / n).max().item()}
    return out


def test_quantize_demo_json(tmp_path, capsys, seed):
    path = tmp_path / "demo.json"
    args = ["quantize-demo", "--head-dim", "64", "--tiles", "2", "--heads", "1", "--seed", str(seed),
            "--presets", "kvarn,rtn,kvarn-k4v2-g64,fp16", "--json", str(path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    for name in ("kvarn-k2v2-g128", "rtn-k2v2-g128", "kvarn-k4v2-g64", "fp16", "K norm err worst"):
        assert name in out
    doc = json.loads(path.read_text())
    assert doc["provenance"]["config"]["seed"] == seed and doc["provenance"]["config"]["head_dim"] == 64
    rows = {r["name"]: r for r in doc["results"]}
    assert list(rows) == ["kvarn-k2v2-g128", "rtn-k2v2-g128", "kvarn-k4v2-g64", "fp16"]
    for name in ("kvarn-k2v2-g128", "rtn-k2v2-g128", "kvarn-k4v2-g64"):
        r = rows[name]
        assert r["bits_per_element"] == get_preset(name).bits_per_element(64)
        want = recompute(name, 64, 2, 1, seed)
        for kind in ("keys", "values"):
            for stat in ("rel_mse", "norm_err_mean", "norm_err_max"):
                assert math.isclose(r[kind][stat], want[kind][stat], rel_tol=1e-6), (name, kind, stat)
    # fp16 storage: 16 bits, errors of half-precision rounding only (relative 2^-11 per element)
    assert rows["fp16"]["bits_per_element"] == 16.0
    assert rows["fp16"]["keys"]["rel_mse"] < 2.0**-20 and rows["fp16"]["keys"]["norm_err_max"] < 2.0**-10
    # the synthetic data has tokens of extreme norm: KVarN's worst key magnitude error is far below RTN's
    assert rows["kvarn-k2v2-g128"]["keys"]["norm_err_max"] < rows["rtn-k2v2-g128"]["keys"]["norm_err_max"]
    assert rows["kvarn-k4v2-g64"]["keys"]["rel_mse"] < rows["kvarn-k2v2-g128"]["keys"]["rel_mse"]


def test_quantize_demo_preset_selection():
    family = {p.name for p in select_presets(None, False)}
    assert "fp16" in family and "kvarn-k2v2-g128" in family and "varn-k4v4-g64" in family
    assert all(get_preset(n).family in ("kvarn", "kvarn-auto", "rtn", "hadamard", "varn", "fp16") for n in family)
    assert [p.name for p in select_presets(None, True)] == preset_names()  # --all: baselines too
    assert [p.name for p in select_presets("rtn, kvarn,rtn", False)] == ["rtn-k2v2-g128", "kvarn-k2v2-g128"]


@pytest.mark.parametrize("args,msg", [
    (["--head-dim", "7"], "even integer"),
    (["--tiles", "0"], "--tiles and --heads"),
    (["--presets", "kvarn,nope"], "unknown preset 'nope'"),
    (["--presets", ","], "--presets is empty"),
])
def test_quantize_demo_bad_input_is_a_clean_error(args, msg, capsys):
    assert main(["quantize-demo", *args]) == 2
    err = capsys.readouterr().err
    assert "kvarn quantize-demo: error:" in err and msg in err and "Traceback" not in err


# --- the synthetic data ----------------------------------------------------------------------------------


def test_synthetic_kv_structure(seed):
    cfg = SyntheticConfig()
    a = synthetic_kv(1024, 64, heads=2, seed=seed)
    b = synthetic_kv(1024, 64, heads=2, seed=seed)
    assert all(torch.equal(x, y) for x, y in zip(a, b))  # a seed names a dataset
    assert a.keys.shape == a.values.shape == a.keys_pre_rope.shape == (2, 1024, 64)
    k = a.keys_pre_rope.double()
    # outlier channels (spread 4x the median channel's): the top channels' std stands out
    std = k[:, 1:].std(dim=1)
    top = std.topk(cfg.outlier_channels, dim=-1)
    assert (top.values.mean(-1) / std.median(-1).values > 2.5).all()
    # tokens of extreme norm exist, large (3x) and small (0.2x), about 1% each
    n = k[:, 1:].norm(dim=-1)
    med = n.median(dim=-1, keepdim=True).values
    assert ((n / med).amax(-1) > 2).all() and ((n / med).amin(-1) < 0.4).all()
    # token 0 (sink-like): its key lies mostly along the outlier channels, its value is near zero
    idx = top.indices
    share0 = (k[:, 0].gather(-1, idx) ** 2).sum(-1) / (k[:, 0] ** 2).sum(-1)
    shares = (k[:, 1:].gather(-1, idx.unsqueeze(1).expand(-1, 1023, -1)) ** 2).sum(-1) / (k[:, 1:] ** 2).sum(-1)
    assert (share0 > 0.6).all() and (share0 > shares.median(-1).values).all()
    nv = a.values.double().norm(dim=-1)
    assert (nv[:, 0] < 0.3 * nv[:, 1:].median(-1).values).all()
    # heavy tails: excess kurtosis of the values well above a Gaussian's 0
    v = a.values.double()
    z = (v - v.mean(dim=1, keepdim=True)) / v.std(dim=1, keepdim=True)
    assert (z**4).mean().item() - 3 > 1
    # RoPE is a rotation of each pair: per-token norms unchanged
    assert torch.allclose(a.keys.norm(dim=-1), a.keys_pre_rope.norm(dim=-1), rtol=1e-5)
    with pytest.raises(ValueError, match="even head_dim"):
        synthetic_kv(16, 7)
