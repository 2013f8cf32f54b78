"""Run vLLM's `LLM` once in a fresh process and write its greedy tokens as JSON (a helper of the engine tests).

    python tests/vllm/run_llm.py OUT.json '{"dtype": "bfloat16", ...LLM kwargs}' '{"max_tokens": 24}' PROMPTS.json

Run as its own process because vLLM spawns its engine with the start method "spawn", which re-imports __main__, and
so that each configuration (plugin on or off) resolves its backend afresh. vLLM's own log goes to stdout/stderr,
where the tests read its KV capacity report.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    out, llm_kwargs, sampling, prompts_file = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
    from vllm import LLM, SamplingParams

    with open(prompts_file) as f:
        prompts = json.load(f)
    llm = LLM(**llm_kwargs)
    results = llm.generate(prompts, SamplingParams(temperature=0.0, **sampling), use_tqdm=False)
    data = {"tokens": [list(r.outputs[0].token_ids) for r in results],
            "prompt_tokens": [list(r.prompt_token_ids) for r in results]}
    with open(out, "w") as f:
        json.dump(data, f)


if __name__ == "__main__":
    main()
