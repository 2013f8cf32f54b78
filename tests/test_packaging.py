"""The library apart from the lab: what a bare `pip install kvarn` must give (the full story, in a fresh venv, is
scripts/install_check.sh, run by `make test`; these are its fast parts on the checkout)."""

from __future__ import annotations

import fnmatch
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvarn.cli import main
from kvarn.eval.schema import SCHEMAS, load_schema

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "PYTHONPATH": path, **extra}


def test_core_imports_without_the_lab_dependencies():
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "core_imports.py")], env=_env(),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr


def test_package_data_ships_the_kernel_sources_and_the_schemas():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["kvarn"]
    shipped = {p.relative_to(ROOT / "kvarn").as_posix() for p in (ROOT / "kvarn").rglob("*")
               if any(fnmatch.fnmatch(p.relative_to(ROOT / "kvarn").as_posix(), g) for g in data)}
    sources = {f"kernels/cpu/{p.name}" for p in (ROOT / "kvarn" / "kernels" / "cpu").glob("*.cpp")}
    schemas = {f"eval/schemas/{p.name}" for p in (ROOT / "kvarn" / "eval" / "schemas").glob("*.json")}
    assert sources and schemas and sources | schemas <= shipped, (sources | schemas) - shipped
    for path in schemas:  # each one read as package data
        assert load_schema(Path(path).name.removesuffix(".schema.json"))["type"] == "object"
    assert not (ROOT / "docs" / "schemas").exists() and SCHEMAS.is_dir()


# as on a bare install: the lab's packages absent (tqdm stays, transformers needs it)
BARE = "import sys; sys.modules.update(dict.fromkeys(('matplotlib', 'rich', 'gguf', 'accelerate'))); "


def test_presets_on_a_bare_install_never_compile_the_extension(tmp_path):
    run = subprocess.run([sys.executable, "-c", BARE + "from kvarn.cli import main; sys.exit(main(['presets']))"],
                         cwd=tmp_path, env=_env(KVARN_CACHE=str(tmp_path / "cache")), capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert "kvarn-k2v2-g128" in run.stdout and "bits/elem" in run.stdout
    assert not (tmp_path / "cache" / "torch_extensions").exists()


def test_presets_table_without_rich(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "rich.table", None)  # as on a bare install: importing it fails
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    assert "bits/elem" in out and "kvarn-k2v2-g128" in out and "│" not in out


@pytest.mark.parametrize(("missing", "extra"), [("matplotlib.pyplot", "lab"), ("gguf", "models")])
def test_a_missing_extra_is_named(monkeypatch, capsys, missing, extra):
    import kvarn.commands.presets as command

    def run(args):
        raise ModuleNotFoundError(f"No module named {missing!r}", name=missing)

    monkeypatch.setattr(command, "run", run)
    assert main(["presets"]) == 3
    assert f"pip install 'kvarn[{extra}]'" in capsys.readouterr().err
