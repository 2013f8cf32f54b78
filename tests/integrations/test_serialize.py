"""Save and load a KVarNCache (kvarn.integrations.serialize): bit-exact round trip, resumed decoding gives the same
logits bit for bit, and files that are truncated, corrupted or made for something else are refused by name."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig

import kvarn
from kvarn.attention import enable
from kvarn.integrations.serialize import CacheFileError, load_cache, save_cache
from kvarn.integrations.transformers import KVarNCache, KVarNLayer
from kvarn.presets import CachePolicy, get_preset
from tests.helpers import make_tiny_model

PROMPT, MORE, SINK = 150, 12, 16


def assert_same_store(a, b) -> None:
    for sa, sb in ((a.keys, b.keys), (a.values, b.values)):
        assert sa.length == sb.length and sa.n_tiles == sb.n_tiles and sa.dtype == sb.dtype
        for x, y in ((sa.sink, sb.sink), (sa.tail, sb.tail), (sa.tail_pad, sb.tail_pad),
                     (sa.exact_values, sb.exact_values), (sa.exact_index, sb.exact_index)):
            assert (x is None) == (y is None) and (x is None or (x.dtype == y.dtype and torch.equal(
                x.nan_to_num(), y.nan_to_num()) and torch.equal(x.isnan(), y.isnan()))), "region differs"
        assert sa.packed.tensors().keys() == sb.packed.tensors().keys()
        for k in sa.packed.names():
            assert torch.equal(sa.packed.tensors()[k], sb.packed.tensors()[k]), k
        assert sa.stats == sb.stats and sa.exact_dtype == sb.exact_dtype
    if a.queries is not None:
        assert torch.equal(a.queries.sum, b.queries.sum) and a.queries.count == b.queries.count


def assert_same_cache(a: KVarNCache, b: KVarNCache) -> None:
    for la, lb in zip(a.layers, b.layers):
        assert type(la) is type(lb)
        if isinstance(la, KVarNLayer):
            assert_same_store(la.store, lb.store)
            assert (la.positions is None) == (lb.positions is None)
            assert la.positions is None or torch.equal(la.positions, lb.positions)
        elif la.is_initialized:
            assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)
            assert la.cumulative_length == lb.cumulative_length
    assert a.get_seq_length() == b.get_seq_length() and a.nbytes().content == b.nbytes().content  # loaded: no spare


@pytest.mark.parametrize("family,preset,attn", [
    ("llama", "kvarn-auto-k2v2-g64", "kvarn"),  # query statistics of the rotation policy, packed reads
    ("llama", "kivi-k2v2-g32", "sdpa"),  # sliding value window, reference reads
    ("llama", "kvquant-k2v2-1pct", "sdpa"),  # keys before RoPE: positions
    ("gemma2", "kvarn-k2v2-g64", "kvarn"),  # sliding-window layers
])
def test_resumed_decoding_gives_identical_logits(family, preset, attn, tmp_path, seed):
    model = make_tiny_model(family, layers=2, hidden=64, head_dim=64, seed=seed % 1000)
    if attn == "kvarn":
        enable(model)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 256, (2, PROMPT + MORE), generator=g)
    cache = KVarNCache(model.config, preset, sink=SINK)
    with torch.no_grad():
        model(ids[:, :PROMPT], cache=cache)
        # a tile kept exact, so the file carries one
        layer = next(la for la in cache.layers if isinstance(la, KVarNLayer))
        assert layer.store.keys.n_tiles >= 1
        path = tmp_path / "prefix.safetensors"
        save_cache(cache, path)
        loaded = load_cache(path, model.config)
        assert_same_cache(cache, loaded)
        for t in range(PROMPT, PROMPT + MORE):
            a = model(ids[:, t:t + 1], cache=cache).logits
            b = model(ids[:, t:t + 1], cache=loaded).logits
            assert torch.equal(a, b), t
    assert_same_cache(cache, loaded)


CONFIG = LlamaConfig(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, hidden_size=128, head_dim=32)


def filled_cache(preset: str = "kvarn-k2v2-g64", dtype=torch.float16, config=CONFIG) -> KVarNCache:
    """Exact tiles (NaN), a pad in the tail, a tail, a float16 sink: every kind of region."""
    cache = KVarNCache(config, preset, sink=8)
    g = torch.Generator().manual_seed(0)
    for i in range(config.num_hidden_layers):
        k = torch.randn(2, 2, 8 + 64 * 3 + 11, 32, generator=g).to(dtype)
        v = torch.randn(2, 2, 8 + 64 * 3 + 11, 32, generator=g).to(dtype)
        k[1, 0, 8 + 64 + 5, 3] = float("nan")
        layer = cache.layers[i]
        layer.store.append(k[:, :, :-3], v[:, :, :-3])
        pad = torch.zeros(2, 3, dtype=torch.bool)
        pad[0, 0] = True
        layer.store.append(k[:, :, -3:], v[:, :, -3:], pad=pad)
        layer.lazy_initialization(k, v)
    return cache


def test_round_trip_every_region_bit_exact(tmp_path):
    cache = filled_cache()
    st = cache.layers[0].store
    assert len(st.keys.exact_index) == 1 and st.keys.tail_pad is not None and st.keys.sink.dtype == torch.float16
    save_cache(cache, tmp_path / "c.safetensors")
    loaded = load_cache(tmp_path / "c.safetensors", CONFIG)
    assert_same_cache(cache, loaded)
    for la, lb in zip(cache.layers, loaded.layers):
        ka, va = la.store.full()
        kb, vb = lb.store.full()
        assert torch.equal(ka.nan_to_num(), kb.nan_to_num()) and torch.equal(va, vb)


# -- refusals ----------------------------------------------------------------------------------------------------
@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "c.safetensors"
    save_cache(filled_cache(), path)
    return path


def test_truncated_and_corrupted_files_are_refused(saved, tmp_path):
    data = saved.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(CacheFileError, match="truncated"):
        load_cache(cut, CONFIG)
    flipped = bytearray(data)
    flipped[-100] ^= 0x01  # one bit of tensor data
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(flipped))
    with pytest.raises(CacheFileError, match="checksum mismatch"):
        load_cache(bad, CONFIG)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00" * 64)
    with pytest.raises(CacheFileError, match="not a complete safetensors file"):
        load_cache(junk, CONFIG)


def _with_header(saved, tmp_path, edit) -> str:
    """A copy of `saved` whose kvarn header went through `edit` (the tensors and checksum unchanged)."""
    from safetensors.torch import save_file

    with safe_open(str(saved), framework="pt") as f:
        header = json.loads(f.metadata()["kvarn"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    edit(header)
    out = tmp_path / "edited.safetensors"
    save_file(tensors, str(out), metadata={"kvarn": json.dumps(header)})
    return out


@pytest.mark.parametrize("field,value,message", [
    ("kvarn_version", "0.0.1", "kvarn version mismatch"),
    ("format_version", 99, "format version mismatch"),
])
def test_other_versions_are_refused(saved, tmp_path, field, value, message):
    path = _with_header(saved, tmp_path, lambda h: h.__setitem__(field, value))
    with pytest.raises(CacheFileError, match=message):
        load_cache(path, CONFIG)


def test_other_preset_or_model_is_refused(saved, monkeypatch):
    with pytest.raises(CacheFileError, match=r"preset mismatch.*'kvarn-k2v2-g64'.*'rtn-k2v2-g64'"):
        load_cache(saved, CONFIG, preset="rtn-k2v2-g64")
    for change, message in ((dict(num_hidden_layers=4), "number of layers mismatch: the file has 3"),
                            (dict(num_key_value_heads=4), "number of KV heads mismatch"),
                            (dict(head_dim=64, hidden_size=256), "head_dim mismatch")):
        other = LlamaConfig(**{**dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                      hidden_size=128, head_dim=32), **change})
        with pytest.raises(CacheFileError, match=message):
            load_cache(saved, other)
    other = make_tiny_model("qwen2", layers=3, heads=4, kv_heads=2, head_dim=32, hidden=128).config
    with pytest.raises(CacheFileError, match="model type mismatch: the file has 'llama'"):
        load_cache(saved, other)
    was = kvarn.__version__
    monkeypatch.setattr(kvarn, "__version__", "9.9.9")
    with pytest.raises(CacheFileError, match=f"kvarn version mismatch: the file has '{was}', this load has '9.9.9'"):
        load_cache(saved, CONFIG)


def test_the_header_records_the_full_method_and_policy(saved):
    with safe_open(str(saved), framework="pt") as f:
        header = json.loads(f.metadata()["kvarn"])
    p = get_preset("kvarn-k2v2-g64")
    assert header["format_version"] == 2 and header["preset"] == p.to_dict(32)
    kq, _ = p.quantizers(32)
    assert header["preset"]["key"]["bits"] == kq.config.bits and header["preset"]["value"]["axis"] == "token"
    assert CachePolicy.from_dict(header["preset"]["policy"]) == p.policy


@pytest.mark.parametrize("part,field,value,message", [
    ("key", "bits", 4, "preset 'kvarn-k2v2-g64' key.bits mismatch: the file has 4, this load has 2"),
    ("value", "rotate", "none", "value.rotate mismatch: the file has 'none', this load has 'hadamard'"),
    ("policy", "sink", 0, "policy.sink mismatch: the file has 0, this load has 128"),
    ("policy", "value_window", "sliding", "value_window mismatch: the file has 'sliding', this load has 'block'"),
    ("params", "tile", 128, "params.tile mismatch: the file has 128, this load has 64"),
    (None, "version", 2, "preset 'kvarn-k2v2-g64' version mismatch: the file has 2, this load has 1"),
])
def test_a_tampered_preset_record_is_refused_by_field(saved, tmp_path, part, field, value, message):
    def edit(h):
        (h["preset"] if part is None else h["preset"][part])[field] = value

    with pytest.raises(CacheFileError, match=re.escape(message)):
        load_cache(_with_header(saved, tmp_path, edit), CONFIG)


def test_every_differing_field_is_named(saved, tmp_path):
    def two(h):
        h["preset"]["key"]["bits"], h["preset"]["policy"]["tile"] = 4, 32

    with pytest.raises(CacheFileError, match=r"key\.bits mismatch.*\(also differ: policy\.tile\)"):
        load_cache(_with_header(saved, tmp_path, two), CONFIG)


def test_an_unregistered_preset_is_refused_with_its_saved_config(tmp_path):
    custom = get_preset("rtn-k2v2-g64").replace(name="test-unregistered", sink=8)
    cache = KVarNCache(CONFIG, custom)
    path = tmp_path / "custom.safetensors"
    save_cache(cache, path)
    with pytest.raises(CacheFileError, match=r"preset 'test-unregistered', which is not registered here \(key "
                                             r"\{'name': 'rtn2-channel'.*policy \{'tile': 64, 'sink': 8"):
        load_cache(path, CONFIG)
    assert load_cache(path, CONFIG, preset=custom).preset is custom  # passed explicitly, it loads
    with pytest.raises(CacheFileError, match=r"policy\.sink mismatch: the file has 8, this load has 0"):
        load_cache(path, CONFIG, preset=custom.replace(sink=0))


def test_a_format_1_file_is_refused_saying_why(saved, tmp_path):
    def old(h):  # what format 1 wrote: the name and the quantizers' descriptions, the policy fields loose
        h["format_version"] = 1
        h["preset"] = {"name": h["preset"]["name"], "quantizers": [h["preset"]["key"], h["preset"]["value"]],
                       **{k: v for k, v in h["preset"]["policy"].items() if k != "version"}}

    with pytest.raises(CacheFileError, match=r"format version mismatch: the file has 1, this load has 2 \(format 1 "
                                             r"recorded the preset's name and quantizers only.*save the cache again"):
        load_cache(_with_header(saved, tmp_path, old), CONFIG)
