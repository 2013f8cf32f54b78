"""How far vLLM's greedy logprobs move between a batched run and single requests (not a test; run in .venv-vllm).

    .venv-vllm/bin/python -m kvarn.bench.vllm_batch_variance stock|kvarn   # from the checkout (reads its tests)

The four prompts of the engine tests (tests/integrations/vllm/engine_common.py), 32 greedy tokens each, offline
`LLM` with the engine tests' settings (bf16, 1 GiB KV, no prefix caching): all four in one `generate`, then each
alone. Prints
whether the tokens agree, the largest change of a chosen token's logprob before any divergence, and the top-3
logprobs around the first divergence. `stock` loads no plugin; `kvarn` serves kvarn-k4v2-g128. On the CPU, vLLM's
bf16 layers are not batch-invariant, which bounds what test_engine_server.py may ask of concurrent requests.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "integrations" / "vllm"))  # engine tests
    which = sys.argv[1] if len(sys.argv) > 1 else "stock"
    if which not in ("stock", "kvarn"):
        raise SystemExit("usage: python -m kvarn.bench.vllm_batch_variance stock|kvarn")
    from engine_common import ENV

    os.environ.update(ENV)
    if which == "stock":
        os.environ["VLLM_PLUGINS"] = ""
    from engine_common import llm_kwargs, prompts
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    extra = None if which == "stock" else {"kvarn": {"preset": "kvarn-k4v2-g128"}}
    llm = LLM(**llm_kwargs(extra, enable_prefix_caching=False))
    sp = SamplingParams(max_tokens=32, temperature=0, logprobs=3)
    ps = [TokensPrompt(prompt_token_ids=p) for p in prompts()]
    together = [o.outputs[0] for o in llm.generate(ps, sp)]
    alone = [llm.generate([p], sp)[0].outputs[0] for p in ps]
    worst = 0.0
    for i, (a, b) in enumerate(zip(together, alone)):
        n = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        for j in range(len(a.token_ids) if n is None else n):
            worst = max(worst, abs(a.logprobs[j][a.token_ids[j]].logprob - b.logprobs[j][b.token_ids[j]].logprob))
        print(f"prompt {i}: {'tokens equal' if n is None else f'first divergence at step {n}'}")
        if n is not None:
            for name, out in (("together", a), ("alone", b)):
                top = sorted(((v.logprob, k) for k, v in out.logprobs[n].items()), reverse=True)[:3]
                print(f"    {name:8s} step {n}: " + ", ".join(f"{k}: {lp:.4f}" for lp, k in top))
    print(f"{which}: largest |logprob together - alone| of a chosen token before any divergence: {worst:.4f} nats")


if __name__ == "__main__":
    main()
