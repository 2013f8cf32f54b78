"""One vLLM engine of `kvarn bench vllm`, in its own process (vLLM starts its engine with "spawn", and each
configuration must resolve its attention backend afresh).

    python -m kvarn.bench.vllm_run JOB.json OUT.json
JOB: {"llm": LLM kwargs, "prompts": [[token ids]], "max_tokens": n}
OUT: {"start_s", "warmup_s", "wall_s", "generated_tokens", "requests"}: all prompts submitted at once (one
`generate` call: vLLM batches them continuously), greedy, ignore_eos so every request makes exactly n tokens; one
short untimed request first.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    from vllm import LLM, SamplingParams

    with open(sys.argv[1]) as f:
        job = json.load(f)
    t = time.perf_counter()
    llm = LLM(**job["llm"])
    start = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": job["prompts"][0][:32]}], SamplingParams(temperature=0.0, max_tokens=2),
                 use_tqdm=False)
    warm = time.perf_counter() - t
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    t = time.perf_counter()
    res = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], params, use_tqdm=False)
    wall = time.perf_counter() - t
    out = {"start_s": start, "warmup_s": warm, "wall_s": wall, "requests": len(res),
           "generated_tokens": sum(len(r.outputs[0].token_ids) for r in res)}
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
