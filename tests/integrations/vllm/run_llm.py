"""Run vLLM's `LLM` once in a fresh process (a helper of the engine tests, not a test).

    python tests/integrations/vllm/run_llm.py JOB.json OUT.json

JOB: {"llm": {LLM kwargs}, "prompts": [[token ids]], "max_tokens": n}
OUT: {"tokens": greedy continuations, "generate_seconds": wall time of the generate call (engine start excluded)}

Its own process so that each configuration (plugin on or off) resolves its attention backend afresh, and because
vLLM spawns processes (tensor-parallel ranks; the engine core where VLLM_ENABLE_V1_MULTIPROCESSING is on; the tests
turn it off: engine_common.IN_PROCESS), which re-import __main__. vLLM logs to stdout/stderr, where the tests
read its KV capacity report.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    from vllm import LLM, SamplingParams

    with open(sys.argv[1]) as f:
        job = json.load(f)
    llm = LLM(**job["llm"])
    t = time.perf_counter()
    results = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]],
                           SamplingParams(temperature=0.0, max_tokens=job["max_tokens"]), use_tqdm=False)
    out = {"tokens": [list(r.outputs[0].token_ids) for r in results], "generate_seconds": time.perf_counter() - t}
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
