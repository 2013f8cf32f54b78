"""cProfile of one `LLM.generate` batch in vLLM, stock or with a kvarn preset, in this process (vLLM's engine core and
worker run in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0), so the profile covers the attention backend's Python and
kernels. Needs vLLM (`make vllm-venv`).

    PYTHONPATH=$PWD .venv-vllm/bin/python scripts/vllm_profile.py PRESET|stock [NEW_TOKENS] [--out FILE]
        [--requests 8] [--prompt-tokens 512] [--kv-mib 1024] [--max-num-seqs R] [--dtype bfloat16]

R requests (default 8) of P prompt tokens (default 512) of `pydoc_data.topics` prose (each from its own offset) +
NEW_TOKENS (default 64) greedy tokens, SmolLM2-135M-Instruct, bfloat16 (or --dtype), a KV budget of --kv-mib
(default 1 GiB), max_num_seqs R (or --max-num-seqs: a smaller budget and more requests than fit is the memory-bound
run of `kvarn bench vllm`), enforce_eager; one short warm-up request first. Prints the wall time and tokens/s, then
cProfile's top lines by cumulative and by own time; --out FILE keeps the raw stats (`pstats`). Used for docs/VLLM.md
("Throughput").
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def warm_engine(preset: str, new: int, requests: int = 8, prompt_tokens: int = 512, kv_mib: int = 1024,
                max_num_seqs: int | None = None, dtype: str = "bfloat16"):
    """(llm, prompts): SmolLM2's engine in this process, stock or with `preset`, after one short warm-up request;
    `requests` prompts of `prompt_tokens` tokens of prose (module docstring). Also used by scripts/vllm_timers.py."""
    import pydoc_data.topics

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from kvarn.bench.vllm import resolve_dtype
    from kvarn.integrations.vllm import register
    from kvarn.models import resolve

    dtype = resolve_dtype(dtype)  # "auto" as `kvarn bench vllm` means it, not as vLLM does (the model's dtype)
    register()
    path = str(resolve("smollm2"))
    ids = AutoTokenizer.from_pretrained(path)(" ".join(pydoc_data.topics.topics.values()))["input_ids"]
    prompts = [ids[1000 * r:1000 * r + prompt_tokens] for r in range(requests)]
    kw = dict(model=path, dtype=dtype, max_model_len=prompt_tokens + new + 16, max_num_seqs=max_num_seqs or requests,
              enforce_eager=True, seed=0, kv_cache_memory_bytes=kv_mib << 20)
    if preset != "stock":
        kw["additional_config"] = {"kvarn": {"preset": preset}}
    llm = LLM(**kw)
    llm.generate([{"prompt_token_ids": prompts[0][:32]}], SamplingParams(temperature=0.0, max_tokens=2),
                 use_tqdm=False)
    return llm, prompts


def main() -> None:
    import torch
    from vllm import SamplingParams

    from kvarn.bench.vllm import DTYPES

    ap = argparse.ArgumentParser()
    ap.add_argument("preset")
    ap.add_argument("new", nargs="?", type=int, default=64)
    ap.add_argument("--out")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--kv-mib", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int)
    ap.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    a = ap.parse_args()
    preset, new, out, n = a.preset, a.new, a.out, a.requests
    llm, prompts = warm_engine(preset, new, n, a.prompt_tokens, a.kv_mib, a.max_num_seqs, a.dtype)
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.runcall(llm.generate, [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    print(f"{preset}: {torch.get_num_threads()} threads, wall {wall:.2f} s, {n * new / wall:.1f} generated tokens/s")
    if out:
        prof.dump_stats(out)
    stats = pstats.Stats(prof)
    stats.sort_stats("cumulative").print_stats(45)
    stats.sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
