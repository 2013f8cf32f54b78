"""The text the analyses and benchmarks read: a file, or by default one every Python ships."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

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
