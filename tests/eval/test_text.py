"""The default text of every analysis: the standard library's `pydoc_data.topics`, nothing outside the checkout."""

from __future__ import annotations

import sys
from pydoc_data.topics import topics

import pytest
import torch

from kvarn.eval.text import DEFAULT_TEXT, default_text, load_tokens, text_name


def test_default_text_is_the_topics_in_sorted_key_order():
    text = default_text()
    assert text == default_text()  # deterministic
    pos = 0
    for k in sorted(topics):  # each topic follows the previous one, separated by a blank line
        assert text.startswith(topics[k], pos), k
        pos += len(topics[k]) + 2
    assert pos - 2 == len(text)
    assert len(text) > 300_000  # ~465 KB on 3.11: room for the longest default (8,192 tokens) several times over
    assert text_name(None) == DEFAULT_TEXT == f"pydoc_data.topics (Python {sys.version_info[0]}.{sys.version_info[1]})"
    assert text_name("some/file.txt") == "some/file.txt"


@pytest.mark.model
def test_default_text_holds_the_tokens_the_analyses_ask_for():
    """8,192 tokens of the embedded tokenizer from the start, and 640 from 200,000 characters in (test_policy's
    furthest offset); the same ids as tokenizing the text directly."""
    from transformers import AutoTokenizer

    from kvarn.models import resolve

    tok = AutoTokenizer.from_pretrained(resolve("default"))
    ids = load_tokens(tok, None, 8192)
    assert ids.shape == (1, 8192)
    assert torch.equal(ids, tok(default_text()[:150_000], return_tensors="pt").input_ids[:, :8192])
    assert load_tokens(tok, None, 640, offset_chars=200_000).shape == (1, 640)


def test_missing_or_short_text_is_a_clear_error(tmp_path):
    class Words:  # a whitespace tokenizer: enough to count tokens
        def __call__(self, text, return_tensors=None):
            return type("Enc", (), {"input_ids": torch.arange(len(text.split()))[None]})()

    with pytest.raises(ValueError, match="text file not found"):
        load_tokens(Words(), tmp_path / "nope.txt", 10)
    short = tmp_path / "short.txt"
    short.write_text("a b c")
    with pytest.raises(ValueError, match=r"short\.txt has only 3 tokens .*fewer than the 10"):
        load_tokens(Words(), short, 10)
