"""Shared pieces of the analyses: text, divergences, results files with provenance."""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import platform
import random
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import torch

from kvarn.presets import Preset, get_preset

# Every Python ships it: the topic texts of the Python documentation (plain English prose with some code),
# ~465 KB / ~100k tokens on 3.11. WikiText-2 or any other text through --text FILE.
DEFAULT_TEXT = f"pydoc_data.topics (Python {sys.version_info.major}.{sys.version_info.minor})"


def default_text() -> str:
    """The default text: the standard library's `pydoc_data.topics`, topic texts joined in sorted key order
    (deterministic for a given Python version)."""
    try:
        from pydoc_data.topics import topics
    except ImportError as e:  # a few distributions strip it; say so instead of failing obscurely
        raise ValueError(f"this Python has no pydoc_data.topics ({e}); pass --text FILE") from e
    return "\n\n".join(topics[k] for k in sorted(topics))


def text_name(path: str | Path | None) -> str:
    """How results files name the text: the --text path, else DEFAULT_TEXT."""
    return str(path) if path else DEFAULT_TEXT


def load_tokens(tokenizer, path: str | Path | None, max_tokens: int, offset_chars: int = 0) -> torch.Tensor:
    """The first `max_tokens` tokens of a text file (None: `default_text()`), tokenized with default special
    tokens, [1, T]."""
    if path:
        path = Path(path)
        if not path.exists():
            raise ValueError(f"text file not found: {path}")
        text = path.read_text(encoding="utf-8")
    else:
        text = default_text()
    text = text[offset_chars:]
    # read only as much text as needed (about 8 chars per token is generous for English)
    ids = tokenizer(text[: max(4096, max_tokens * 8)], return_tensors="pt").input_ids
    if ids.shape[1] < max_tokens:
        ids = tokenizer(text, return_tensors="pt").input_ids
    if ids.shape[1] < max_tokens:
        raise ValueError(f"{text_name(path)} has only {ids.shape[1]} tokens (from character {offset_chars}), "
                         f"fewer than the {max_tokens} asked for")
    return ids[:, :max_tokens]


def kl_divergence(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(p_ref || p) over the last axis, in float64, per position."""
    return kl_from_log_probs(log_probs(ref_logits), log_probs(logits))


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """log softmax over the last axis, in float64."""
    return torch.log_softmax(logits.double(), dim=-1)


def kl_from_log_probs(lp_ref: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    """KL(p_ref || p) = sum exp(lp_ref) (lp_ref - lp) over the last axis, from float64 log-probabilities (lets a
    caller comparing many runs with one reference compute each log softmax once)."""
    return (lp_ref.exp() * (lp_ref - lp)).sum(-1)


def git_revision() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo; else what platform knows): timings differ between machines of one kind."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model")) and ":" in line:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def provenance(**config: Any) -> dict[str, Any]:
    """What a results file records besides the results: config, versions, revision, machine, time."""
    import transformers

    import kvarn

    return {
        "config": config,
        "kvarn": kvarn.__version__,
        "git": git_revision(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": f"{platform.machine()} {cpu_model()} threads={torch.get_num_threads()}",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def _default(o: Any) -> Any:
    if is_dataclass(o):
        return asdict(o)
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def write_json(path: str | Path, obj: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=_default) + "\n")
    return path


@torch.no_grad()
def capture_kv(model, input_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Full-precision (post-RoPE) keys and values of every attention layer, each [B, H_kv, T, D]."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    model(input_ids=input_ids, cache=cache, use_cache=True)
    return [(layer.keys, layer.values) for layer in cache.layers]


# --- pieces every `kvarn eval` analysis shares ---------------------------------------------------------


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {n}")
    return n


def int_list(text: str) -> list[int]:
    """argparse type: comma-separated integers >= 1 ("100,200")."""
    return [positive_int(t) for t in text.split(",") if t.strip()]


def add_common_arguments(parser: argparse.ArgumentParser, *, methods: str, command: str) -> None:
    """--model, --text, --methods, --out, --seed, --sink, --threads: the same meaning in every analysis."""
    parser.add_argument("--model", default="default", help="named model, HF id or folder (default: embedded SmolLM2)")
    parser.add_argument("--text", default=None, help=f"text file (default: {DEFAULT_TEXT})")
    parser.add_argument("--methods", default=methods, help=f"comma-separated preset names (default: {methods})")
    parser.add_argument("--out", default=f"out/eval/{command}", help="output folder (JSON, summary.md, PNGs)")
    parser.add_argument("--seed", type=int, default=0, help="seed of every random choice (default: 0)")
    parser.add_argument("--sink", type=int, default=None, help="override every preset's full-precision sink")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch CPU threads (default: torch's; 1 is fastest on a busy shared machine)")


def parse_methods(text: str | list[str]) -> list[Preset]:
    """Comma-separated preset names -> presets (order kept, duplicates dropped); get_preset validates."""
    names = text if isinstance(text, list) else [t.strip() for t in text.split(",")]
    names = list(dict.fromkeys(n for n in names if n))
    if not names:
        raise ValueError("--methods is empty; give comma-separated preset names, e.g. rtn,kvarn")
    return [get_preset(n) for n in names]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def result_header(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """The first fields of every analysis's JSON: its name, the provenance of the run (all options), the model."""
    return {"analysis": command, "provenance": provenance(**{k: v for k, v in vars(args).items() if k != "func"}),
            "model": args.model}


def publish(result: dict, json_path: str | Path, out: str | Path, md: str) -> None:
    """Write an analysis's JSON and its markdown summary (`out`/summary.md), and print the summary."""
    write_json(json_path, result)
    Path(out, "summary.md").write_text(md)
    print(md)


def setup(args: argparse.Namespace) -> None:
    """Seed every generator with --seed, apply --threads and limit heap fragmentation, before an analysis runs."""
    seed_everything(args.seed)
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    release_freed_buffers()


def release_freed_buffers(threshold: int = 128 * 1024) -> bool:
    """glibc only: serve every allocation >= `threshold` bytes with mmap, so freed buffers go back to the OS.

    Caches grow by concatenation at every block, so each step frees a buffer slightly smaller than the next one;
    glibc's adaptive mmap threshold then moves such buffers onto the heap, which fragments. Measured on the
    embedded model (one quantized run + reference over 2,048 tokens): RSS growth 1.52 GB -> 0.56 GB; a 4k
    pseudo-decode of 13 runs reached 13 GB at half length without it. Returns whether the setting applied.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-3, threshold))  # M_MMAP_THRESHOLD; fixing it also disables the adaptation
    except (OSError, AttributeError):
        return False


def markdown_table(header: list[str], rows: list[list[Any]], digits: int = 4) -> str:
    """A GitHub markdown table; floats shown with `digits` significant digits."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return "nan" if math.isnan(v) else f"{v:.{digits}g}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def progress(iterable: Iterable[Any] | None = None, **kwargs: Any):
    """tqdm on stderr (set TQDM_DISABLE=1 to silence)."""
    from tqdm.auto import tqdm

    return tqdm(iterable, dynamic_ncols=True, **kwargs)
