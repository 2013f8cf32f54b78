"""`kvarn eval <analysis>` end to end on a tiny random model (with the real tokenizer) and a random text:
exit codes, JSON files checked against kvarn/eval/schemas, summaries, plots, determinism, clean errors."""

from __future__ import annotations

import json

import pytest

from kvarn.cli import main
from kvarn.eval import analyses
from kvarn.eval.schema import load_schema, validate
from tests.helpers import tiny_model_folder

SMALL = "rtn-k2v2-g64,kvarn-k2v2-g64"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A folder holding a tiny random llama with the embedded model's tokenizer, and a random text file."""
    words = ["the", "cache", "token", "error", "grows", "with", "length", "and", "each", "tile", "is", "quantized",
             "once", "model", "attends", "to", "its", "keys", "values", "of", "a", "long", "text", "."]
    return tiny_model_folder(tmp_path_factory.mktemp("tiny"), "llama", words, 3000)


def _run(tiny, tmp_path, analysis: str, *extra: str) -> dict:
    folder, text = tiny
    out = tmp_path / analysis
    rc = main(["eval", analysis, "--model", folder, "--text", text, "--out", str(out), "--sink", "0", *extra])
    assert rc == 0
    files = {p.name for p in out.iterdir()}
    assert "summary.md" in files and any(f.endswith(".png") for f in files), files
    name = analysis.replace("-", "_")
    result = json.loads((out / f"{name}.json").read_text())
    validate(result, load_schema(name))
    return result


def test_discovery():
    assert {"pseudo-decode", "decompose", "outliers", "ppl", "lines", "report"} <= set(analyses())


def test_pseudo_decode(tiny, tmp_path):
    r = _run(tiny, tmp_path, "pseudo-decode", "--methods", f"fp16,{SMALL}", "--max-len", "256", "--block", "32")
    assert len(r["runs"]) == 6 and r["block_ends"][-1] == 256
    fp = [x for x in r["runs"] if x["method"] == "fp16"]
    assert all(x["summary"]["mae"] == 0 and x["summary"]["kl"] == 0 for x in fp)
    q = [x for x in r["runs"] if x["method"] != "fp16"]
    assert all(x["summary"]["mae"] > 0 for x in q)
    assert all(len(x["mae"][0]) == 2 for x in r["runs"])


def test_pseudo_decode_is_deterministic(tiny, tmp_path):
    args = ("--methods", "rtn-k2v2-g64", "--max-len", "192", "--block", "64", "--mode", "cumulative")
    a = _run(tiny, tmp_path / "a", "pseudo-decode", *args)["runs"]
    b = _run(tiny, tmp_path / "b", "pseudo-decode", *args)["runs"]
    for x, y in zip(a, b):
        assert x["mae"] == y["mae"] and x["kl"] == y["kl"]


def test_decompose(tiny, tmp_path):
    r = _run(tiny, tmp_path, "decompose", "--methods", f"fp16,{SMALL}", "--max-len", "300")
    assert {(x["method"], x["kind"]) for x in r["results"]} == {(m, k) for m in SMALL.split(",")
                                                                for k in ("keys", "values")}
    assert all(x["identity_max_rel_error"] <= 1e-12 for x in r["results"])


def test_outliers(tiny, tmp_path):
    r = _run(tiny, tmp_path, "outliers", "--methods", "rtn-k2v2-g64", "--max-len", "256", "--block", "64")
    variants = [(x["variant"], x["granularity"]) for x in r["results"]]
    assert variants == [("base", None), ("worst", "token"), ("rest", "token"), ("worst", "element"),
                        ("rest", "element")]
    # fixing a subset need not lower KL on a random model (errors can cancel), so only: the base run has an
    # error, every variant changed it, and the shares kept exact are complementary
    base = r["results"][0]["kl"]
    assert base > 0 and all(x["kl"] >= 0 and x["kl"] != base for x in r["results"][1:])
    shares = [x["fixed_share"] for x in r["results"][1:]]
    assert shares[0] + shares[1] == pytest.approx(1) and shares[2] + shares[3] == pytest.approx(1)


def test_ppl(tiny, tmp_path):
    r = _run(tiny, tmp_path, "ppl", "--methods", "fp16,rtn-k2v2-g64", "--max-tokens", "384", "--window", "192",
             "--block", "64")
    fp, rtn = r["results"]
    assert len(r["windows"]) == 2 and fp["kl"] == 0 and fp["ppl"] == r["reference"]["ppl"]
    assert rtn["kl"] > 0 and rtn["scored"] == r["reference"]["scored"]


def test_lines(tiny, tmp_path):
    args = ("--methods", "fp16,rtn-k2v2-g64", "--lines", "3,6", "--queries", "2", "--new-tokens", "4",
            "--block", "64", "--seed", "7")
    r = _run(tiny, tmp_path / "a", "lines", *args)
    assert len(r["results"]) == 2 * (1 + 2 * 2)
    for x in r["results"]:
        if x["method"] == "fp16":  # an unquantized KVarNCache answers exactly like the reference
            assert x["same_as_reference"] == x["queries"]
    again = _run(tiny, tmp_path / "b", "lines", *args)
    assert again["results"] == r["results"] and again["examples"] == r["examples"]


def test_report(tiny, tmp_path):
    folder, text = tiny
    cfg = tmp_path / "suite.json"
    cfg.write_text(json.dumps({"model": folder, "text": text, "methods": "rtn-k2v2-g64", "sink": 0,
                               "analyses": {"pseudo-decode": {"max-len": 128, "block": 64, "mode": "cumulative"},
                                            "decompose": {"max-len": 200}}}))
    out = tmp_path / "report"
    assert main(["eval", "report", "--config", str(cfg), "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert "## Pseudo-decoding" in md and "## Error decomposition" in md and "](pseudo-decode/" in md
    validate(json.loads((out / "report.json").read_text()), load_schema("report"))
    # --replot redraws from the JSON files without running anything
    png = out / "pseudo-decode" / "error_vs_length.png"
    png.unlink()
    (out / "report.md").write_text("")
    assert main(["eval", "report", "--config", str(cfg), "--out", str(out), "--replot"]) == 0
    assert png.exists() and (out / "report.md").read_text() == md
    assert main(["eval", "report", "--config", str(cfg), "--out", str(tmp_path / "none"), "--replot"]) == 2


def test_report_in_parallel(tiny, tmp_path):
    """--jobs 2: analyses in spawned processes give the same results as in-process runs."""
    folder, text = tiny
    cfg = tmp_path / "suite.json"
    cfg.write_text(json.dumps({"model": folder, "text": text, "methods": "rtn-k2v2-g64", "sink": 0, "threads": 1,
                               "analyses": {"decompose": {"max-len": 200}, "ppl": {"max-tokens": 192, "window": 96}}}))
    for jobs in ("1", "2"):
        assert main(["eval", "report", "--config", str(cfg), "--out", str(tmp_path / jobs), "--jobs", jobs]) == 0
    for name in ("decompose", "ppl"):
        a, b = (json.loads((tmp_path / j / name / f"{name}.json").read_text()) for j in ("1", "2"))
        assert a["results"] == b["results"]
    rep = json.loads((tmp_path / "2" / "report.json").read_text())
    assert rep["jobs"] == 2 and [s["analysis"] for s in rep["steps"]] == ["decompose", "ppl"]
    assert all(s["cpu_seconds"] > 0 and s["seconds"] > 0 for s in rep["steps"])


def test_clean_errors(tiny, tmp_path, capsys):
    folder, text = tiny
    assert main(["eval", "pseudo-decode", "--model", folder, "--text", text, "--methods", "nope"]) == 2
    assert "unknown preset 'nope'" in capsys.readouterr().err
    assert main(["eval", "pseudo-decode", "--model", folder, "--text", text, "--mode", "sideways"]) == 2
    assert "--mode" in capsys.readouterr().err
    cfg = tmp_path / "bad.json"
    cfg.write_text(json.dumps({"analyses": {"ppl": {"windw": 3}}}))
    assert main(["eval", "report", "--config", str(cfg), "--out", str(tmp_path / "r")]) == 2
    assert "unknown option 'windw'" in capsys.readouterr().err
