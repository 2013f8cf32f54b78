"""What the engine tests share: the model folder, the prompts, the environment of a CPU vLLM run."""

from __future__ import annotations

PRESET = "kvarn-k4v2-g128"
MAX_NEW = 32
LENGTHS = (150, 300, 400, 520)  # prompt tokens: the first stays within sink + one block, the others cross blocks
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def model_dir() -> str:
    from kvarn.models import resolve

    return str(resolve("default"))


def prompts() -> list[list[int]]:
    """Token ids of English prose from the standard library's pydoc topics, one text per prompt."""
    import pydoc_data.topics

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir())
    topics = pydoc_data.topics.topics
    texts = [topics[k] for k in ("assignment", "exceptions", "naming", "integers")]
    return [tok(t)["input_ids"][:n] for t, n in zip(texts, LENGTHS)]
