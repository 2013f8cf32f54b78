"""Run vLLM's `LLM` once in a fresh process (a helper of the engine tests, not a test).

    python tests/vllm/run_llm.py JOB.json OUT.json

JOB: {"llm": {LLM kwargs}, "prompts": [[token ids]], "max_tokens": n,
      "score": [[token ids]] (optional), "score_last": m}
OUT: {"tokens": greedy continuations, "top1": for each scored sequence, the engine's top-1 prediction of each of
its last m tokens from the tokens before it (teacher forcing, through prompt logprobs)}

Its own process because vLLM starts its engine with "spawn", which re-imports __main__, and so that each
configuration (plugin on or off) resolves its attention backend afresh. vLLM logs to stdout/stderr, where the tests
read its KV capacity report.
"""

from __future__ import annotations

import json
import sys


def top1(entry: dict) -> int:
    return next(tok for tok, lp in entry.items() if lp.rank == 1)


def main() -> None:
    from vllm import LLM, SamplingParams

    with open(sys.argv[1]) as f:
        job = json.load(f)
    llm = LLM(**job["llm"])
    results = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]],
                           SamplingParams(temperature=0.0, max_tokens=job["max_tokens"]), use_tqdm=False)
    out = {"tokens": [list(r.outputs[0].token_ids) for r in results]}
    if job.get("score"):
        m = job["score_last"]
        scored = llm.generate([{"prompt_token_ids": s} for s in job["score"]],
                              SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
        out["top1"] = [[top1(e) for e in r.prompt_logprobs[-m:]] for r in scored]
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
