"""Shared pieces of the analyses: text, divergences, results files with provenance."""

from __future__ import annotations

import json
import platform
import subprocess
import time
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import torch

DEFAULT_TEXT = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "wikitext-2" / "test.txt"


def default_text_path() -> Path:
    """WikiText-2 test beside the checkout (`../shared/data/wikitext-2/test.txt`), if present."""
    if not DEFAULT_TEXT.exists():
        raise ValueError(f"no default text at {DEFAULT_TEXT}; pass --text FILE")
    return DEFAULT_TEXT


def load_tokens(tokenizer, path: str | Path | None, max_tokens: int, offset_chars: int = 0) -> torch.Tensor:
    """The first `max_tokens` tokens of a text file, tokenized with default special tokens, [1, T]."""
    path = Path(path) if path else default_text_path()
    if not path.exists():
        raise ValueError(f"text file not found: {path}")
    text = path.read_text(encoding="utf-8")[offset_chars:]
    # read only as much text as needed (about 8 chars per token is generous for English)
    ids = tokenizer(text[: max(4096, max_tokens * 8)], return_tensors="pt").input_ids
    if ids.shape[1] < max_tokens:
        ids = tokenizer(text, return_tensors="pt").input_ids
    if ids.shape[1] < max_tokens:
        raise ValueError(f"{path} has only {ids.shape[1]} tokens, fewer than the {max_tokens} asked for")
    return ids[:, :max_tokens]


def kl_divergence(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(p_ref || p) over the last axis, in float64, per position."""
    lp_ref = torch.log_softmax(ref_logits.double(), dim=-1)
    lp = torch.log_softmax(logits.double(), dim=-1)
    return (lp_ref.exp() * (lp_ref - lp)).sum(-1)


def git_revision() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


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
        "machine": f"{platform.machine()} {platform.processor() or ''} threads={torch.get_num_threads()}".strip(),
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
