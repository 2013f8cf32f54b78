"""Exact-row mixes of `kvarn eval attribute` (kvarn/eval/exact_rows.py): which rows a spec reads exact, against a
float64 brute force; a mix that selects nothing reads what the preset reads; the needle line's tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from kvarn.eval.attribute import variants
from kvarn.eval.exact_rows import mix_exact, needle_lines, parse, selector
from kvarn.integrations.transformers import KVarNCache

CFG = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64, hidden_size=256,
                  vocab_size=64)
T = 128 + 3 * 128 + 40  # sink, three tiles, a tail


def filled(spec: str | None, gen: torch.Generator, lines=None):
    """A reference-path cache fed one chunk of random K/V in layer 0 (heavy rows in a few positions), and the K/V."""
    cache = KVarNCache(CFG, "kvarn-auto-k2v2-g128", attention="reference")
    if spec is not None:
        part, which = parse(spec)
        mix_exact(cache, part, selector(which, lines, 128))
    k = torch.randn(1, 2, T, 64, generator=gen)
    k[:, :, 300] *= 8
    v = torch.randn(1, 2, T, 64, generator=gen)
    cache.update(k, v, 0)
    return cache, k, v


def test_specs_are_checked():
    for bad in ("values:none", "keys:top-err", "keys:head", "keys", "kv:line"):
        with pytest.raises(ValueError, match="PART:WHICH"):
            parse(bad)
    assert parse("kv:top-norm4") == ("kv", "top-norm4")
    assert variants([0], [], [], [], ["keys:none"]) == ["full", "base", "exact:keys:none"]
    with pytest.raises(ValueError, match="reference"):
        mix_exact(KVarNCache(CFG, "kvarn-auto-k2v2-g128"), "keys", selector("none", None, 128))


def test_none_reads_the_preset_and_every_head_reads_exact(seed):
    gen = torch.Generator().manual_seed(seed)
    plain, k, _ = filled(None, gen)
    gen.manual_seed(seed)
    none, _, _ = filled("kv:none", gen)
    assert all(torch.equal(a, b) for a, b in zip(plain.layers[0].store.full(), none.layers[0].store.full()))
    gen.manual_seed(seed)
    c, _, _ = filled("keys:head1", gen)
    pk, pv = plain.layers[0].store.full()
    ck, cv = c.layers[0].store.full()
    assert torch.equal(cv, pv) and torch.equal(ck[:, 0], pk[:, 0])  # values and head 0 untouched
    assert torch.equal(ck[:, 1, 128:512], k[:, 1, 128:512]) and not torch.equal(pk[:, 1, 128:512], k[:, 1, 128:512])


@pytest.mark.parametrize(("which", "r"), [("top-err", 1), ("top-err", 3), ("top-norm", 2)])
def test_per_tile_choice_matches_brute_force(seed, which, r):
    gen = torch.Generator().manual_seed(seed)
    plain, k, v = filled(None, gen)
    gen.manual_seed(seed)
    c, _, _ = filled(f"kv:{which}{r}", gen)
    for j, (exact, dec, got) in enumerate(zip((k, v), plain.layers[0].store.full(), c.layers[0].store.full())):
        e64, d64 = exact.double(), dec.double()
        for h in range(2):
            for t0 in range(128, 512, 128):  # the three tiles; the sink and the tail are exact already
                score = ((d64 - e64)[0, h, t0:t0 + 128] ** 2).sum(-1) if which == "top-err" else \
                    e64[0, h, t0:t0 + 128].norm(dim=-1)
                want = set((score.argsort(descending=True)[:r] + t0).tolist())
                taken = {t for t in range(t0, t0 + 128) if not torch.equal(got[0, h, t], dec[0, h, t])}
                assert taken <= want and torch.equal(got[0, h, sorted(want)], exact[0, h, sorted(want)].to(got.dtype))
                rest = [t for t in range(t0, t0 + 128) if t not in want]
                assert torch.equal(got[0, h, rest], dec[0, h, rest]), (j, h, t0)
    if which == "top-norm":  # the heavy row is its tile's largest
        assert torch.equal(c.layers[0].store.full()[0][0, :, 300], k[0, :, 300])


def test_gold_and_other_line_tokens():
    from transformers import AutoTokenizer

    from kvarn.models import resolve

    tok = AutoTokenizer.from_pretrained(resolve("default"))
    lines = [f"One of the special magic numbers for key{i} is: {1000000 + 7 * i}." for i in range(30)]
    text = "Intro.\n" + "\n".join(lines) + "\nWhat is it?"
    ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
    got = needle_lines(tok, text, ids, str(1000000 + 7 * 5))
    assert tok.decode(ids[0, got["gold-line"]]).strip() == lines[5]
    assert tok.decode(ids[0, got["other-line"]]).strip() == lines[15]
    near_end = needle_lines(tok, text, ids, str(1000000 + 7 * 25))
    assert tok.decode(ids[0, near_end["other-line"]]).strip() == lines[15]
    with pytest.raises(ValueError, match="exactly one line"):
        needle_lines(tok, text, ids, "999")


def test_task_methods_take_per_tile_and_head_specs(seed):
    """`kvarn eval tasks --methods PRESET+exact:SPEC` builds the same mix (line specs need a sample: attribute's)."""
    from types import SimpleNamespace

    from kvarn.eval.tasks.protocol import check_methods, new_cache

    name = "kvarn-auto-k2v2-g128+exact:keys:top-err1"
    assert check_methods([name, "dynamic"]) == [name, "dynamic"]
    for bad, why in [("kvarn-auto-k2v2-g128+exact:keys:gold-line", "gold line"), ("nope+exact:keys:head0", "nope"),
                     ("kvarn-auto-k2v2-g128+exact:values:head0", "PART:WHICH")]:
        with pytest.raises(ValueError, match=why):
            check_methods([bad])
    cache = new_cache(SimpleNamespace(config=CFG), name)
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(1, 2, T, 64, generator=gen)
    k[:, :, 300] *= 8  # as `filled` makes them
    cache.update(k, torch.randn(1, 2, T, 64, generator=gen), 0)
    gen.manual_seed(seed)
    want, _, _ = filled("keys:top-err1", gen)
    assert cache.attention == "reference"
    assert all(torch.equal(a, b) for a, b in zip(cache.layers[0].store.full(), want.layers[0].store.full()))


def test_a_deep_copy_reads_and_appends_apart(seed):
    """The task protocol teacher-forces the gold answer on `copy.deepcopy(cache)`, then decodes from the original: the
    copy's appends must not reach the original's store or kept rows."""
    import copy

    gen = torch.Generator().manual_seed(seed)
    c, _, _ = filled("keys:top-err1", gen)
    before = [x.clone() for x in c.layers[0].store.full()]
    twin = copy.deepcopy(c)
    twin.layers[0].update(torch.randn(1, 2, 200, 64, generator=gen), torch.randn(1, 2, 200, 64, generator=gen))
    assert twin.layers[0].get_seq_length() == T + 200 and c.layers[0].get_seq_length() == T
    assert all(torch.equal(a, b) for a, b in zip(c.layers[0].store.full(), before))
    assert twin.layers[0].store.full()[0].shape[2] == T + 200


def test_query_weighted_choice_matches_brute_force(seed):
    """top-qerr<r>: per tile and head the rows of largest e^T E[q q^T] e under the store's running query second moment
    (a query-aware preset), against float64; a preset that keeps no such statistics is refused by name."""
    gen = torch.Generator().manual_seed(seed)
    k, v = torch.randn(1, 2, T, 64, generator=gen), torch.randn(1, 2, T, 64, generator=gen)
    q = torch.randn(1, 4, T, 64, generator=gen) * torch.linspace(0.1, 3, 64)  # uneven query energy per channel
    caches = []
    for spec in (None, "keys:top-qerr2"):
        cache = KVarNCache(CFG, "kvarn-auto-k2v2-g128-qar", attention="reference")
        if spec is not None:
            mix_exact(cache, *parse(spec)[:1], selector(parse(spec)[1], None, 128))
        cache.update(k, v, 0)
        cache.layers[0].store.observe_queries(q)
        caches.append(cache)
    (dec, _), (got, gotv) = (c.layers[0].store.full() for c in caches)
    cov = caches[1].layers[0].store.queries.covariance().double()  # [1, 2, 64, 64]
    assert torch.equal(gotv, caches[0].layers[0].store.full()[1])  # keys only
    e = (dec.double() - k.double())[0]
    taken_any = False
    for h in range(2):
        for t0 in range(128, 512, 128):
            err = e[h, t0:t0 + 128]
            score = ((err @ cov[0, h]) * err).sum(-1)
            want = sorted((score.argsort(descending=True)[:2] + t0).tolist())
            assert torch.equal(got[0, h, want], k[0, h, want].to(got.dtype))
            rest = [t for t in range(t0, t0 + 128) if t not in want]
            assert torch.equal(got[0, h, rest], dec[0, h, rest])
            plain = set((((err ** 2).sum(-1)).argsort(descending=True)[:2] + t0).tolist())
            taken_any |= plain != set(want)
    assert taken_any  # the weighting changes the choice somewhere: not the plain squared error again
    with pytest.raises(ValueError, match="query statistics"):
        filled("keys:top-qerr1", torch.Generator().manual_seed(seed))[0].layers[0].store.full()


def test_attention_mass_choice_matches_brute_force(seed):
    """top-mass<r>: per tile and head the rows that received the most softmax weight from the queries up to the tile's
    end (chunks of 128 as the serving protocol feeds them), against float64; a mid-sequence sink row is taken."""
    gen = torch.Generator().manual_seed(seed)
    k, v = torch.randn(1, 2, T, 64, generator=gen), torch.randn(1, 2, T, 64, generator=gen)
    mu = torch.randn(64, generator=gen)
    q = torch.randn(1, 4, T, 64, generator=gen) + mu  # queries share a direction: a key along it is a sink
    k[:, :, 300] = 0.5 * mu
    caches = []
    for spec in (None, "keys:top-mass2"):
        cache = KVarNCache(CFG, "kvarn-auto-k2v2-g128", attention="reference")
        if spec is not None:
            mix_exact(cache, *parse(spec)[:1], selector(parse(spec)[1], None, 128))
        for c in range(0, T, 128):
            cache.layers[0].update(k[:, :, c:c + 128], v[:, :, c:c + 128])
            cache.layers[0].store.observe_queries(q[:, :, c:c + 128])
        caches.append(cache)
    (dec, decv), (got, gotv) = (c.layers[0].store.full() for c in caches)
    assert torch.equal(gotv, decv)  # keys only
    k64, q64 = k.double()[0], q.double()[0].view(2, 2, T, 64)  # [Hk, T, D], [Hk, group, T, D]
    w = (q64 @ k64[:, None].transpose(-1, -2)) / 8  # [Hk, g, T (query), T (key)]
    w = w.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
    checked = 0
    for h in range(2):
        for t0 in range(128, 512, 128):
            mass = w[h, :, t0:t0 + 128, t0:t0 + 128].sum((0, 1))  # queries of the tile's own chunk only
            top = mass.argsort(descending=True)
            if mass[top[1]] - mass[top[2]] < 1e-4 * mass[top[1]]:
                continue  # a float32 near tie at the cut
            want = sorted((top[:2] + t0).tolist())
            assert torch.equal(got[0, h, want], k[0, h, want].to(got.dtype))
            rest = [t for t in range(t0, t0 + 128) if t not in want]
            assert torch.equal(got[0, h, rest], dec[0, h, rest])
            checked += 1
    assert checked >= 4 and torch.equal(got[0, :, 300], k[0, :, 300])  # the sink row is its tile's choice
    with pytest.raises(ValueError, match="pre-RoPE"):
        mix_exact(KVarNCache(CFG, "kvquant-k2v2-1pct", attention="reference"), "keys", selector("top-mass1", None, 128))
