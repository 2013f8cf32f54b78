"""The command line under fuzzed options and input files: every run either succeeds (exit 0) or ends with exit 2 and
one clear line naming the problem (argparse's usage error or `kvarn <command>: error: ...`), never a traceback.
Hypothesis is derandomized (tests/conftest.py), so CI cannot fail by chance."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvarn.cli import main
from kvarn.presets import preset_names
from tests.helpers import tiny_model_folder

FUZZ = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# preset lists: real names, near misses and junk, comma-joined
NAMES = st.sampled_from([*preset_names()[:8], "kvarn-k3v2-g128", "kvarn-k2v2-g0", "rtn-k2v2-g127", "", " ", "fp16,,",
                         "kvarn-k2v2-g128;rm", "KVARN", "kvarn-k99v2-g128"])
PRESETS = st.lists(NAMES, min_size=1, max_size=3).map(",".join)


def run(argv: list[str], capsys) -> tuple[int, str]:
    """(exit code, stderr) of `kvarn argv`, argparse's SystemExit included."""
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 2
    return rc, capsys.readouterr().err


def check(rc: int, err: str) -> None:
    assert rc in (0, 2), (rc, err)
    if rc == 2:
        last = err.strip().splitlines()[-1]
        assert last.startswith("kvarn") and "error" in last, err
        assert "Traceback" not in err


@FUZZ
@given(head_dim=st.integers(-3, 300))
def test_presets_head_dim(head_dim, capsys):
    check(*run(["presets", "--head-dim", str(head_dim)], capsys))


@FUZZ
@given(head_dim=st.sampled_from(["64", "96", "0", "-64", "63", "abc", "1e3", "2"]), tiles=st.integers(-1, 2),
       heads=st.integers(-1, 2), presets=PRESETS)
def test_quantize_demo_options(head_dim, tiles, heads, presets, capsys):
    check(*run(["quantize-demo", "--head-dim", head_dim, "--tiles", str(tiles), "--heads", str(heads),
                "--presets", presets], capsys))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("cli_fuzz"), "llama", ["alpha", "beta"], 400)[0]


@FUZZ
@given(content=st.one_of(st.binary(max_size=64), st.text(max_size=64).map(str.encode)),
       max_len=st.sampled_from(["0", "-5", "8", "x", "100000"]), methods=PRESETS)
def test_eval_decode_input_files(tiny, tmp_path_factory, content, max_len, methods, capsys):
    """Text files of random bytes (invalid UTF-8, empty, too short), bad lengths and preset lists."""
    text = tmp_path_factory.mktemp("text") / "t.txt"
    text.write_bytes(content)
    out = tmp_path_factory.mktemp("out")
    check(*run(["eval", "decode", "--model", tiny, "--text", str(text), "--max-len", max_len, "--methods", methods,
                "--out", str(out), "--threads", "1"], capsys))
