"""Presets: names, lookup errors, what each family builds, and bits per element from the stored bytes."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from kvarn.presets import DEFAULT_PRESET, CachePolicy, Preset, get_preset, preset_names, register_preset
from kvarn.quant.affine import AffineQuantizer

# written from docs/SPEC.md §3 and the ablation list, not read from kvarn.presets: (key rotation, value rotation, VarN)
FAMILIES = {
    "kvarn": ("hadamard", "hadamard", True),
    "kvarn-auto": ("auto", "auto", True),
    "rtn": ("none", "none", False),
    "hadamard": ("hadamard", "hadamard", False),
    "varn": ("none", "none", True),
}
PAIRS = [(2, 2), (4, 2), (4, 4)]
FAMILY_PRESETS = [f"{f}-k{kb}v{vb}-g{g}" for f in FAMILIES for kb, vb in PAIRS for g in (128, 64)]


def test_every_family_preset_is_registered():
    names = preset_names()
    assert names == sorted(names)
    for name in [*FAMILY_PRESETS, "fp16"]:
        assert name in names
    assert get_preset(DEFAULT_PRESET).name == "kvarn-auto-k2v2-g128"  # never worse than RTN measured (README)
    assert get_preset("kvarn").name == "kvarn-k2v2-g128"  # the paper's preset keeps its name
    for family in FAMILIES:  # a bare family name means k2v2 at G = 128
        assert get_preset(family).name == f"{family}-k2v2-g128"
        assert family in preset_names(include_aliases=True)


def test_unknown_preset_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown preset 'kvarn-k3v3'") as err:
        get_preset("kvarn-k3v3")
    msg = str(err.value)
    for name in ("kvarn-k2v2-g128", "rtn-k4v4-g64", "fp16", "kvarn"):
        assert name in msg


def test_presets_are_frozen():
    p = get_preset("kvarn")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.sink = 0  # type: ignore[misc]
    assert get_preset(p) is p


@pytest.mark.parametrize("name", FAMILY_PRESETS)
def test_family_preset_builds_its_quantizers(name):
    family, rest = name.rsplit("-k", 1)
    kb, vb, g = int(rest[0]), int(rest[2]), int(rest.split("-g")[1])
    p = get_preset(name)
    assert (p.family, p.k_bits, p.v_bits, p.tile, p.sink, p.value_window) == (family, kb, vb, g, 128, "block")
    assert p.quantized and p.fp_layers == (0, 0) and not p.key_pre_rope
    kq, vq = p.quantizers(64)
    assert isinstance(kq, AffineQuantizer) and isinstance(vq, AffineQuantizer)
    rot_k, rot_v, use_varn = FAMILIES[family]
    assert (kq.config.bits, kq.config.axis, kq.config.rotate, kq.config.varn) == (kb, "channel", rot_k, use_varn)
    assert (vq.config.bits, vq.config.axis, vq.config.rotate, vq.config.varn) == (vb, "token", rot_v, use_varn)
    assert kq.tile == vq.tile == g and kq.config.scale_dtype == torch.float16
    assert kq.config.varn_iters == 8


def test_fp16_preset():
    p = get_preset("fp16")
    assert not p.quantized and p.bits_per_element(128) == 16.0
    with pytest.raises(ValueError, match="does not quantize"):
        p.quantizers(64)


# --- bits per element, measured from the bytes a tile really stores ----------------------------------------


def overhead(family: str, d: int, g: int) -> float:
    """Scale bits per element, mean of K and V. Per K tile: a_d, z_d (D each) and t_g (G) with VarN; per V
    tile a'_g, z'_g (G each) and c_d (D). fp16 throughout: VarN stores 2D + G and 2G + D halves, i.e.
    (3D + 3G) * 16 / 2 over D G elements = 24 (D + G) / (D G); without VarN 2D and 2G halves: 16 (D + G) / (D G).
    kvarn-auto stores the column scales (t_g, c_d) in 8 bits, (2D + 2G) * 16 + (G + D) * 8 over 2 D G elements
    = 20 (D + G) / (D G), and one uint8 rotation flag per key tile and per value tile: 8 / (D G)."""
    if family in ("rtn", "hadamard"):
        return 16 * (d + g) / (d * g)
    if family == "kvarn-auto":
        return 20 * (d + g) / (d * g) + 8 / (d * g)
    return 24 * (d + g) / (d * g)


@pytest.mark.parametrize("d", [128, 64, 96])
@pytest.mark.parametrize("name", FAMILY_PRESETS)
def test_bits_per_element_formula(name, d):
    p = get_preset(name)
    want = (p.k_bits + p.v_bits) / 2 + overhead(p.family, d, p.tile)
    assert math.isclose(p.bits_per_element(d), want, rel_tol=1e-12)


def test_bits_per_element_headline_values():
    # docs/SPEC.md §3: k2v2 2.375, k4v2 3.375, k4v4 4.375 at D = G = 128; +0.1875 at D = 64 or G = 64
    for (kb, vb), want in zip(PAIRS, (2.375, 3.375, 4.375)):
        assert get_preset(f"kvarn-k{kb}v{vb}-g128").bits_per_element(128) == want
        assert get_preset(f"kvarn-k{kb}v{vb}-g128").bits_per_element(64) == want + 0.1875
        assert get_preset(f"kvarn-k{kb}v{vb}-g64").bits_per_element(128) == want + 0.1875
        assert get_preset(f"rtn-k{kb}v{vb}-g128").bits_per_element(128) == want - 0.125  # 16 * 256 / 128^2


def test_fp8_presets_if_registered():
    # the paper's accounting: e4m3 a and t, fp16 z -> (b_K + b_V) / 2 + 16 (D + G) / (D G); 2.25 for k2v2
    names = [n for n in preset_names() if n.endswith("-fp8")]
    if not names:
        pytest.skip("no fp8 presets registered")
    for name in names:
        p = get_preset(name)
        kq, vq = p.quantizers(128)
        assert kq.config.scale_dtype == vq.config.scale_dtype == torch.float8_e4m3fn
        assert p.bits_per_element(128) == (p.k_bits + p.v_bits) / 2 + 0.25
    assert get_preset("kvarn-k2v2-g128-fp8").bits_per_element(128) == 2.25


def test_fp_layers_average_in_at_16_bits():
    p = get_preset("kvarn").replace(fp_layers=(2, 1))
    b = get_preset("kvarn").bits_per_element(128)
    assert p.bits_per_element(128) == b  # without num_layers: the quantized region only
    assert math.isclose(p.bits_per_element(128, num_layers=10), (7 * b + 3 * 16) / 10, rel_tol=1e-12)
    assert p.bits_per_element(128, num_layers=2) == 16.0


def test_every_registered_preset_is_consistent():
    # baselines registered by other modules too: quantizer tiles divide the flush unit, and the measured
    # bits per element are positive and below 16 for anything that quantizes
    for name in preset_names():
        p = get_preset(name)
        assert isinstance(p, Preset) and p.name == name
        if not p.quantized:
            continue
        for d in (64, 128):
            kq, vq = p.quantizers(d)
            assert p.tile % kq.tile == 0 and p.tile % vq.tile == 0, name
            assert 0 < p.bits_per_element(d) < 16, name


def test_bad_head_dim_is_a_value_error():
    p = get_preset("kvarn-k2v2-g128")
    with pytest.raises(ValueError):
        p.bits_per_element(30)  # 2-bit value codes are packed 4 per byte along D


# --- the cache policy: frozen, versioned, strict to/from dict ------------------------------------------------


@pytest.mark.parametrize("policy", [CachePolicy(), CachePolicy(tile=128, sink=0, value_window="sliding"),
                                    CachePolicy(tile=1, sink=0, fp_layers=(2, 2)),
                                    CachePolicy(tile=128, sink=1, key_pre_rope=True)])
def test_cache_policy_round_trips_through_json(policy):
    d = json.loads(json.dumps(policy.to_dict()))
    assert d == {"tile": policy.tile, "sink": policy.sink, "value_window": policy.value_window,
                 "fp_layers": list(policy.fp_layers), "key_pre_rope": policy.key_pre_rope, "version": 1}
    back = CachePolicy.from_dict(d)
    assert back == policy and back.fp_layers == policy.fp_layers and isinstance(back.fp_layers, tuple)
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.sink = 0  # type: ignore[misc]


def test_cache_policy_from_dict_refuses_unknown_missing_and_bad_fields():
    d = CachePolicy().to_dict()
    with pytest.raises(ValueError, match="unknown field 'window'"):
        CachePolicy.from_dict({**d, "window": "block"})
    for name in d:
        with pytest.raises(ValueError, match=f"missing field '{name}'"):
            CachePolicy.from_dict({k: v for k, v in d.items() if k != name})
    with pytest.raises(ValueError, match="version 2 is not one this kvarn reads"):
        CachePolicy.from_dict({**d, "version": 2})
    with pytest.raises(ValueError, match="must be a mapping"):
        CachePolicy.from_dict([("tile", 128)])  # type: ignore[arg-type]
    for field, bad in (("tile", 0), ("sink", -1), ("tile", 1.5), ("sink", True), ("value_window", "ring"),
                       ("fp_layers", [1]), ("fp_layers", [1, -1]), ("key_pre_rope", 1)):
        with pytest.raises(ValueError, match=f"CachePolicy.{field}"):
            CachePolicy.from_dict({**d, field: bad})


def test_preset_reads_its_policy_through_and_replaces_into_it():
    p = get_preset("kivi")
    assert (p.tile, p.sink, p.value_window, p.fp_layers, p.key_pre_rope) == (128, 0, "sliding", (0, 0), False)
    assert p.policy == CachePolicy(tile=128, sink=0, value_window="sliding")
    q = p.replace(sink=4, name="kivi-sink4")
    assert q.policy == dataclasses.replace(p.policy, sink=4) and q.name == "kivi-sink4" and q.key is p.key
    assert get_preset("turboquant").fp_layers == (2, 2) and get_preset("kvquant").key_pre_rope


def test_preset_to_dict_records_the_method_and_the_policy():
    p = get_preset("kvarn-k4v2-g64")
    d = p.to_dict(128)
    assert json.loads(json.dumps(d)) == d  # JSON-plain
    kq, _ = p.quantizers(128)
    assert d["name"] == p.name and d["version"] == 1 and (d["k_bits"], d["v_bits"]) == (4, 2)
    assert d["key"] == json.loads(json.dumps(dict(kq.describe()), default=str)) and d["value"]["bits"] == 2
    assert CachePolicy.from_dict(d["policy"]) == p.policy
    assert p.differences(d, 128) == []
    tampered = {**d, "key": {**d["key"], "bits": 2}, "policy": {**d["policy"], "sink": 0}}
    assert p.differences(tampered, 128) == [("key.bits", 2, 4), ("policy.sink", 0, 128)]
    fp16 = get_preset("fp16").to_dict(64)
    assert fp16["key"] is None and fp16["value"] is None and fp16["policy"] == CachePolicy().to_dict()


# --- the registry: every name resolves, the baselines are listed, and nothing below imports it ---------------


def test_every_name_and_alias_resolves_and_the_baselines_are_listed():
    from kvarn.quant.baselines import PRESETS

    names = preset_names()
    for name in preset_names(include_aliases=True):
        p = get_preset(name)
        assert isinstance(p, Preset) and p.name in names
    for name, spec, aliases in PRESETS:
        assert name in names and spec()["name"] == name
        assert all(get_preset(a).name == name for a in aliases)
    families = {get_preset(n).family for n in names}
    assert {"kivi", "quarot", "kvquant", "polarquant", "turboquant", "kitty"} <= families


def test_register_preset_adds_a_user_preset(monkeypatch):
    import kvarn
    from kvarn.presets import registry

    for table in ("_REGISTRY", "_ALIASES"):  # the other tests see the built-in registry only
        monkeypatch.setattr(registry, table, dict(getattr(registry, table)))
    name = "test-user-rtn"
    register_preset(name, lambda: get_preset("rtn").replace(name=name, sink=0), aliases=("test-user",))
    assert kvarn.get_preset("test-user").name == name and name in kvarn.preset_names()
    assert get_preset(name).sink == 0


def test_the_low_floors_do_not_import_the_registry():
    code = ("import sys, kvarn.quant.baselines, kvarn.quant.cache_policy, kvarn.cache.store\n"
            "print(sorted(m for m in sys.modules if m == 'kvarn.presets' or m.startswith('kvarn.presets.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.stdout.strip() == "[]", out.stdout
