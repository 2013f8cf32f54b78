"""The transformers cache (kvarn.integrations.transformers): equivalence with DynamicCache where nothing is quantized,
packed vs reference reads inside real forwards, byte accounting, quantize-once, generation modes, RoPE hook, refusals.

Tolerances: where both paths compute the same float32 attention in a different order (packed vs reference, RoPE
undone and redone), logits are compared with |diff| <= 1e-4 * (1 + max|logits|): float32 rounding (~1e-7
relative per op) amplified through a 2-layer random model stays two orders of magnitude below that.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from transformers import AutoConfig, DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer

import kvarn.attention
from kvarn.cache.rope import Rope
from kvarn.cache.store import Bytes
from kvarn.integrations.transformers import KVarNCache, KVarNLayer
from kvarn.presets import get_preset
from tests.helpers import TINY_FAMILIES, close, forward_steps, make_tiny_model, packed_calls

FAMILIES = list(TINY_FAMILIES)
# Stores built here without queries (and Gemma2's "eager" attention, which observes none) choose the kvarn-auto
# key rotation by unweighted squared error, as kvarn.quant.policy documents; its warning says so on every tile.
pytestmark = pytest.mark.filterwarnings("ignore:kvarn. key tiles stored before any query:UserWarning")


def tiny(family: str = "llama", **kw):
    if family == "gemma3":  # one sliding and one full-attention layer
        kw.setdefault("layer_types", ["sliding_attention", "full_attention"])
    return make_tiny_model(family, **kw)


def prompt(n: int, batch: int = 1, gen: torch.Generator | None = None) -> torch.Tensor:
    return torch.randint(3, 256, (batch, n), generator=gen)


def greedy(model, ids, cache, n=12, mask=None, **kw):
    mask = torch.ones_like(ids) if mask is None else mask
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=0, **{"cache": cache, **kw})


class attn:
    """Context: run `model` with attn_implementation `impl`, restore afterwards."""

    def __init__(self, model, impl: str) -> None:
        self.model, self.impl, self.before = model, impl, model.config._attn_implementation

    def __enter__(self):
        kvarn.attention.enable(self.model, self.impl)
        return self.model

    def __exit__(self, *exc) -> None:
        kvarn.attention.enable(self.model, self.before)


def walk_bytes(cache: KVarNCache) -> int:
    """Bytes of every tensor the cache layers actually hold, found by walking them."""
    total = 0
    for layer in cache.layers:
        if isinstance(layer, KVarNLayer):
            q = layer.store.queries
            tensors = [layer.positions, None if q is None else q.sum]
            tensors += [t for kept in layer._undo or () if kept is not None for t in (kept.x, kept.pad)]
            for s in (layer.store.keys, layer.store.values):  # whole buffers: spare capacity is held too
                tensors += [s._sink.data, s.tail, s.tail_pad, s.exact_values,
                            *(b.data for b in s._packed.fields.values())]
                if s.exact_values is not None:
                    tensors.append(s.exact_index)
        else:
            tensors = [layer.keys, layer.values]
        total += sum(t.numel() * t.element_size() for t in tensors if t is not None)
    return total


# -- nothing quantized: exactly DynamicCache ---------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_unquantized_matches_dynamic_cache(family, seed):
    """fp16 preset, and a quantizing preset whose sink is longer than the sequence: the same greedy tokens."""
    model = tiny(family)
    ids = prompt(40, gen=torch.Generator().manual_seed(seed))
    ref = greedy(model, ids, DynamicCache(config=model.config))
    assert torch.equal(greedy(model, ids, KVarNCache(model.config, "fp16")), ref)
    assert torch.equal(greedy(model, ids, KVarNCache(model.config, "kvarn-k2v2-g64", sink=4096)), ref)
    with attn(model, "kvarn"):  # the kvarn implementation with nothing stored quantized: same tokens
        assert torch.equal(greedy(model, ids, KVarNCache(model.config, "kvarn-k2v2-g64", sink=4096)), ref)


@pytest.mark.model
def test_real_model_matches_dynamic_cache(real_model):
    model, tok = real_model
    msgs = [{"role": "user", "content": "Name three primary colors."}]
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = enc["input_ids"]
    ref = greedy(model, ids, DynamicCache(config=model.config), n=10)
    assert torch.equal(greedy(model, ids, KVarNCache(model.config, "fp16"), n=10), ref)
    cache = KVarNCache(model.config, "kvarn-k2v2-g128", sink=4096)
    assert torch.equal(greedy(model, ids, cache, n=10), ref)
    assert cache.nbytes().packed == 0 and cache.get_seq_length() == ref.shape[1] - 1


# -- packed reads inside the models ------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_matches_reference_in_model(family, seed):
    """Prefill over several tiles, a 5-token chunk, then decode steps: logits of packed reads, taken by default under
    the model's own implementation ("sdpa"; Gemma2 runs "eager", which keeps the reference path) and under "kvarn",
    equal those of the model's own attention on dequantized K/V (the reference path, `attention="reference"`)."""
    model = tiny(family)
    gen = torch.Generator().manual_seed(seed)
    ids = prompt(150 + 5 + 3, gen=gen)
    chunks = [150, 5, 1, 1, 1]
    # kvarn-auto chooses key rotations from the queries the attention observes; the model's own "eager" (Gemma2)
    # observes none, so its reference run would choose differently from the packed run: compare on kvarn there
    own = model.config._attn_implementation
    preset = "kvarn-k2v2-g64" if own == "eager" else "kvarn-auto-k2v2-g64"
    ref = forward_steps(model, ids, KVarNCache(model.config, preset, sink=8, attention="reference"), chunks)
    for impl in dict.fromkeys((own, "kvarn")):
        with attn(model, impl):
            cache = KVarNCache(model.config, preset, sink=8)
            got, calls = packed_calls(lambda: forward_steps(model, ids, cache, chunks))  # noqa: B023
        full = [i for i, layer in enumerate(cache.layers) if isinstance(layer, KVarNLayer)]
        assert full and all(cache.layers[i].store.keys.n_tiles == 2 for i in full)
        assert calls == (0 if impl == "eager" else 4 * len(full)), impl  # every step after the prefill
        # float32 end to end; the packed path sums logits and outputs in another order than SDPA/eager over the
        # dequantized K/V, and through several layers (Gemma2's softcap included) that reaches a few 1e-4 relative
        diff = f"max diff {(got - ref).abs().max()}, max |ref| {ref.abs().max()}"
        assert close(got, ref, rel=1e-3), f"packed ({impl}) vs reference: {diff}"
    with attn(model, "kvarn"):  # attention="reference" keeps dequantized reads under "kvarn" too
        forced = KVarNCache(model.config, preset, sink=8, attention="reference")
        got, calls = packed_calls(lambda: forward_steps(model, ids, forced, chunks))
    assert calls == 0 and close(got, ref)
    # and the reference path itself differs from an unquantized run (the test would see a no-op cache)
    exact = forward_steps(model, ids, DynamicCache(config=model.config), chunks)
    assert not close(ref[:, 150:], exact[:, 150:], 1e-6), f"quantized == exact: {(ref - exact).abs().max()}"


def test_fast_by_default_one_warning_otherwise(seed):
    """A KVarNCache passed as is: packed reads under "sdpa" with no warning and no extra call; under "eager" (the
    model's own function) the reference path with exactly one warning naming it; attention="reference": the
    reference path, silently; the fp16 preset (nothing quantized) never warns."""
    model = tiny("llama")
    ids = prompt(90, gen=torch.Generator().manual_seed(seed))
    assert model.config._attn_implementation == "sdpa"
    cases = [("sdpa", "kvarn-k2v2-g64", "auto", True, 0), ("eager", "kvarn-k2v2-g64", "auto", False, 1),
             ("eager", "kvarn-k2v2-g64", "reference", False, 0), ("sdpa", "kvarn-k2v2-g64", "reference", False, 0),
             ("eager", "fp16", "auto", False, 0)]
    for impl, preset, path, packed, n_warn in cases:
        with attn(model, impl), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cache = KVarNCache(model.config, preset, sink=8, attention=path)
            _, calls = packed_calls(lambda: greedy(model, ids, cache, n=4))  # noqa: B023
        mine = [str(w.message) for w in caught if "KVarNCache reads through the reference path" in str(w.message)]
        assert (calls > 0) == packed and len(mine) == n_warn, (impl, preset, path, calls, mine)
        if n_warn:
            assert "'eager' is the model's own function" in mine[0]
    assert kvarn.attention.packed_reads("no-such-implementation") is not None
    assert kvarn.attention.packed_reads("flash_attention_2") is not None  # 2-D masks: not read by the packed path
    assert kvarn.attention.packed_reads("sdpa") is None and kvarn.attention.packed_reads("kvarn") is None


class KeyCopyingInterface:
    """Stands for `ALL_ATTENTION_FUNCTIONS` in a modeling file: the registered function, called with `change(key)`
    instead of the key `cache.update` returned, as a model that copies or casts the key on the way would."""

    def __init__(self, real, change) -> None:
        self.real, self.change = real, change

    def get_interface(self, name, default):
        fn = self.real.get_interface(name, default)
        return lambda module, query, key, *args, **kwargs: fn(module, query, self.change(key), *args, **kwargs)


@pytest.mark.parametrize("change", ["clone", "cast"])
def test_key_copied_by_the_model_raises(change, seed, monkeypatch):
    """Issue 9, finding 3: a model that copies or casts the key between cache.update and attention loses the packed
    past; attention over the fresh tokens alone would ignore the cache, so kvarn raises, naming the layer and the
    cause (on main this ran silently). attention="reference" is the way out and works."""
    from transformers.models.llama import modeling_llama

    model = tiny("llama")
    ids = prompt(80, gen=torch.Generator().manual_seed(seed))
    fn = {"clone": torch.Tensor.clone, "cast": lambda k: k.double().to(k.dtype)}[change]
    monkeypatch.setattr(modeling_llama, "ALL_ATTENTION_FUNCTIONS",
                        KeyCopyingInterface(modeling_llama.ALL_ATTENTION_FUNCTIONS, fn))
    for impl in ("sdpa", "kvarn"):
        with attn(model, impl), torch.no_grad():
            cache = KVarNCache(model.config, "kvarn-k2v2-g64", sink=8)
            model(ids[:, :70], cache=cache)  # empty cache: nothing to lose
            with pytest.raises(kvarn.attention.HandoffError, match=r"layer 0 holds 70 cached tokens.*copied or cast"):
                model(ids[:, 70:71], cache=cache)
    ref = forward_steps(model, ids, KVarNCache(model.config, "kvarn-k2v2-g64", sink=8, attention="reference"),
                        [70, 1])
    monkeypatch.undo()
    assert close(ref, forward_steps(model, ids, KVarNCache(model.config, "kvarn-k2v2-g64", sink=8), [70, 1]))


# -- bytes -------------------------------------------------------------------------------------------------------
def test_bytes_equal_tensors_held(seed):
    gen = torch.Generator().manual_seed(seed)
    model = tiny("gemma3", layers=3, layer_types=["sliding_attention", "full_attention", "full_attention"],
                 sliding_window=16)
    pre_rope = get_preset("kvarn-k2v2-g64").replace(name="test-pre-rope", key_pre_rope=True)
    for preset in ("kvarn-k4v2-g64", "kivi-k2v2-g32", pre_rope, "fp16"):
        cache = KVarNCache(model.config, preset, sink=8)
        greedy(model, prompt(150, gen=gen), cache, n=5)
        b = cache.nbytes()
        assert b.total == walk_bytes(cache) > 0
        assert b == sum(cache.nbytes_by_layer()[1:], cache.nbytes_by_layer()[0])
        assert cache.fp16_nbytes() == 2 * b.elements
        assert isinstance(cache.layers[0], DynamicSlidingWindowLayer) and cache.layers[0].keys.shape[2] == 15
        if preset is pre_rope:
            assert b.positions == 2 * 4 * 154  # two quantized layers x int32 x tokens
        if preset == "fp16":
            assert b.packed == 0 and b.sink > 0


def test_k2v2_at_4k_holds_a_fifth_of_fp16(seed):
    """The embedded model's shapes (30 layers x 3 KV heads x 64), 4096 random fp16 tokens: k2v2 <= 1/5 of fp16.
    A float32 model holds its 128-token sink in float32 (about 0.218 of fp16's bytes) unless the cache keeps the
    exact regions in fp16 (`exact_dtype`); that variant is checked on 3 layers (every layer holds the same bytes)."""
    from kvarn.models import resolve

    config = AutoConfig.from_pretrained(resolve("default"))
    gen = torch.Generator().manual_seed(seed)
    for dtype, exact_dtype, layers in ((torch.float16, None, 30), (torch.float32, torch.float16, 3)):
        cache = KVarNCache(config, "kvarn-k2v2-g128", exact_dtype=exact_dtype)
        assert len(cache.layers) == 30
        for i in range(layers):
            k, v = (torch.randn(1, 3, 4096, 64, generator=gen).to(dtype) for _ in range(2))
            cache.update(k, v, i)
        b = sum(cache.nbytes_by_layer()[:layers], Bytes())
        ratio = b.total / (2 * b.elements)
        print(f"k2v2 at 4k ({dtype}, exact {exact_dtype}): {b.total} bytes, {ratio:.4f} of fp16, "
              f"{b.bits_per_element:.3f} bits/element")
        assert b.total == walk_bytes(cache) and b == cache.nbytes()
        assert ratio <= 1 / 5


# -- quantize once, generation modes ----------------------------------------------------------------------------
def test_multi_turn_and_tiles_quantized_once(seed):
    """generate, then a new user turn on the same cache; tiles stored in turn 1 keep their bytes for good, and the
    fp16 preset follows DynamicCache through both turns."""
    gen = torch.Generator().manual_seed(seed)
    model = tiny("llama")
    p1 = prompt(100, gen=gen)
    turn2 = prompt(90, gen=gen)
    caches = {"dyn": DynamicCache(config=model.config), "fp16": KVarNCache(model.config, "fp16"),
              "q": KVarNCache(model.config, "kvarn-k2v2-g64", sink=8)}
    outs = {}
    for name, cache in caches.items():
        out1 = greedy(model, p1, cache, n=30)
        if name == "q":
            first = {k: v.clone() for k, v in cache.layers[1].store.keys.packed.items()}
            first_v = {k: v.clone() for k, v in cache.layers[1].store.values.packed.items()}
            assert cache.layers[1].store.keys.n_tiles == 1
        ids2 = torch.cat([out1, turn2], dim=1)
        outs[name] = greedy(model, ids2, cache, n=30)
        assert cache.get_seq_length() == outs[name].shape[1] - 1
    assert torch.equal(outs["fp16"], outs["dyn"])
    store = caches["q"].layers[1].store
    assert store.keys.n_tiles == 3
    for k, v in first.items():
        assert torch.equal(store.keys.packed.tensors()[k][:, :, :1], v), k
    for k, v in first_v.items():
        assert torch.equal(store.values.packed.tensors()[k][:, :, :1], v), k


def test_left_padding_batch(seed):
    """Batch 2, row 1 left-padded by 5. fp16 preset: same tokens as DynamicCache. Quantizing presets with no sink, so
    the pads lie inside row 1's first tile: the cache learns the pads from the mask and keeps them out of the tile's
    ranges, so the tile's stored fields (codes, scales, rotation choice) do not depend on the pad tokens at all (bit
    for bit, the pads' own K/V differ) nor do row 1's logits; packed reads ("sdpa", "kvarn") equal the reference
    path."""
    gen = torch.Generator().manual_seed(seed)
    model = tiny("qwen2")
    ids = prompt(150, batch=2, gen=gen)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    ids[1, :5] = 0
    ref = greedy(model, ids, DynamicCache(config=model.config), mask=mask)
    assert torch.equal(greedy(model, ids, KVarNCache(model.config, "fp16"), mask=mask), ref)
    full = torch.cat([ids, prompt(3, batch=2, gen=gen)], dim=1)
    fmask = torch.cat([mask, torch.ones(2, 3, dtype=mask.dtype)], dim=1)
    positions = (fmask.cumsum(-1) - 1).clamp_min(0)
    other = full.clone()
    other[1, :5] = 77  # different pad tokens
    for preset in ("kvarn-k2v2-g64", "kvarn-auto-k2v2-g64"):
        results, fields = {}, {}
        for impl, path in (("sdpa", "auto"), ("kvarn", "auto"), ("sdpa", "reference")):
            with attn(model, impl):
                for name, x in (("pad0", full), ("pad77", other)):
                    cache = KVarNCache(model.config, preset, sink=0, attention=path)
                    results[impl, path, name] = forward_steps(model, x, cache, [150, 1, 1, 1], fmask, positions)
                    stores = [s for layer in cache.layers for s in (layer.store.keys, layer.store.values)]
                    assert all(s.n_tiles == 2 and s.stats.pad_tokens == 5 for s in stores)
                    fields[impl, path, name] = [{k: v[1].clone() for k, v in s.packed.items()} for s in stores]
        for key in ((impl, path) for impl, path, name in results if name == "pad0"):
            for a, b in zip(fields[(*key, "pad0")], fields[(*key, "pad77")]):
                assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (preset, key)
            assert close(results[(*key, "pad77")][1, 5:], results[(*key, "pad0")][1, 5:])
            assert close(results[(*key, "pad0")][:, 5:], results["sdpa", "reference", "pad0"][:, 5:], 1e-3)


def test_sampling_beams_and_both_kwarg_names(seed):
    model = tiny("mistral")
    ids = prompt(70, gen=torch.Generator().manual_seed(seed))

    def sample(cache, name="cache"):
        torch.manual_seed(seed)
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=15,
                                  min_new_tokens=15, do_sample=True, top_k=50, pad_token_id=0, **{name: cache})

    ref = sample(DynamicCache(config=model.config))
    assert torch.equal(sample(KVarNCache(model.config, "fp16")), ref)
    assert torch.equal(sample(KVarNCache(model.config, "fp16"), "past_key_values"), ref)
    q1 = sample(KVarNCache(model.config, "kvarn-k2v2-g64", sink=4))
    q2 = sample(KVarNCache(model.config, "kvarn-k2v2-g64", sink=4), "past_key_values")
    assert torch.equal(q1, q2) and q1.shape == ref.shape
    beams = greedy(model, ids, DynamicCache(config=model.config), n=8, num_beams=2)
    assert torch.equal(greedy(model, ids, KVarNCache(model.config, "fp16"), n=8, num_beams=2), beams)


# -- crop (assisted decoding, prompt lookup) ------------------------------------------------------------------
def feed(cache: KVarNCache, k: torch.Tensor, v: torch.Tensor, chunks: list[int]) -> None:
    """cache.update of every layer with consecutive chunks of k, v [B, H, T, D]."""
    at = 0
    for n in chunks:
        for i in range(len(cache.layers)):
            cache.update(k[:, :, at:at + n], v[:, :, at:at + n], i)
        at += n


def store_state(cache: KVarNCache) -> list[torch.Tensor]:
    out = []
    for layer in cache.layers:
        layer.store.settle()  # kvarn-auto's key tiles wait for queries (none here)
        for s in (layer.store.keys, layer.store.values):
            out += [s.full(), torch.tensor([s.n_tiles, s.tail_start, s.length])]
            out += [s.packed.tensors()[k] for k in sorted(s.packed.names())]
    return out


@pytest.mark.parametrize("preset", ["kvarn-k2v2-g64", "kvarn-auto-k2v2-g64"])
def test_crop_is_exact_where_drafts_reach(preset, seed):
    """Sink 8, G = 64. After a prefill of 130 tokens (tail 72..129) a draft step of 8 tokens completes tile [72, 136);
    crops of 5 (into that tile), 66 (to its start), 2 (within the tail) and 1 leave the cache exactly as if it had
    been fed only the kept tokens, and later tokens are quantized exactly alike. After a prefill (here fed with its
    drafts, as transformers does first) or a single-token step, nothing is kept: a crop into the tile they completed
    is lossy, the survivors come back as they were read (dequantized, `restored_tokens`), as documented. Keys without
    queries (no attention here) use the policy's unweighted choice on both sides alike."""
    config = tiny("llama").config
    gen = torch.Generator().manual_seed(seed)
    k, v = torch.randn(2, 2, 200, 64, generator=gen), torch.randn(2, 2, 200, 64, generator=gen)
    for chunks, remove in (([130, 8], 5), ([130, 8], 66), ([130, 8], 2), ([130, 8], 1)):
        cropped = KVarNCache(config, preset, sink=8)
        feed(cropped, k, v, chunks)
        cropped.layers[0].store.settle()  # kvarn-auto's key tiles wait for queries (none here)
        assert cropped.layers[0].store.keys.n_tiles == 2
        cropped.crop(-remove)
        keep = sum(chunks) - remove
        plain = KVarNCache(config, preset, sink=8)
        feed(plain, k, v, [keep])
        assert cropped.get_seq_length() == keep
        for a, b in zip(store_state(cropped), store_state(plain)):
            assert torch.equal(a, b), (chunks, remove)
        feed(cropped, k[:, :, keep:], v[:, :, keep:], [200 - keep])
        feed(plain, k[:, :, keep:], v[:, :, keep:], [200 - keep])
        for a, b in zip(store_state(cropped), store_state(plain)):
            assert torch.equal(a, b), (chunks, remove, "after")
        assert cropped.layers[0].store.stats.restored_tokens == 0
    # a prefill with drafts, or a single-token step, completes tile [72, 136); a crop into it restores its survivors
    for chunks, remove in (([138], 5), ([135, 1], 1)):
        lossy = KVarNCache(config, preset, sink=8)
        feed(lossy, k, v, chunks)
        lossy.layers[0].store.settle()
        keep = sum(chunks) - remove
        tile = lossy.layers[0].store.keys.dequantized_tiles()[:, :, 64:keep - 8].clone()
        assert all(layer._undo is None for layer in lossy.layers)
        lossy.crop(-remove)
        store = lossy.layers[0].store
        assert store.keys.n_tiles == 1 and store.stats.restored_tokens == 2 * 2 * (keep - 72)  # keys, values; 2 rows
        assert torch.equal(store.keys.tail, tile)
        assert lossy.nbytes().total == walk_bytes(lossy)


# -- layers left alone, overrides ---------------------------------------------------------------------------------
def test_sliding_and_fp_layers(seed):
    gen = torch.Generator().manual_seed(seed)
    model = tiny("gemma3", layers=4, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=16)
    ids = prompt(90, gen=gen)
    ref = greedy(model, ids, DynamicCache(config=model.config), n=20)
    assert torch.equal(greedy(model, ids, KVarNCache(model.config, "fp16"), n=20), ref)
    preset = get_preset("kvarn-k2v2-g64").replace(name="test-fp-layers", fp_layers=(0, 1))
    cache = KVarNCache(model.config, preset, sink=8)
    greedy(model, ids, cache, n=20)
    kinds = [type(layer).__name__ for layer in cache.layers]
    assert kinds == ["DynamicSlidingWindowLayer", "KVarNLayer"] * 2
    assert cache.layers[1].store.keys.quantizer is not None and cache.layers[1].store.keys.n_tiles == 1
    assert cache.layers[3].store.keys.quantizer is None and cache.nbytes_by_layer()[3].packed == 0
    assert cache.layers[0].keys.shape[2] == 15  # the sliding window kept by transformers' layer



def test_layer_kwargs_of_older_transformers(monkeypatch):
    """transformers < 5.18 returns one kwargs dict for all layers, not a list: the cache still builds every layer (on
    5.17 it built none), the sliding layers with their window. Found on the first GPU run (its image has 5.17)."""
    import kvarn.integrations.transformers as tr

    model = tiny("gemma3", layers=4, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=16)
    new = tr.layer_types_and_kwargs(model.config)
    monkeypatch.setattr(tr, "get_layer_types_and_kwargs", lambda config: (new[0], {"sliding_window": 16}))
    assert tr.layer_types_and_kwargs(model.config) == new
    cache = KVarNCache(model.config, "kvarn-k2v2-g64")
    assert [type(layer).__name__ for layer in cache.layers] == ["DynamicSlidingWindowLayer", "KVarNLayer"] * 2
    greedy(model, prompt(40), cache, n=4)
    assert cache.layers[0].keys.shape[2] == 15 and cache.get_seq_length() == 43  # the last token is not fed

def test_the_preset_is_resolved_once_and_handed_down(monkeypatch):
    """KVarNCache looks the name up once; its layers and stores get the quantizers and the policy, never the name."""
    import kvarn.cache.store
    import kvarn.integrations.transformers as tr

    calls = []
    monkeypatch.setattr(tr, "get_preset", lambda name: calls.append(name) or get_preset(name))
    model = tiny("llama", layers=5, kv_heads=2, head_dim=64)
    cache = KVarNCache(model.config, "turboquant")
    assert calls == ["turboquant"] and not hasattr(kvarn.cache.store, "get_preset")
    p = cache.preset
    for i, layer in enumerate(cache.layers):
        assert layer.policy is p.policy and layer.store.policy is p.policy and layer.name == p.name
        assert (layer.store.keys.quantizer is None) == (i != 2)  # turboquant's fp_layers (2, 2)
    assert repr(cache.layers[1]) == "KVarNLayer(turboquant-k3v3, exact, T=0)"
    assert repr(cache.layers[2]) == "KVarNLayer(turboquant-k3v3, quantized, T=0)"


def test_store_override(seed):
    """The overridden step attends with its fresh K/V; the cache then holds the override."""
    gen = torch.Generator().manual_seed(seed)
    model = tiny("llama")
    ids = prompt(20, gen=gen)
    for impl in ("sdpa", "kvarn"):
        with attn(model, impl):
            plain, over = KVarNCache(model.config, "fp16"), KVarNCache(model.config, "fp16")
            a = forward_steps(model, ids, plain, [10, 10])
            forward_steps(model, ids[:, :10], over, [10])
            k, v = torch.randn(1, 2, 10, 64, generator=gen), torch.randn(1, 2, 10, 64, generator=gen)
            over.set_store_override(1, k, v)
            b = forward_steps(model, ids[:, 10:], over, [10])
            assert torch.equal(b, a[:, 10:])  # same attention inputs as without the override
            sk, sv = over.layers[1].store.full()
            assert torch.equal(sk[:, :, 10:], k) and torch.equal(sv[:, :, 10:], v)
            assert torch.equal(over.layers[0].store.full()[0], plain.layers[0].store.full()[0])
    with pytest.raises(ValueError, match="out of range"):
        over.set_store_override(5, k, v)
    over.set_store_override(0, k[:, :, :3], v[:, :, :3])
    with pytest.raises(ValueError, match="override"):
        forward_steps(model, ids[:, :2], over, [2])


# -- keys before RoPE --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 256},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024},
])
def test_rope_matches_the_models_rotary_embedding(rope, seed):
    """Rope.apply equals the model's own rotary embedding + apply_rotary_pos_emb; Rope.invert undoes it."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = tiny("llama", rope_parameters=rope)
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(2, 2, 50, 64, generator=gen)
    pos = torch.randint(0, 4000, (2, 50), generator=gen)
    cos, sin = model.model.rotary_emb(k, pos)
    _, expected = apply_rotary_pos_emb(k, k, cos, sin)
    r = Rope(model.config)
    torch.testing.assert_close(r.apply(k, pos), expected, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(r.invert(expected, pos), k, atol=2e-5, rtol=1e-5)


def test_rope_refuses_dynamic_types():
    model = tiny("llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(ValueError, match="dynamic"):
        KVarNCache(model.config, get_preset("kvarn").replace(name="t", key_pre_rope=True))


def test_key_pre_rope_in_model(seed):
    """Keys stored before RoPE: with everything in the sink the logits equal DynamicCache's up to the RoPE round
    trip; with tiles, packed and reference reads agree; left padding with generate's position ids works; the
    KVQuant baseline (key_pre_rope) runs end to end."""
    gen = torch.Generator().manual_seed(seed)
    model = tiny("llama")
    pre = get_preset("kvarn-k2v2-g64").replace(name="test-pre-rope", key_pre_rope=True)
    ids = prompt(150 + 3, batch=2, gen=gen)
    mask = torch.ones_like(ids)
    mask[0, :6] = 0
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    chunks = [150, 1, 1, 1]
    exact = forward_steps(model, ids, DynamicCache(config=model.config), chunks, mask, positions)
    assert close(forward_steps(model, ids, KVarNCache(model.config, pre, sink=4096), chunks, mask, positions), exact)
    ref = forward_steps(model, ids, KVarNCache(model.config, pre, sink=8, exact_dtype=None, attention="reference"),
                        chunks, mask, positions)
    with attn(model, "kvarn"):
        cache = KVarNCache(model.config, pre, sink=8, exact_dtype=None)  # float32 sink: RoPE round trip checked below
        got = forward_steps(model, ids, cache, chunks, mask, positions)
    assert cache.layers[0].store.keys.n_tiles == 2
    assert torch.equal(cache.layers[0].positions, positions.to(torch.int32))
    assert close(got, ref)
    # stored keys are pre-RoPE: re-applying RoPE to the exact sink gives back the model's keys
    dyn = DynamicCache(config=model.config)
    forward_steps(model, ids, dyn, chunks, mask, positions)
    sink = cache.layers[0].store.keys.sink
    torch.testing.assert_close(Rope(model.config).apply(sink, positions[:, :8]), dyn.layers[0].keys[:, :, :8],
                               atol=1e-5, rtol=1e-5)
    out = greedy(model, ids, KVarNCache(model.config, "kvquant-k2v2-1pct"), mask=mask, n=6)
    assert out.shape == (2, ids.shape[1] + 6)


# -- refusals ----------------------------------------------------------------------------------------------------
def test_bad_inputs(seed):
    model = tiny("llama", layers=2, kv_heads=2, head_dim=64)
    ids = prompt(5)
    with pytest.raises(ValueError, match=r"valid presets:.*kvarn-k2v2-g128"):
        KVarNCache(model.config, "no-such-preset")
    with pytest.raises(ValueError, match="attention must be"):
        KVarNCache(model.config, attention="fast")
    for other, pattern in ((tiny("llama", kv_heads=1), "KV heads"), (tiny("llama", head_dim=32), "head_dim"),
                           (tiny("llama", layers=1), "layer 1")):
        with pytest.raises(ValueError, match=pattern):
            model(ids, cache=KVarNCache(other.config))
    bigger = KVarNCache(tiny("llama", layers=3).config)
    model(ids, cache=bigger)
    with pytest.raises(ValueError, match="fewer layers"):
        model(ids, cache=bigger)
    cache = KVarNCache(model.config, "kvarn-k2v2-g64", sink=0)
    model(ids, cache=cache)
    with pytest.raises(ValueError, match="batch size"):
        model(prompt(1, batch=2), cache=cache)
    with pytest.raises(ValueError, match="negative count"):
        cache.crop(1)
    with pytest.raises(ValueError, match="cannot remove 6 tokens"):
        cache.crop(-6)


def test_non_finite_kv(seed):
    """NaN/Inf K/V: the tile holding them is kept exact (bit for bit, counted in the bytes); every other tile is
    stored exactly as in a run without them."""
    gen = torch.Generator().manual_seed(seed)
    config = tiny("llama").config
    k, v = torch.randn(2, 2, 200, 64, generator=gen), torch.randn(2, 2, 200, 64, generator=gen)
    bad_k, bad_v = k.clone(), v.clone()
    bad_k[1, 0, 70, 3] = float("nan")  # tile 1 of row 1, head 0 (sink 0, G = 64)
    bad_v[0, 1, 130, :] = float("inf")  # tile 2 of row 0, head 1
    clean, dirty = KVarNCache(config, "kvarn-k2v2-g64", sink=0), KVarNCache(config, "kvarn-k2v2-g64", sink=0)
    for i in range(2):
        clean.update(k, v, i)
        dirty.update(bad_k, bad_v, i)
    ks, vs = dirty.layers[0].store.keys, dirty.layers[0].store.values
    assert ks.exact_index.tolist() == [[1, 0, 1]] and vs.exact_index.tolist() == [[0, 1, 2]]
    full_k, full_v = dirty.layers[0].store.full()
    torch.testing.assert_close(full_k[1, 0, 64:128], bad_k[1, 0, 64:128], atol=0, rtol=0, equal_nan=True)
    assert torch.equal(full_v[0, 1, 128:192], bad_v[0, 1, 128:192])
    ck, cv = clean.layers[0].store.full()
    keep_k = torch.ones(2, 2, 200, dtype=torch.bool)
    keep_k[1, 0, 64:128] = False
    keep_v = torch.ones(2, 2, 200, dtype=torch.bool)
    keep_v[0, 1, 128:192] = False
    assert torch.equal(full_k[keep_k], ck[keep_k]) and torch.equal(full_v[keep_v], cv[keep_v])
    b = dirty.nbytes()
    assert b.exact_tiles == 2 * 2 * (64 * 64 * 4 + 3 * 8) and b.total == walk_bytes(dirty)  # 2 layers x (K, V)
    assert b.total > clean.nbytes().total


def test_cache_keyword_follows_the_forward_signature(seed):
    """transformers 5.24 renamed the cache keyword (past_key_values -> cache); an older forward takes `cache=` into
    its **kwargs and runs without it, silently (found running the serving protocol in .venv-vllm, transformers
    5.19). `cache_kwarg` names what the forward takes, and a cached continuation equals the uncached forward."""
    from kvarn.integrations.transformers import cache_kwarg

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, **kwargs): ...

    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None, **kwargs): ...

    assert cache_kwarg(Old()) == "past_key_values" and cache_kwarg(New()) == "cache"
    model = make_tiny_model("llama")
    assert cache_kwarg(model) in inspect.signature(model.forward).parameters
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 256, (1, 24), generator=gen)
    with torch.no_grad():
        whole = model(ids).logits[0, -1]
        cache = DynamicCache(config=model.config)
        model(ids[:, :20], use_cache=True, **{cache_kwarg(model): cache})
        last = model(ids[:, 20:], use_cache=True, **{cache_kwarg(model): cache}).logits[0, -1]
    assert torch.allclose(last, whole, atol=1e-4)
