"""cProfile of one `LLM.generate` batch in vLLM, stock or with a kvarn preset, in this process (vLLM's engine core and
worker run in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0), so the profile covers the attention backend's Python and
kernels. Needs vLLM (`make vllm-venv`).

    PYTHONPATH=$PWD .venv-vllm/bin/python scripts/vllm_profile.py PRESET|stock [NEW_TOKENS] [--out FILE]

8 requests of 512 prompt tokens of `pydoc_data.topics` prose (each from its own offset) + NEW_TOKENS (default 64)
greedy tokens, SmolLM2-135M-Instruct, bfloat16, a 1 GiB KV budget, max_num_seqs 8, enforce_eager; one short warm-up
request first. Prints the wall time and tokens/s, then cProfile's top lines by cumulative and by own time;
--out FILE keeps the raw stats (`pstats`). Used for docs/VLLM.md ("Throughput").
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def main() -> None:
    import pydoc_data.topics

    import torch
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from kvarn.integrations.vllm import register
    from kvarn.models import resolve

    args = [a for i, a in enumerate(sys.argv[1:]) if sys.argv[i] != "--out" and a != "--out"]
    preset, new = args[0], int(args[1]) if len(args) > 1 else 64
    out = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else None
    register()
    path = str(resolve("smollm2"))
    ids = AutoTokenizer.from_pretrained(path)(" ".join(pydoc_data.topics.topics.values()))["input_ids"]
    prompts = [ids[1000 * r:1000 * r + 512] for r in range(8)]
    kw = dict(model=path, dtype="bfloat16", max_model_len=512 + new + 16, max_num_seqs=8, enforce_eager=True, seed=0,
              kv_cache_memory_bytes=1 << 30)
    if preset != "stock":
        kw["additional_config"] = {"kvarn": {"preset": preset}}
    llm = LLM(**kw)
    llm.generate([{"prompt_token_ids": prompts[0][:32]}], SamplingParams(temperature=0.0, max_tokens=2),
                 use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.runcall(llm.generate, [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    print(f"{preset}: {torch.get_num_threads()} threads, wall {wall:.2f} s, {8 * new / wall:.1f} generated tokens/s")
    if out:
        prof.dump_stats(out)
    stats = pstats.Stats(prof)
    stats.sort_stats("cumulative").print_stats(45)
    stats.sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
