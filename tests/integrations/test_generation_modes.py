"""Every generation mode of transformers' `generate` on the embedded model (SmolLM2-135M, 30 layers, 3 KV heads,
head_dim 64) with quantized presets (issue 9): packed reads, as a user passes the cache, checked against the
reference path (dequantize + the model's own SDPA, `attention="reference"`) or against the generation's own claims.

Prompts are cut from the default text; with sink 0 and 64-token tiles a 140-token prompt leaves two quantized tiles
and a 12-token tail, so every step reads packed tiles. Tolerances (float32 model): both paths compute the same
attention in another order; where no tile completes while decoding, the stored codes are identical and logits agree
to float32 rounding amplified through 30 layers (measured <= 3e-6 relative); asserted: |diff| <= 1e-4 (1 + max|ref|).
Where a tile completes from K/V that differ by that rounding between two runs, an RTN code may flip (one element
moves by one quantization step); those comparisons use 1e-2 and say so.
"""

from __future__ import annotations

import copy

import pytest
import torch

from kvarn.integrations.transformers import KVarNCache, KVarNLayer
from tests.helpers import close, forward_steps, make_tiny_model, packed_calls

pytestmark = [pytest.mark.model,
              pytest.mark.filterwarnings("ignore:kvarn. key tiles stored before any query:UserWarning")]


@pytest.fixture(scope="module")
def text_ids(real_model):
    from kvarn.eval.text import load_tokens

    return load_tokens(real_model[1], None, 400)


def generate(model, ids, cache, n, mask=None, name="cache", **kw):
    mask = torch.ones_like(ids) if mask is None else mask
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                              pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                              **{name: cache, "do_sample": False, **kw})


def teacher_forced(model, seq, prefill, cache, mask=None):
    """Logits [B, n, V] that predict seq[:, prefill:], fed as generate feeds them (prefill, then one at a time)."""
    n = seq.shape[1] - prefill
    logits = forward_steps(model, seq[:, :-1], cache, [prefill] + [1] * (n - 1), mask)
    return logits[:, prefill - 1:]


def stores(cache):
    layers = [layer for layer in cache.layers if isinstance(layer, KVarNLayer)]
    return [s for layer in layers for s in (layer.store.keys, layer.store.values)]


@pytest.mark.parametrize("preset,sample", [("kvarn-k2v2-g64", False), ("kvarn-auto-k2v2-g64", True)])
def test_greedy_and_sampling(real_model, text_ids, preset, sample, seed):
    """Greedy and sampling (fixed seed, top-k 50): the logits `generate` saw equal the reference path's teacher-forced
    over the same tokens; `cache=` and `past_key_values=` generate the same tokens."""
    model, _ = real_model
    ids = text_ids[:, :140]
    kw = dict(do_sample=True, top_k=50) if sample else {}
    torch.manual_seed(seed)
    cache = KVarNCache(model.config, preset, sink=0)
    out, calls = packed_calls(lambda: generate(model, ids, cache, 5, **kw))
    assert calls > 0 and all(s.n_tiles == 2 for s in stores(cache))
    ref = teacher_forced(model, out.sequences, 140, KVarNCache(model.config, preset, sink=0, attention="reference"))
    got = torch.stack(out.logits, 1)
    print(f"{preset} sample={sample}: packed vs reference max |diff| / (1 + max|ref|) = "
          f"{(got - ref).abs().max() / (1 + ref.abs().max()):.2e}")
    assert close(got, ref), f"max diff {(got - ref).abs().max()}"
    torch.manual_seed(seed)
    again = generate(model, ids, KVarNCache(model.config, preset, sink=0), 5, name="past_key_values", **kw)
    assert torch.equal(again.sequences, out.sequences)


def test_beam_search_packed_and_exact_tiles(real_model, text_ids):
    """Beam search (3 beams, all returned, length_penalty 0: score = sum of log-probs) with packed tiles and tiles
    kept exact: layer 5's K/V of the first generated token are scaled by 1e10 (finite, but VarN's fp16 scales
    overflow, so the tile [64, 128) completed at the second step is kept exact, with different values per beam).
    Reordering must carry packed and exact tiles with their beams: each returned beam's score equals the sum of
    log-probs of its tokens teacher-forced through a fresh cache (same batch of 3, same hook)."""
    model, _ = real_model
    ids = text_ids[:, :126]
    current = {}

    def extreme(module, args, out):  # the K/V of position 126, whatever the batch row holds there
        return out * 1e10 if out.shape[1] == 1 and current["cache"].layers[5].get_seq_length() == 126 else out

    att = model.model.layers[5].self_attn
    hooks = [proj.register_forward_hook(extreme) for proj in (att.k_proj, att.v_proj)]
    try:
        current["cache"] = cache = KVarNCache(model.config, "kvarn-k2v2-g64", sink=0)
        out = generate(model, ids, cache, 4, num_beams=3, num_return_sequences=3, length_penalty=0.0,
                       output_scores=True)
        current["cache"] = forced = KVarNCache(model.config, "kvarn-k2v2-g64", sink=0)
        logits = teacher_forced(model, out.sequences, 126, forced).log_softmax(-1)
    finally:
        for h in hooks:
            h.remove()
    ks = cache.layers[5].store.keys
    assert len(ks.exact_index) and ks.n_tiles == 2 and ks.stats.exact_scale_overflow > 0
    assert out.sequences_scores.isfinite().all()
    score = logits.gather(-1, out.sequences[:, 126:, None]).squeeze(-1).sum(-1)
    assert torch.allclose(score, out.sequences_scores, atol=1e-4), (score, out.sequences_scores)


@pytest.fixture(scope="module")
def assistant(real_model):
    """A random 1-layer model on the embedded model's vocabulary: its drafts are mostly rejected, so the main cache
    is cropped at nearly every step."""
    model = make_tiny_model("llama", layers=1, heads=2, kv_heads=1, head_dim=32, hidden=64,
                            vocab=real_model[0].config.vocab_size)
    model.generation_config.num_assistant_tokens = 5
    model.generation_config.num_assistant_tokens_schedule = "constant"
    model.generation_config.assistant_confidence_threshold = 0.0  # always draft 5 (a random model is never sure)
    return model


@pytest.mark.parametrize("preset", ["kvarn-k2v2-g64", pytest.param("kvarn-auto-k2v2-g64", marks=pytest.mark.slow)])
def test_assisted_and_prompt_lookup(real_model, text_ids, assistant, preset, monkeypatch):
    """Assisted decoding and prompt lookup crop the cache after each verification. With a 122-token prompt, the
    verification steps of 6 tokens complete tile [64, 128) and the crops cut into it. Those crops are exact (no
    token restored from a dequantized tile), so greedy tokens equal plain greedy decoding with the same preset and
    the logits agree (tolerance 1e-2: the tile is quantized from K/V computed in a verification chunk instead of one
    token at a time, float32 rounding apart, so a code may flip; module docstring). The cut into a tile is asserted
    for the assistant, which always drafts; prompt lookup drafts only where the text repeats itself (on the default
    text: once, a crop within the tail)."""
    model, _ = real_model
    ids = text_ids[:, :122]
    plain = generate(model, ids, KVarNCache(model.config, preset, sink=0), 8)
    crops = []
    real = KVarNLayer.crop

    def spy(layer, n):
        if layer.layer_idx == 0 and n:
            crops.append((layer.store.length, -n, layer.store.keys.tail_start))
        return real(layer, n)

    monkeypatch.setattr(KVarNLayer, "crop", spy)
    for kw in (dict(assistant_model=assistant), dict(prompt_lookup_num_tokens=5)):
        crops.clear()
        cache = KVarNCache(model.config, preset, sink=0)
        out = generate(model, ids, cache, 8, **kw)
        assert crops, kw
        if "assistant_model" in kw:  # it always drafts 5; prompt lookup drafts only where an n-gram of the text recurs
            assert any(length - n < start for length, n, start in crops), crops  # a crop cut into a tile
        assert sum(s.stats.restored_tokens for s in stores(cache)) == 0
        assert torch.equal(out.sequences, plain.sequences), kw
        a, b = torch.stack(out.logits, 1), torch.stack(plain.logits, 1)
        print(f"{preset} {next(iter(kw))}: {len(crops)} crops, vs plain greedy max |diff| / (1 + max|ref|) = "
              f"{(a - b).abs().max() / (1 + b.abs().max()):.2e}")
        assert close(a, b, 1e-2), f"{kw}: max diff {(a - b).abs().max()}"
        assert cache.get_seq_length() == out.sequences.shape[1] - 1


def test_left_padding_inside_tiles(real_model, text_ids):
    """A batch of a 140- and a 120-token prompt, left-padded: row 1's 20 pads lie inside its first quantized tile
    (sink 0). Row 1's stored tiles and logits do not depend on what the pads hold (pad token 0 vs 1), the store counts
    the pads it kept out of the ranges, and packed reads equal the reference path."""
    model, _ = real_model
    ids = text_ids[:, :140].repeat(2, 1)
    ids[1] = torch.cat([torch.zeros(20, dtype=ids.dtype), text_ids[0, 200:320]])
    mask = torch.ones_like(ids)
    mask[1, :20] = 0
    runs = {}
    for pad_id, attention in ((0, "auto"), (1, "auto"), (0, "reference")):
        x = ids.clone()
        x[1, :20] = pad_id
        cache = KVarNCache(model.config, "kvarn-k2v2-g64", sink=0, attention=attention)
        out = generate(model, x, cache, 4, mask=mask)
        fields = [{k: v[1].clone() for k, v in s.packed.items()} for s in stores(cache)]
        assert all(s.stats.pad_tokens == 20 for s in stores(cache))
        runs[pad_id, attention] = out, torch.stack(out.logits, 1), fields
    (o0, l0, f0), (o1, l1, f1), (_, lr, _) = runs[0, "auto"], runs[1, "auto"], runs[0, "reference"]
    assert torch.equal(o0.sequences[1, 140:], o1.sequences[1, 140:])
    assert all(torch.equal(a[k], b[k]) for a, b in zip(f0, f1) for k in a)
    assert close(l0[1], l1[1], 1e-5)
    assert close(l0, lr), f"max diff {(l0 - lr).abs().max()}"


@pytest.mark.slow
def test_cache_reused_across_chat_turns(real_model, text_ids):
    """generate, then a second turn (30 more tokens of text) on the same cache: tiles of turn 1 keep their bytes, and
    each turn's logits equal the reference path run through the same two turns."""
    model, _ = real_model
    turn2 = text_ids[:, 300:330]
    logits, caches = {}, {}
    for attention in ("auto", "reference"):
        cache = caches[attention] = KVarNCache(model.config, "kvarn-auto-k2v2-g64", sink=0, attention=attention)
        first = generate(model, text_ids[:, :140], cache, 4)
        before = {k: v.clone() for k, v in cache.layers[3].store.keys.packed.items()}
        second = generate(model, torch.cat([first.sequences, turn2], 1), cache, 4)
        assert cache.get_seq_length() == second.sequences.shape[1] - 1
        assert all(torch.equal(cache.layers[3].store.keys.packed.tensors()[k][:, :, :2], v) for k, v in before.items())
        logits[attention] = torch.stack(first.logits + second.logits, 1)
    assert close(logits["auto"], logits["reference"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(torch.float16, marks=pytest.mark.slow)])
def test_half_precision_models(real_model, text_ids, dtype):
    """bf16 / fp16 models (float32 is every other test here): greedy generation with packed reads; the logits
    generate saw equal the reference path teacher-forced over the same tokens within the model dtype's rounding
    (packed attention computes in float32 and rounds its output once; the model's SDPA works in the model dtype:
    a few units of its epsilon relative, amplified through 30 layers; asserted 5e-2 (1 + max|ref|), where the
    quantization itself moves the logits by O(1))."""
    model = copy.deepcopy(real_model[0]).to(dtype)
    ids = text_ids[:, :140]
    cache = KVarNCache(model.config, "kvarn-k2v2-g64", sink=0)
    out, calls = packed_calls(lambda: generate(model, ids, cache, 4))
    assert calls > 0 and all(s.n_tiles == 2 and s.dtype == dtype for s in stores(cache))
    ref = teacher_forced(model, out.sequences, 140, KVarNCache(model.config, "kvarn-k2v2-g64", sink=0,
                                                                attention="reference")).float()
    got = torch.stack(out.logits, 1)
    rel = (got - ref).abs().max() / (1 + ref.abs().max())
    print(f"{dtype}: packed vs reference max |diff| / (1 + max|ref|) = {rel:.2e}")
    assert close(got, ref, 5e-2), f"max diff {(got - ref).abs().max()}, max |ref| {ref.abs().max()}"
