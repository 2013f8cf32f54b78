"""Builders and oracles that more than one test module uses: tiny random models, the float64 attention oracle and
its inputs, the check of a quantizer against the float64 tile oracle, small stores, forwards through a cache.

Test modules import them from here (`from tests.helpers import ...`), never from one another; fixtures stay in
tests/conftest.py."""

from __future__ import annotations

import itertools
import math
import os
import random

import torch

import kvarn.attention.packed as packed_mod
from kvarn.attention import KVarNPast
from kvarn.attention.view import StoredKV
from kvarn.cache.store import LayerStore
from kvarn.presets import Preset, affine_preset, get_preset
from kvarn.quant.affine import AffineQuantizer
from kvarn.quant.tiles import AffineTiles
from tests.reference import widths as widths_ref
from tests.reference.affine import TileRef, quantize_tile_ref, reconstruct_ref
from tests.reference.data import heavy_tailed
from tests.reference.hadamard import hadamard_reference
from tests.reference.packing import unpack_row, unpack_tensor
from tests.tolerances import FP16_ETA, FP16_U, LOGITS_REL

# -- the test seed (printed by tests/conftest.py's header) ------------------------------------------------------
SEED = 0  # the default seed of every test


def _session_seed() -> int:
    if "KVARN_SEED" in os.environ:
        return int(os.environ["KVARN_SEED"])
    if os.environ.get("KVARN_RANDOM_SEED") == "1":
        return random.SystemRandom().randrange(2**31)
    return SEED


TEST_SEED = _session_seed()


# -- tiny random models ---------------------------------------------------------------------------------------
# Tiny configs per family; head_dim given explicitly. Random weights, built offline from the config.
TINY_FAMILIES: dict[str, dict] = {
    "llama": dict(model_type="llama"),
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3"),
    "mistral": dict(model_type="mistral", sliding_window=None),
    "phi3": dict(model_type="phi3"),
    "gemma2": dict(model_type="gemma2", sliding_window=4096, query_pre_attn_scalar=64),
    "gemma3": dict(model_type="gemma3_text", sliding_window=4096, query_pre_attn_scalar=64),
}


def make_tiny_model(family: str = "llama", *, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                    head_dim: int = 64, hidden: int = 128, vocab: int = 256, seed: int = 0, **overrides):
    """A random-weight causal LM of `family`, float32, eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(TINY_FAMILIES[family])
    model_type = spec.pop("model_type")
    cfg = AutoConfig.for_model(
        model_type, vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=4096,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, **{**spec, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return model.eval()


def tiny_model_folder(folder, family: str, words: list[str], n_words: int, seed: int = TEST_SEED) -> tuple[str, str]:
    """Save a tiny random `family` model (weights from `seed`) with the embedded model's tokenizer into `folder`, and
    a text file of `n_words` words drawn from `words` with `seed`. Returns (model folder, text path)."""
    from transformers import AutoTokenizer

    from kvarn.models import resolve

    tok = AutoTokenizer.from_pretrained(resolve("default"))
    model = make_tiny_model(family, layers=2, heads=4, kv_heads=2, head_dim=64, hidden=64, vocab=len(tok),
                            seed=seed)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    rng = random.Random(seed)
    text = folder / "text.txt"
    text.write_text(" ".join(rng.choice(words) for _ in range(n_words)))
    return str(folder), str(text)


# -- the float64 attention oracle (tests/attention/test_attention.py states its tolerances) ---------------------
def dequant_affine_f64(view: StoredKV) -> torch.Tensor:
    """[B, H, n*G, D] float64 reconstruction of packed tiles of an AffineQuantizer (docs/SPEC.md §3 step 5)."""
    cfg = view.quantizer.config
    f = view.packed
    if f.row_widths is not None:  # key rows at their own widths, by the reference reader, tile by tile
        fmt = f.fmt
        lead = f.codes.shape[:-1]
        widths = [unpack_row(w, 3) for w in f.row_widths.reshape(-1, f.row_widths.shape[-1]).tolist()]
        codes = torch.tensor([widths_ref.unpack_rows(c, w, fmt.cols) for c, w in
                              zip(f.codes.reshape(-1, f.codes.shape[-1]).tolist(), widths, strict=True)],
                             dtype=torch.float64).reshape(*lead, fmt.rows, fmt.cols)
    else:
        codes = unpack_tensor(f.codes, cfg.bits).double()  # [B, H, n, R, C]
    x = codes * f.row_scale.double().unsqueeze(-1) + f.row_zero.double().unsqueeze(-1)
    if f.col_scale is not None:
        x = x * f.col_scale.double().unsqueeze(-2)
    if cfg.axis == "channel":
        x = x.transpose(-1, -2)  # token-major [B, H, n, G, D]
    h = hadamard_reference(x.shape[-1])
    if cfg.rotate == "hadamard":
        x = x @ h
    elif cfg.rotate == "auto":
        x = torch.where(f.rotated.bool()[..., None, None], x @ h, x)
    b, hh, n, g, d = x.shape
    if view.exact_values is not None:
        for (bi, hi, ti), v in zip(view.exact_index.tolist(), view.exact_values):
            x[bi, hi, ti] = v.double()
    return x.reshape(b, hh, n * g, d)


def dequant_f64(view: StoredKV | None) -> torch.Tensor | None:
    if view is None:
        return None
    if isinstance(view.quantizer, AffineQuantizer):
        tiles = dequant_affine_f64(view) if view.n_tiles else None
    else:  # other quantizers: their own decode (tested in their own files), exact tiles restored
        tiles = view.decode_tiles(0, view.n_tiles, torch.float64) if view.n_tiles else None
    parts = [view.sink, tiles, view.tail]
    return torch.cat([p.double() for p in parts if p is not None and p.shape[2]], dim=2)


def oracle(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, past: KVarNPast | None,
           ok: torch.Tensor, scaling: float, softcap: float | None = None) -> torch.Tensor:
    """Plain attention in float64: query head h reads KV head h // (Hq/Hkv). ok: bool [B, 1, L, T]. -> [B, L, Hq, D]."""
    kp = dequant_f64(past.keys) if past is not None else None
    vp = dequant_f64(past.values) if past is not None else None
    k = k_new.double() if kp is None else torch.cat([kp, k_new.double()], 2)
    v = v_new.double() if vp is None else torch.cat([vp, v_new.double()], 2)
    b, hq, length, d = q.shape
    g = hq // k.shape[1]
    out = torch.zeros(b, length, hq, d, dtype=torch.float64)
    for h in range(hq):
        s = torch.einsum("bld,btd->blt", q[:, h].double(), k[:, h // g]) * scaling
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~ok[:, 0], float("-inf"))
        p = torch.softmax(s, -1)
        p = torch.where(ok[:, 0].any(-1, keepdim=True), p, 0.0)
        out[:, :, h] = torch.einsum("blt,btd->bld", p, v[:, h // g])
    return out


def logit_l1(q: torch.Tensor, k: torch.Tensor, scaling: float) -> float:
    """max over (query, key) of sum_d |q_d k_d| * scaling (the conditioning of the logits), GQA-aware."""
    kk = k.double().abs().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return float((q.double().abs() @ kk.transpose(-1, -2)).max()) * scaling


# -- inputs -----------------------------------------------------------------------------------------------------
def make_inputs(kind: str, b: int, h: int, t: int, d: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "gauss":
        return torch.randn(b, h, t, d, generator=gen)
    if kind == "heavy":
        return heavy_tailed(b, h, t, d, generator=gen).float()
    raise ValueError(kind)


def padding_mask(pads: list[int], length: int, kv_len: int) -> torch.Tensor:
    """bool [B, 1, L, kv_len]: row b ignores its first pads[b] positions; query i sits at kv_len - L + i."""
    j = torch.arange(kv_len)
    causal = j.view(1, -1) <= (torch.arange(length) + kv_len - length).view(-1, 1)
    rows = [causal & (j >= p).view(1, -1) for p in pads]
    return torch.stack(rows).unsqueeze(1)


def build_past(preset: Preset | str, k: torch.Tensor, v: torch.Tensor, sink: int, splits: int = 3) -> KVarNPast:
    st = LayerStore.from_preset(get_preset(preset), k.shape[-1], sink=sink)
    t = k.shape[2]
    cuts = sorted({0, t, *torch.randint(1, t, (splits - 1,)).tolist()})
    for a, e in itertools.pairwise(cuts):  # appended in pieces of random lengths, as prefill + turns would
        st.append(k[:, :, a:e], v[:, :, a:e])
    return KVarNPast(StoredKV.of(st.keys), StoredKV.of(st.values))


KERNEL_BITCHECK_PRESETS = [("kvarn-k2v2-g128", 64), ("kvarn-auto-k2v2-g128", 64), ("kvarn-auto-k4v2-g128", 128),
                           ("kvarn-k4v4-g64", 96), ("rtn-k2v2-g64", 64), ("kvarn-auto-k2v2-g128-qar-clip", 64),
                           ("hadamard-k4v4-g128", 64)]


def kernel_outputs() -> dict[tuple, torch.Tensor]:
    """`packed_attention` on fixed inputs, for kernel changes meant to keep every bit (scripts/kernel_bitcheck.py,
    tests/kernels/test_cpu_decode.py): 7 presets (KVarN, kvarn-auto with and without query-aware rounding and
    clipping, RTN, Hadamard; 2/4-bit, head dims 64/96/128) x float32/bf16/fp16 keys, values and queries x GQA ratios
    1/3/4, with padding masks. The pasts are stored in the same call (the tile store's kernel too, under the
    KVARN_KERNEL in force); the global RNG is left as it was."""
    from kvarn.attention import packed_attention

    outs = {}
    with torch.random.fork_rng():
        torch.manual_seed(0)  # build_past's cut points
        for preset, d in KERNEL_BITCHECK_PRESETS:
            t = 16 + 3 * get_preset(preset).tile + 7
            for dt in (torch.float32, torch.bfloat16, torch.float16):
                gen = torch.Generator().manual_seed(0)
                k, v = make_inputs("heavy", 3, 2, t, d, gen).to(dt), make_inputs("gauss", 3, 2, t, d, gen).to(dt)
                past = build_past(preset, k, v, sink=16)
                for groups in (1, 3, 4):
                    q = make_inputs("heavy", 3, 2 * groups, 1, d, gen).to(dt)
                    kn, vn = make_inputs("heavy", 3, 2, 1, d, gen).to(dt), make_inputs("gauss", 3, 2, 1, d, gen).to(dt)
                    outs[(preset, str(dt), groups)] = packed_attention(q, kn, vn, past,
                                                                       padding_mask([0, 5, 20], 1, t + 1), d ** -0.5,
                                                                       None)
    return outs


def fresh(gen: torch.Generator, b: int, hq: int, hkv: int, length: int, d: int):
    """Gaussian queries [B, Hq, L, D] and fresh keys and values [B, Hkv, L, D] (drawn in that order)."""
    return (torch.randn(b, hq, length, d, generator=gen), torch.randn(b, hkv, length, d, generator=gen),
            torch.randn(b, hkv, length, d, generator=gen))


def opposite_heads(gen: torch.Generator, t: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two [1, 1, t, D] heads that favour opposite rotation choices under kvarn-auto: 3 outlier channels (x30; the
    plain basis keeps them in their own per-channel ranges) and heavy tails (Student-t, df 2; the rotation spreads)."""
    outliers = torch.randn(1, 1, t, d, generator=gen) * torch.where(torch.arange(d) < 3, 30.0, 1.0)
    return outliers, heavy_tailed(1, 1, t, d, generator=gen, df=2).float()


def nonfinite_case(seed: int):
    """A NaN key tile (row 1, head 0; its value tile packed) and an Inf value tile (row 0, head 1; its key tile
    packed), sink 0, tiles of 64: (q, fresh k, fresh v, past, mask, float64 oracle, [B, Hq] heads that read them)."""
    gen = torch.Generator().manual_seed(seed)
    t, d = 3 * 64 + 10, 64
    k, v = torch.randn(2, 2, t, d, generator=gen), torch.randn(2, 2, t, d, generator=gen)
    k[1, 0, 70] = float("nan")  # tile 1 of row 1, head 0 (sink 0)
    v[0, 1, 5] = float("inf")  # tile 0 of row 0, head 1
    past = build_past("kvarn-k2v2-g64", k, v, sink=0)
    assert past.keys.exact_index.tolist() == [[1, 0, 1]] and past.values.exact_index.tolist() == [[0, 1, 0]]
    q, kn, vn = fresh(gen, 2, 4, 2, 1, d)
    ok = padding_mask([0, 0], 1, t + 1)
    bad = torch.zeros(2, 4, dtype=torch.bool)
    bad[1, 0:2] = True  # query heads of KV head 0, row 1
    bad[0, 2:4] = True
    return q, kn, vn, past, ok, oracle(q, kn, vn, past, ok, d ** -0.5), bad


# -- a quantizer against the float64 tile oracle of docs/SPEC.md §3 (tests/quant/test_affine.py) ------------------
def stored_codes(packed: AffineTiles, i: int, bits: int) -> list[list[int]]:
    """Codes of tile i [R][C], unpacked by the reference bit-by-bit reader; a refined row's are 4 q + e, its high
    bits q from `codes`, its low bits e from `refine_codes` (kvarn.quant.tiles.AffineFormat)."""
    codes = [unpack_row(row, bits) for row in packed.codes[i].tolist()]
    if packed.refine_rows is not None:
        for r, low in zip(packed.refine_rows[i].tolist(), packed.refine_codes[i].tolist(), strict=True):
            codes[r] = [4 * q + e for q, e in zip(codes[r], unpack_row(low, 2), strict=True)]
    return codes


def stored_steps(packed: AffineTiles, i: int) -> list[float]:
    """Row steps a_r of tile i (float64): the stored row scale, a refined row's divided by 4."""
    a = packed.row_scale[i].double().tolist()
    for r in [] if packed.refine_rows is None else packed.refine_rows[i].tolist():
        a[r] /= 4
    return a


def check_against_reference(q: AffineQuantizer, x: torch.Tensor) -> None:
    """x [N, G, D] float32. Codes, stored scales and the reconstruction formula against the float64 oracle."""
    c = q.config
    packed = q.encode(x)
    dec = q.decode(packed)
    levels = 2**c.bits - 1
    # float32 pipeline vs float64 oracle: VarN scales agree to ~1e-6 relative (test_ops), the float32
    # Hadamard to ~1e-6 of the tile's scale, so a position (B - lo)/delta moves by far less than 1e-3
    # even where max|B| is 10x the row's range; only positions that close to k + 0.5 may round differently.
    tie_eps = 1e-3
    for i in range(len(x)):
        ref: TileRef = quantize_tile_ref(x[i].double(), c.bits, c.axis, c.rotate == "hadamard", c.varn, c.varn_iters,
                                         q.refine_count(x.shape[2]), clip=c.clip)
        codes = stored_codes(packed, i, c.bits)
        if packed.refine_rows is not None:
            assert packed.refine_rows[i].tolist() == ref.refined, "refined rows differ from the oracle's"
        mismatches = 0
        for r, (got_row, want_row) in enumerate(zip(codes, ref.codes)):
            for col, (got, want) in enumerate(zip(got_row, want_row)):
                if got != want:
                    pos = ref.positions[r][col]
                    assert abs(got - want) == 1 and abs(pos - math.floor(pos) - 0.5) < tie_eps, (i, r, col, pos)
                    mismatches += 1
        assert mismatches <= max(2, len(codes) * len(codes[0]) // 100)
        # stored scales: the oracle's rounded to fp16 (half an ulp) plus the float32 drift (1e-5), up to
        # VarN's gauge: (t k, a / k, z / k) gives the same B, codes and reconstruction, and float32 may pick
        # a different one of the iterations that tie at the fixed point (see reference.varn.matching_candidate)
        tol = 2 * FP16_U + 1e-5
        k = 1.0
        if c.varn:
            ratio = packed.col_scale[i].double() / torch.tensor(ref.t, dtype=torch.float64)
            k = ratio.median().item()
            assert ((ratio - k).abs() <= tol * k).all(), "column scales differ by more than a gauge factor"
        for name, want in (("row_scale", ref.a), ("row_zero", ref.z)):
            got = torch.tensor(stored_steps(packed, i)) if name == "row_scale" else getattr(packed, name)[i].double()
            want = torch.tensor(want, dtype=torch.float64) / k
            assert ((got - want).abs() <= want.abs() * tol + FP16_ETA).all(), name
        # reconstruction formula X^[r, c] = (q a_r + z_r) t_c with the stored codes and scales, float64
        t = packed.col_scale[i].double().tolist() if c.varn else None
        want = reconstruct_ref(codes, stored_steps(packed, i), packed.row_zero[i].double().tolist(),
                               t, c.axis, c.rotate == "hadamard")
        scale = want.abs().max().item()
        assert (dec[i].double() - want).abs().max().item() <= 2e-6 * scale + 1e-30  # float32 decode arithmetic
        assert levels >= 1


# -- small layer stores (tests/cache) -------------------------------------------------------------------------
B, H, D = 2, 3, 16  # batch, KV heads, head_dim of the small stores of tests/cache


def small_preset(family: str = "kvarn", tile: int = 16, sink: int = 8, flush: int | None = None,
                 window: str = "block", bits: tuple[int, int] = (2, 2)):
    """A preset with small tiles so the Python-loop reference stays quick; `flush` > tile hands the
    quantizers several tiles at once."""
    p = affine_preset(family, bits[0], bits[1], tile)
    return p.replace(sink=sink, tile=flush or tile, value_window=window)


# -- forwards through a cache (tests/integrations) ------------------------------------------------------------
def close(a: torch.Tensor, b: torch.Tensor, rel: float = LOGITS_REL) -> bool:
    return bool((a - b).abs().max() <= rel * (1 + b.abs().max()))


def forward_steps(model, ids, cache, chunks, mask=None, positions=None):
    """Teacher-forced forwards over consecutive chunks of ids (sizes `chunks`); returns the logits of each chunk."""
    from kvarn.integrations.transformers import cache_kwarg

    out, at = [], 0
    with torch.no_grad():
        for n in chunks:
            kw = {} if mask is None else {"attention_mask": mask[:, :at + n]}
            if positions is not None:
                kw["position_ids"] = positions[:, at:at + n]
            out.append(model(ids[:, at:at + n], **{cache_kwarg(model): cache}, **kw).logits)
            at += n
    return torch.cat(out, dim=1)


def packed_calls(fn):
    """(fn(), number of packed_attention calls over a stored past it made)."""
    real, calls = packed_mod.packed_attention, []

    def counted(query, key, value, past, *args, **kwargs):
        calls.append(past is not None)
        return real(query, key, value, past, *args, **kwargs)

    packed_mod.packed_attention = counted
    try:
        return fn(), sum(calls)
    finally:
        packed_mod.packed_attention = real


# -- a key format's packed read path and its life in a model (tests/quant/test_refine.py, test_widths.py) ---------
def check_packed_key_logits(q: AffineQuantizer, seed: int = 11, d: int = 64) -> None:
    """The read path that folds scales into the query (`kvarn.attention.packed`) reads q's key tiles as decode does:
    logits of packed tiles equal q @ decode(K)^T (rotation chosen per tile), float64."""
    from kvarn.ops.hadamard import hadamard_transform

    gen = torch.Generator().manual_seed(seed)
    b, h, n, g = 2, 3, 2, q.tile
    packed = q.encode(torch.randn(b * h * n, g, d, generator=gen), torch.rand(b * h * n, d, generator=gen))
    view = StoredKV(None, packed.unflatten((b, h, n)), n, None, torch.zeros(0, 3, dtype=torch.long), None, q,
                    (b, h, d), torch.float32)
    qs = torch.randn(b, h, 4, d, generator=gen, dtype=torch.float64)
    got = packed_mod._affine_key_logits(qs, hadamard_transform(qs), view, 0, n, torch.float64)
    dec = q.decode(packed, torch.float64).reshape(b, h, n * g, d)
    assert torch.allclose(got, qs @ dec.transpose(-1, -2), rtol=1e-9, atol=1e-9)


def check_in_a_model(preset: Preset, tmp_path, seed: int, field: str) -> None:
    """`preset` in a 2-layer model: packed reads match reference reads (1e-3 relative, as
    tests/integrations/test_transformers.py), the key tiles hold `field`, the bytes held are the format's, and a saved
    cache continues as the original."""
    from kvarn.integrations.serialize import load_cache, save_cache
    from kvarn.integrations.transformers import KVarNCache

    model = make_tiny_model("llama", head_dim=64)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 256, (1, 158), generator=gen)
    ref = forward_steps(model, ids, KVarNCache(model.config, preset, sink=8, attention="reference"), [150, 5, 1])
    cache = KVarNCache(model.config, preset, sink=8)
    got = forward_steps(model, ids, cache, [150, 5, 1])
    assert close(got, ref, rel=1e-3), f"max diff {(got - ref).abs().max()}"
    keys = cache.layers[0].store.keys
    assert keys.n_tiles >= 1 and getattr(keys.packed, field) is not None
    b, h = keys.packed.axes(2)
    assert keys.packed.nbytes == b * h * keys.n_tiles * keys.quantizer.format(64).nbytes
    save_cache(cache, tmp_path / "c.safetensors")
    back = load_cache(tmp_path / "c.safetensors", model.config, preset=preset)
    more = ids[:, 156:]
    assert torch.equal(forward_steps(model, more, cache, [1, 1]), forward_steps(model, more, back, [1, 1]))
