"""`kvarn bench`: end to end on a tiny model and tiny shapes (no timing assertions), the JSON checked against
kvarn/eval/schemas/bench.schema.json; the bench's own shortcuts and accounting checked exactly."""

from __future__ import annotations

import dataclasses
import json
import sys
import types

import pytest
import torch

from kvarn.cli import main
from kvarn.eval.schema import load_schema, validate
from tests.helpers import make_tiny_model, tiny_model_folder

WORDS = ["the", "a", "cat", "dog", "sat", "ran", "on", "under", "mat", "tree", "and", "or", "but", "red", "blue"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("bench"), "llama", WORDS, 2000)


@pytest.mark.slow  # a process per cache in the memory section: about a minute on an idle 2-core machine
def test_bench_all_tiny_end_to_end(tiny, tmp_path):
    """Every section, the JSON schema, the plots and the markdown block; 300 tokens hold a sink and a tile."""
    folder, text = tiny
    md = tmp_path / "BENCH.md"
    md.write_text("# Benchmarks\n\nWritten by hand.\n")
    args = ["bench", "all", "--quick", "--model", folder, "--text", text, "--threads", "1", "--shapes", "smollm2",
            "--batches", "1,2", "--attn-contexts", "300", "--attn-rounds", "1", "--e2e-contexts", "300", "--steps", "2",
            "--caches", "dynamic,kvarn-k2v2-g128", "--store-context", "300", "--store-rounds", "1",
            "--mem-contexts", "300", "--mem-steps", "1", "--json", str(tmp_path / "b.json"),
            "--plots", str(tmp_path / "img"), "--markdown", str(md), "--note", "tiny test run"]
    assert main(args) == 0
    result = json.loads((tmp_path / "b.json").read_text())
    validate(result, load_schema("bench"))
    s = result["sections"]
    assert set(s) == {"attention", "e2e", "store", "memory"}
    assert [(c["batch"], c["context"]) for c in s["attention"]["cases"]] == [(1, 300), (2, 300)]
    assert [r["cache"] for r in s["e2e"]["contexts"][0]["rows"]] == ["dynamic", "kvarn-k2v2-g128"]
    assert s["e2e"]["contexts"][0]["rows"][0]["vs_dynamic"] == 1.0
    assert [r["preset"] for r in s["store"]["rows"]] == ["kvarn-k2v2-g128", "kvarn-auto-k2v2-g128"]
    assert s["store"]["rows"][0]["layers"] == 2 and s["store"]["rows"][0]["kv_heads"] == 2
    mem = {r["cache"]: r for r in s["memory"]["rows"]}
    # DynamicCache of the tiny model: 2 layers x (K, V) x 2 heads x 301 tokens x 64 x 4 bytes
    assert mem["dynamic"]["kv_bytes"] == 2 * 2 * 2 * 301 * 64 * 4
    assert 0 < mem["kvarn-k2v2-g128"]["kv_bytes"] < mem["dynamic"]["kv_bytes"]
    assert result["command"].startswith("kvarn bench all --quick")
    assert {p.name for p in (tmp_path / "img").iterdir()} == {"bench-attention.png", "bench-e2e.png",
                                                              "bench-memory.png"}
    doc = md.read_text()
    assert doc.startswith("# Benchmarks\n\nWritten by hand.\n") and "tiny test run" in doc
    assert "](img/bench-e2e.png)" in doc and "targets (issues 10, 19, 20)" in doc
    # a second run replaces the generated block, keeping the text around it
    main([*args[:-2], "--note", "second"])
    doc2 = md.read_text()
    assert doc2.count("kvarn bench: begin generated") == 1 and "second" in doc2 and "tiny test run" not in doc2


def test_bench_sections_tiny_in_process(tiny, tmp_path):
    """The default suite's end-to-end check: attention, e2e and store through the CLI on tiny shapes, the memory
    figures of one cache measured in this process (the `all` test above spawns a process per cache)."""
    from kvarn.bench.footprint import measure_one
    from kvarn.eval.text import load_tokens
    from kvarn.models import load_model

    folder, text = tiny
    out = tmp_path / "b.json"
    args = ["bench", "all", "--quick", "--model", folder, "--text", text, "--threads", "1", "--shapes", "smollm2",
            "--batches", "2", "--attn-contexts", "300", "--attn-rounds", "1", "--e2e-contexts", "300", "--steps", "1",
            "--caches", "dynamic,kvarn-k2v2-g128", "--store-presets", "kvarn-k2v2-g128", "--store-context", "300",
            "--store-rounds", "1", "--warmup", "0"]
    for section in ("attention", "e2e", "store"):
        assert main([*args[:1], section, *args[2:], "--json", str(out)]) == 0
        result = json.loads(out.read_text())
        validate(result, load_schema("bench"))
        assert list(result["sections"]) == [section]
    assert result["sections"]["store"]["rows"][0]["layers"] == 2
    _, tok = load_model(folder)
    ids = load_tokens(tok, text, 302)
    r = measure_one(folder, ids, 300, "dynamic", 2, 1)
    assert r["kv_bytes"] == 2 * 2 * 2 * 302 * 64 * 4  # layers x (K, V) x heads x tokens x head_dim x fp32
    assert r["rss_peak"] >= r["rss_model"] > 0


def test_bench_e2e_baselines_in_process(tmp_path):
    """QuantizedCache (quanto) and StaticCache run through the same decode protocol; ratios name their baseline."""
    pytest.importorskip("optimum.quanto")
    from kvarn.bench.e2e import bench_e2e

    model = make_tiny_model("llama", vocab=256)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 256, (1, 400), generator=g)
    res = bench_e2e(model, lambda n: ids[:, :n], [200], ["dynamic", "static", "quanto-2bit"], steps=2)
    rows = {r["cache"]: r for r in res["contexts"][0]["rows"]}
    assert rows["quanto-2bit"]["vs_quanto"] == 1.0
    assert rows["static"]["vs_dynamic"] == rows["static"]["tokens_per_s"] / rows["dynamic"]["tokens_per_s"]


def test_bench_bad_input_is_a_clear_error(tiny, capsys):
    folder, text = tiny
    assert main(["bench", "e2e", "--model", folder, "--text", text, "--caches", "dynamic,nope"]) == 2
    assert "nope" in capsys.readouterr().err
    assert main(["bench", "attention", "--shapes", "gpt5"]) == 2
    assert "gpt5" in capsys.readouterr().err
    assert main(["bench", "vllm", "--quick", "--vllm-dtype", "int8"]) == 2
    assert "dtype 'int8' is not one of auto, bfloat16, float16, float32" in capsys.readouterr().err
    assert main(["bench", "vllm", "--quick", "--vllm-rounds", "0"]) == 2
    assert "rounds must be at least 1, got 0" in capsys.readouterr().err


def test_bench_vllm_without_vllm_names_the_fix(monkeypatch, capsys):
    """`kvarn bench vllm` where vLLM is not importable: one error line naming `make vllm-venv`, nothing run."""
    from kvarn.bench import vllm as bench_vllm

    monkeypatch.setattr(bench_vllm, "missing", lambda: "vLLM is not importable: run `make vllm-venv`")
    assert main(["bench", "vllm", "--quick"]) == 2
    assert "make vllm-venv" in capsys.readouterr().err


@pytest.mark.parametrize("native", [True, False])
def test_bench_vllm_auto_dtype_and_memory_budgets(monkeypatch, capsys, native):
    """--vllm-dtype auto (the default) serves bfloat16 on a CPU with native bf16 and float32 elsewhere, said on stderr;
    the memory-bound runs' default budgets double for float32 (stock holds as many sequences), a budget given on the
    command line is kept as given. vLLM faked: the section stops at its first engine."""
    from kvarn.bench import vllm as bv

    seen = []

    def fake(model, load_ids, presets, runs, dtype, rounds):
        seen.append((bv.resolve_dtype(dtype), [r.kv_bytes / 2**20 for r in runs if r.kind == "memory"]))
        raise ValueError("fake engine: stop")

    monkeypatch.setattr(bv, "missing", lambda: None)
    monkeypatch.setattr(bv, "native_bf16", lambda: native)
    monkeypatch.setattr(bv, "bench_vllm", fake)
    assert main(["bench", "vllm", "--quick"]) == 2
    assert main(["bench", "vllm", "--quick", "--vllm-mem-kv-mib", "64"]) == 2
    assert main(["bench", "vllm", "--quick", "--vllm-dtype", "bfloat16"]) == 2
    err = capsys.readouterr().err
    if native:
        assert seen == [("bfloat16", [64.0]), ("bfloat16", [64.0]), ("bfloat16", [64.0])]
        assert "dtype bfloat16 (auto: this CPU has native bf16)" in err
    else:
        assert seen == [("float32", [128.0]), ("float32", [64.0]), ("bfloat16", [64.0])]
        assert "dtype float32 (auto: this CPU lacks native bf16)" in err
    assert "fake engine: stop" in err


def test_bench_vllm_table_and_schema(tmp_path):
    """The vllm section's tables and targets come from its JSON, which the bench schema accepts; the plot of
    throughput vs KV budget is drawn from the memory-bound runs."""
    from kvarn.bench.report import plots, tables
    from kvarn.bench.targets import check_targets
    from kvarn.bench.vllm import scenarios
    from kvarn.eval.provenance import provenance

    def row(engine, tps, rps, seqs):
        return {"engine": engine, "tokens_per_s": tps, "requests_per_s": rps, "tokens_per_s_vs_stock": tps / 10,
                "requests_per_s_vs_stock": rps / 0.1, "ttft_mean_s": 2.0, "tpot_mean_s": 0.1, "preemptions": 0,
                "preempted_requests": 0, "kv_tokens": 100, "kv_tokens_vs_stock": 1.0, "max_num_seqs": seqs,
                "wall_s": 80.0, "start_s": 40.0}

    runs = scenarios([8], [512], 128, 4.0, 32, 2048, 256, [212.0, 424.0], 16)
    assert [r.kind for r in runs] == ["equal", "memory", "memory"] and runs[1].kv_bytes == 212 * 2**20
    assert runs[0].max_num_seqs == 8 and scenarios([8], [512], 128, 4.0, 0, 2048, 256, [212.0], 16) == runs[:1]
    sec = {"vllm": "0.32.0", "model": "default", "dtype": "bfloat16", "kernel": "auto", "runs": [
        {**dataclasses.asdict(sc), "rows": [row("stock", 10.0, 0.1, 8), row("kvarn-k2v2-g128", 9.0, 0.25, 12)]}
        for sc in runs]}
    result = {"command": "kvarn bench vllm", "quick": False, "note": None, "provenance": provenance(),
              "sections": {"vllm": sec}, "targets": [], "wall_s": 1.0}
    validate(result, load_schema("bench"))
    got = tables(result)
    assert len(got) == 3 and all(len(head) == len(rows[0]) for _, head, rows in got)
    assert "equal: 8 requests" in got[0][0] and "212 MiB" in got[1][0]
    verdicts = {(t["where"], t["status"]) for t in check_targets(result)}
    assert ("kvarn-k2v2-g128, 8 x (512 + 128)", "missed") in verdicts  # 0.9x stock tokens/s
    assert ("kvarn-k2v2-g128, 32 x (2048 + 256), 212 MiB", "met") in verdicts  # 2.5x stock requests/s
    assert ("kvarn-k4v2-g128, 8 x (512 + 128)", "not measured") in verdicts
    assert [p.name for p in plots(result, tmp_path)] == ["bench-vllm-memory.png"]
    f32 = {**result, "sections": {"vllm": {**sec, "dtype": "float32"}}}  # float32: the target's budget is 424 MiB
    verdicts = {(t["where"], t["status"]) for t in check_targets(f32)}
    assert ("kvarn-k2v2-g128, 32 x (2048 + 256), 424 MiB", "met") in verdicts
    assert not any("212 MiB" in w for w, _ in verdicts)


def test_bench_vllm_rounds_report_median_ratios(monkeypatch, tmp_path):
    """--vllm-rounds N: every engine runs N times in rounds (stock, presets, stock, ...); a row is the engine's median
    round, its ratios the medians of each round's own ratios (a slow round of stock and kvarn alike moves no ratio),
    every round kept; one round gives the rows as before (no "rounds" in them). Engines faked, no vLLM."""
    import kvarn.models
    from kvarn.bench import vllm as bv
    from kvarn.bench.report import tables

    speed = {"stock": [10.0, 5.0, 10.0], "kvarn-k2v2-g128": [9.0, 4.0, 8.0]}  # round 2: the machine at half speed
    calls = []

    def fake(name, llm, prompts, new_tokens):
        k = sum(c == name for c in calls)
        calls.append(name)
        tps = speed[name][k]
        return {"tokens_per_s": tps, "requests_per_s": tps / 100, "wall_s": 100 / tps, "ttft_mean_s": 1.0,
                "tpot_mean_s": 0.1, "preemptions": 0, "kv_tokens": 100 if name == "stock" else 600,
                "max_num_seqs": 8, "generated_tokens": 8, "requests": 8}

    monkeypatch.setattr(bv, "_engine", fake)
    monkeypatch.setattr(kvarn.models, "resolve", lambda model: tmp_path)
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.0-fake"))  # its version, read
    sc = bv.scenarios([8], [16], 4, 1.0, 0, 16, 4, [], 8)
    ids = lambda n, offset: torch.zeros(1, n, dtype=torch.long)  # noqa: E731
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        bv.bench_vllm("default", ids, ["kvarn-k2v2-g128"], sc, rounds=0)
    res = bv.bench_vllm("default", ids, ["kvarn-k2v2-g128"], sc, rounds=3)
    assert calls == ["stock", "kvarn-k2v2-g128"] * 3  # in rounds, not one engine three times in a row
    run = res["runs"][0]
    stock, kv = run["rows"]
    assert run["rounds"] == 3 and len(kv["rounds"]) == 3
    assert [r["tokens_per_s_vs_stock"] for r in kv["rounds"]] == [0.9, 0.8, 0.8]
    assert kv["tokens_per_s_vs_stock"] == 0.8 and stock["tokens_per_s_vs_stock"] == 1.0  # medians of the ratios
    assert kv["tokens_per_s"] == 8.0 and stock["tokens_per_s"] == 10.0  # each engine's median round
    assert kv["kv_tokens_vs_stock"] == 6.0
    assert "the median of 3 rounds" in tables({"sections": {"vllm": {**res}}})[0][0]
    calls.clear()
    one = bv.bench_vllm("default", ids, ["kvarn-k2v2-g128"], sc)["runs"][0]
    assert one["rounds"] == 1 and "rounds" not in one["rows"][1] and one["rows"][1]["tokens_per_s_vs_stock"] == 0.9


@pytest.mark.parametrize("batch", [1, 3])
def test_attention_store_shortcut_equals_a_filled_store(batch):
    """The attention section quantizes one block of tiles of row 0 and repeats them (`_filled_store`); for a
    fixed-rotation preset that must hold exactly what appending the same K/V token by token holds."""
    from kvarn.bench.attention import SHAPES, SYNTHETIC_BLOCK, _dense_kv, _filled_store
    from kvarn.cache.store import LayerStore
    from kvarn.presets import get_preset

    context = 128 + SYNTHETIC_BLOCK + 3 * 128 + 17  # sink, a block, the block repeated in part, a tail
    k, v = _dense_kv(SHAPES["smollm2"], batch, context, 128, seed=0)
    k, v = k[:, :, :context], v[:, :, :context]
    q = torch.randn(batch, 9, 1, 64, generator=torch.Generator().manual_seed(1))
    fast = _filled_store("kvarn-k2v2-g128", k, v, q)
    slow = LayerStore.from_preset(get_preset("kvarn-k2v2-g128"), 64, exact_dtype=torch.float16)
    slow.append(k, v)
    assert fast.keys.n_tiles == slow.keys.n_tiles == (context - 128) // 128
    assert fast.length == slow.length == context
    for name in slow.keys.packed.names():
        assert torch.equal(fast.keys.packed.tensors()[name], slow.keys.packed.tensors()[name]), name
        assert torch.equal(fast.values.packed.tensors()[name], slow.values.packed.tensors()[name]), name
    assert torch.equal(fast.keys.full(), slow.keys.full()) and torch.equal(fast.values.full(), slow.values.full())


def test_targets_met_missed_and_not_measured():
    from kvarn.bench.targets import check_targets

    def e2e(ctx, vs_dyn, vs_q):
        return {"context": ctx, "rows": [{"cache": "kvarn-k2v2-g128", "vs_dynamic": vs_dyn, "vs_quanto": vs_q}]}

    res = {"sections": {"e2e": {"contexts": [e2e(1024, 0.96, 1.0), e2e(8192, 1.2, 1.4)]},
                        "store": {"rows": [{"preset": "kvarn-k2v2-g128", "store_pct_of_decode": 0.1}]}}}
    got = {(t["target"], t["where"]): t["status"] for t in check_targets(res)}
    assert got[("tokens/s / DynamicCache", "kvarn-k2v2-g128 T=1024")] == "met"
    assert got[("tokens/s / DynamicCache", "kvarn-k2v2-g128 T=8192")] == "missed"
    assert got[("tokens/s / quanto 2-bit QuantizedCache", "kvarn-k2v2-g128 T=8192")] == "met"
    assert got[("store time / decode time of its tile (%)", "kvarn-k2v2-g128")] == "met"
    assert got[("store time / decode time of its tile (%)", "kvarn-auto-k2v2-g128")] == "not measured"


def test_held_bytes_counts_shared_storage_once():
    """Views of one storage count once (the bench counts through kvarn.cache.memory)."""
    from kvarn.bench.footprint import held_bytes

    x = torch.zeros(1000)
    holder = {"a": x, "b": x[10:20], "c": [x.view(10, 100)], "d": torch.ones(5, dtype=torch.float64)}
    assert held_bytes(holder) == 1000 * 4 + 5 * 8
