"""Shared fixtures: the test seed, tiny random models of each family, the real model.

Seeds are fixed by default (SEED, printed in the header), so a run is reproducible and CI is deterministic.
`KVARN_RANDOM_SEED=1` draws a fresh seed per session (printed) to explore other inputs; `KVARN_SEED=N` replays
one. Every test starts with Python's and torch's global generators seeded from it (`_seed_globals`), and
hypothesis runs derandomized unless a random seed was asked for."""

from __future__ import annotations

import os
import random

# The Triton kernel tests run on Triton's CPU interpreter, which must be chosen before anything (transformers, via
# test_attention) first imports triton: triton's own @jit library is decorated at import. CPU code never uses it.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from hypothesis import settings

SEED = 0  # the default seed of every test


def _session_seed() -> int:
    if "KVARN_SEED" in os.environ:
        return int(os.environ["KVARN_SEED"])
    if os.environ.get("KVARN_RANDOM_SEED") == "1":
        return random.SystemRandom().randrange(2**31)
    return SEED


TEST_SEED = _session_seed()
# hypothesis draws its own examples: derandomized (a fixed sequence) unless random seeds are asked for
settings.register_profile("kvarn", derandomize=os.environ.get("KVARN_RANDOM_SEED") != "1")
settings.load_profile("kvarn")


def pytest_report_header(config) -> str:
    how = "random, KVARN_RANDOM_SEED=1" if os.environ.get("KVARN_RANDOM_SEED") == "1" else "fixed"
    return f"kvarn test seed: {TEST_SEED} ({how}; replay with KVARN_SEED={TEST_SEED})"


@pytest.fixture(autouse=True)
def _seed_globals() -> None:
    """Seed Python's and torch's global generators before every test, so no test depends on execution order."""
    random.seed(TEST_SEED)
    torch.manual_seed(TEST_SEED)


# One thread by default: on a loaded 2-core machine, OpenMP spin-waits make small ops up to 20x slower with 2.
torch.set_num_threads(int(os.environ.get("KVARN_TEST_THREADS", "1")))

# Tiny configs per family; head_dim given explicitly. Random weights, built offline from the config.
TINY_FAMILIES: dict[str, dict] = {
    "llama": dict(model_type="llama"),
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3"),
    "mistral": dict(model_type="mistral", sliding_window=None),
    "phi3": dict(model_type="phi3"),
    "gemma2": dict(model_type="gemma2", sliding_window=4096, query_pre_attn_scalar=64),
    "gemma3": dict(model_type="gemma3_text", sliding_window=4096, query_pre_attn_scalar=64),
}


@pytest.fixture
def seed() -> int:
    """The session's test seed (SEED unless KVARN_RANDOM_SEED=1 or KVARN_SEED=N); printed, so a failure shows it."""
    torch.manual_seed(TEST_SEED)
    print(f"seed={TEST_SEED} (replay with KVARN_SEED={TEST_SEED})")
    return TEST_SEED


def make_tiny_model(family: str = "llama", *, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                    head_dim: int = 64, hidden: int = 128, vocab: int = 256, seed: int = 0, **overrides):
    """A random-weight causal LM of `family`, float32, eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(TINY_FAMILIES[family])
    model_type = spec.pop("model_type")
    cfg = AutoConfig.for_model(
        model_type, vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=4096,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, **{**spec, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return model.eval()


def tiny_model_folder(folder, family: str, words: list[str], n_words: int, seed: int = TEST_SEED) -> tuple[str, str]:
    """Save a tiny random `family` model (weights from `seed`) with the embedded model's tokenizer into `folder`, and
    a text file of `n_words` words drawn from `words` with `seed`. Returns (model folder, text path)."""
    from transformers import AutoTokenizer

    from kvarn.models import resolve

    tok = AutoTokenizer.from_pretrained(resolve("default"))
    model = make_tiny_model(family, layers=2, heads=4, kv_heads=2, head_dim=64, hidden=64, vocab=len(tok),
                            seed=seed)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    rng = random.Random(seed)
    text = folder / "text.txt"
    text.write_text(" ".join(rng.choice(words) for _ in range(n_words)))
    return str(folder), str(text)


@pytest.fixture(scope="session")
def real_model():
    """The embedded SmolLM2-135M-Instruct (converted once to a HF folder under the kvarn cache)."""
    from kvarn.models import load_model

    return load_model("default")
