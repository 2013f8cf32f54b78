"""`kvarn eval decode` (docs/SPEC.md §8 decode protocol) on a tiny random model with the real tokenizer, checked against
a plain token-by-token loop; the real-model figures are slow tests."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvarn.cli import main
from kvarn.eval.schema import load_schema, validate
from tests.helpers import tiny_model_folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A folder with a tiny random Qwen2 (k_proj bias, GQA) and the embedded model's tokenizer, and a random text."""
    words = ["keys", "values", "the", "tile", "is", "stored", "once", "and", "read", "by", "every", "query", "."]
    return tiny_model_folder(tmp_path_factory.mktemp("tiny-decode"), "qwen2", words, 1500)


def run_decode(tiny, out, *extra: str) -> dict:
    folder, text = tiny
    assert main(["eval", "decode", "--model", folder, "--text", text, "--out", str(out), *extra]) == 0
    assert {"decode.json", "summary.md", "kl_vs_position.png"} <= {p.name for p in out.iterdir()}
    result = json.loads((out / "decode.json").read_text())
    validate(result, load_schema("decode"))
    return result


def plain_decode_kl(folder: str, text: str, preset: str, n: int, sink: int,
                    exact_dtype: torch.dtype | None = torch.float16) -> tuple[list[float], list[bool]]:
    """The protocol written out: one token at a time on a DynamicCache and on a KVarNCache (its sink held in
    `exact_dtype`, float16 as `kvarn eval decode` does), KL per position as sum_v p_v (log p_v - log q_v) with
    p = softmax(reference logits), in float64."""
    from transformers import DynamicCache

    from kvarn.eval.text import load_tokens
    from kvarn.integrations.transformers import KVarNCache
    from kvarn.models import load_model

    model, tok = load_model(folder)
    ids = load_tokens(tok, text, n)
    ref_cache = DynamicCache(config=model.config)
    # the reference read path (dequantize, then the model's SDPA), as `kvarn eval decode --attention sdpa`: with an
    # exact sink, the same arithmetic as the DynamicCache run until a tile is quantized
    cache = KVarNCache(model.config, preset, sink=sink, exact_dtype=exact_dtype, attention="reference")
    kls, same = [], []
    with torch.no_grad():
        for p in range(n):
            x = ids[:, p:p + 1]
            a = model(input_ids=x, cache=ref_cache, use_cache=True).logits[0, -1].double()
            b = model(input_ids=x, cache=cache, use_cache=True).logits[0, -1].double()
            lp, lq = a - torch.logsumexp(a, 0), b - torch.logsumexp(b, 0)
            kls.append(float((lp.exp() * (lp - lq)).sum()))
            same.append(bool(a.argmax() == b.argmax()))
    return kls, same


def test_decode_protocol_end_to_end(tiny, tmp_path):
    """Before the first tile is quantized, a quantized run differs from the float32 reference only by its sink,
    held in float16 (KL ~1e-10 on this model, a value that depends on the random weights: issue 9 saw a fixed
    1e-9 bound fail in 1 of 3 runs). So that region is checked exactly: every quantized method holds the same
    prefix bit for bit, and with a float32 sink the written-out protocol gives KL exactly 0 there."""
    folder, text = tiny
    sink, g, n = 8, 64, 160
    r = run_decode(tiny, tmp_path / "a", "--methods", "fp16,rtn-k2v2-g64,kvarn-auto-k2v2-g64", "--max-len", str(n),
                   "--sink", str(sink), "--last", "32")
    assert r["tokens"] == n and [x["method"] for x in r["runs"]] == ["fp16", "rtn-k2v2-g64", "kvarn-auto-k2v2-g64"]
    fp, rtn, auto = r["runs"]
    # an unquantized KVarNCache is exactly the reference
    assert fp["summary"] == {"kl_mean": 0.0, "kl_last": 0.0, "top1": 1.0} and fp["rotated"] == {}
    first = sink + g  # the step that completes the first tile still attends to it exactly; the next one does not
    assert rtn["kl"][:first] == auto["kl"][:first] and rtn["kl"][first] != auto["kl"][first]
    exact_sink, _ = plain_decode_kl(folder, text, "kvarn-auto-k2v2-g64", first + 1, sink, exact_dtype=None)
    assert exact_sink[:first] == [0.0] * first and exact_sink[first] > 0  # nothing quantized before the tile
    for x in (rtn, auto):
        kl = torch.tensor(x["kl"], dtype=torch.float64)
        assert len(kl) == n and (kl[first:] > 0).all()
        assert x["summary"]["kl_mean"] == pytest.approx(float(kl.mean()), rel=1e-12)
        assert x["summary"]["kl_last"] == pytest.approx(float(kl[-32:].mean()), rel=1e-12)
    # the policy's stored choices, one share per layer and KV head
    shares = auto["rotated"]["keys"]
    assert len(shares) == 2 and all(len(s) == 2 and all(0 <= v <= 1 for v in s) for s in shares)
    assert rtn["rotated"] == {}
    assert "share of rotated key tiles" in (tmp_path / "a" / "summary.md").read_text()
    # the same numbers as the protocol written out by hand
    kls, same = plain_decode_kl(folder, text, "kvarn-auto-k2v2-g64", n, sink)
    torch.testing.assert_close(torch.tensor(auto["kl"], dtype=torch.float64), torch.tensor(kls, dtype=torch.float64),
                               rtol=1e-6, atol=1e-12)  # KL of float32 logits: summation order differs
    assert auto["top1"] == [float(s) for s in same]


def test_packed_attention_gives_the_same_protocol(tiny, tmp_path):
    """--attention kvarn reads the codes directly; the KL curve matches the dequantized path to float32 noise."""
    args = ("--methods", "kvarn-auto-k2v2-g64", "--max-len", "140", "--sink", "4")
    a = run_decode(tiny, tmp_path / "sdpa", *args)["runs"][0]
    b = run_decode(tiny, tmp_path / "kvarn", *args, "--attention", "kvarn")["runs"][0]
    assert a["rotated"] == b["rotated"]  # the same tiles were stored: same choices, same queries observed
    # logits agree to ~1e-5 (float32 accumulation order differs); KL is quadratic in the difference
    assert max(abs(x - y) for x, y in zip(a["kl"], b["kl"])) < 1e-6 + 1e-3 * max(a["kl"])


def test_decode_bad_input(tiny, tmp_path, capsys):
    folder, text = tiny
    assert main(["eval", "decode", "--model", folder, "--text", text, "--methods", "nope"]) == 2
    assert "unknown preset 'nope'" in capsys.readouterr().err
    assert main(["eval", "decode", "--model", folder, "--text", text, "--max-len", "100000"]) == 2
    assert "fewer than the 100000 asked for" in capsys.readouterr().err
    assert main(["eval", "decode", "--model", folder, "--text", text, "--offset", "-5"]) == 2
    assert "--offset must be >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", "decode", "--max-len", "0"])


# -- the real models (docs/SPEC.md §8; issue 6 acceptance). ~10 min on SmolLM2, ~35 min on Qwen2.5-Coder, 2 cores --
ISSUE6 = "rtn-k2v2-g128,hadamard-k2v2-g128,varn-k2v2-g128,kvarn-k2v2-g128,kvarn-auto-k2v2-g128"


def check_issue6(result: dict, auto: str) -> None:
    kl = {x["method"]: x["summary"]["kl_mean"] for x in result["runs"]}
    others = [kl[m] for m in ISSUE6.split(",") if m != auto and not m.startswith("kvarn-auto")]
    assert kl[auto] <= 0.75 * kl["rtn-k2v2-g128"], kl
    assert kl[auto] <= 1.05 * min(others), kl
    bits = {x["method"]: x["bits_per_element"] for x in result["runs"]}
    assert bits[auto] <= 2.5 + 1e-9, bits


@pytest.mark.slow
@pytest.mark.parametrize("model", ["default", "qwen2.5-coder-0.5b"])
def test_issue6_acceptance(model, tmp_path):
    out = tmp_path / "out"
    assert main(["eval", "decode", "--model", model, "--methods", ISSUE6, "--out", str(out)]) == 0
    result = json.loads((out / "decode.json").read_text())
    assert result["tokens"] == 1024 and all(not math.isnan(x["summary"]["kl_mean"]) for x in result["runs"])
    check_issue6(result, "kvarn-auto-k2v2-g128")


def test_budget_bits_count_the_quantized_layers_only():
    """A model with sliding-window layers (kept exact by KVarNCache) averages a budget preset's promotions over its
    full-attention layers: 3 of 4 here, where kvarn-b3.0 promotes 2 (over all 4 layers it would promote 2 of 4 and
    report fewer bits than the cache stores)."""
    from kvarn.eval.forward import quantizable_layers
    from kvarn.integrations.transformers import KVarNCache
    from kvarn.presets import get_preset
    from tests.helpers import make_tiny_model

    model = make_tiny_model("gemma3", layers=4, layer_types=["sliding_attention"] + ["full_attention"] * 3)
    assert quantizable_layers(model) == 3 and quantizable_layers(make_tiny_model("llama", layers=3)) == 3
    p = get_preset("kvarn-b3.0")
    cache = KVarNCache(model.config, p)
    assert cache.key_allocation.count == p.promoted_layers(quantizable_layers(model)) == 2
    assert p.bits_per_element(64, 3) != p.bits_per_element(64, 4)


def test_runs_record_the_budget_allocation(seed):
    """A run's record of its cache: the rotation shares always, the key bits per layer for budget presets only."""
    from kvarn.eval.decode import cache_record
    from kvarn.integrations.transformers import KVarNCache
    from tests.helpers import forward_steps, make_tiny_model

    model = make_tiny_model("llama", head_dim=64)
    ids = torch.randint(3, 256, (1, 152), generator=torch.Generator().manual_seed(seed))
    budget, auto = (KVarNCache(model.config, name, sink=8) for name in ("kvarn-b3.0", "kvarn-auto-k2v2-g128"))
    for cache in (budget, auto):
        forward_steps(model, ids, cache, [150, 1, 1])
    rec = cache_record(budget)
    chosen = [budget.key_allocation.quantizer(i).config.bits for i in range(2)]  # the decision, read directly
    assert rec["key_bits"] == chosen and sorted(chosen) in ([2, 4], [3, 3])
    assert set(cache_record(auto)) == {"rotated"} and cache_record(auto)["rotated"]["keys"]
