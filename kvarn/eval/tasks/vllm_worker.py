"""One vLLM engine of the `vllm` protocol of `kvarn eval tasks`, in its own process (each method must resolve its
attention backend afresh; as `kvarn.bench.vllm_run`); the engine core runs in this process too
(`cpu_engine_env(in_process=True)`: no second interpreter to start).

    python -m kvarn.eval.tasks.vllm_worker JOB.json OUT.json
JOB: {"llm": LLM kwargs, "requests": [{"prompt": [ids], "max_tokens": n, "stop": [str], "gold": [ids] | null}],
      "eos": [ids]}
OUT: {"answers": [{"tokens": [ids], "text": str, "gold_logprob": float | null, "seconds": float}], "start_s": float}
(whether the plugin served the engine is read from its log by `vllm_protocol.run_engine`)
Every request is submitted at once (vLLM batches them and feeds prompts in chunks of max_num_batched_tokens),
greedy, ending at an EOS id or a stop string (kept in the answer, as the serving protocol keeps it). The gold
answer's log-probability is vLLM's own prompt_logprobs over prompt + gold (one more request each, teacher-forced
through the same engine, so through the plugin's quantized pages for a kvarn method). Nothing else is timed.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time


def main() -> None:
    from vllm import LLM, SamplingParams

    from kvarn.integrations.vllm import register

    register()  # as the entry point does; also for a checkout on PYTHONPATH
    with open(sys.argv[1]) as f:
        job = json.load(f)
    t = time.perf_counter()
    llm = LLM(**{"disable_log_stats": True, **job["llm"]})
    start = time.perf_counter() - t
    reqs = job["requests"]
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], stop=r["stop"] or None,
                             stop_token_ids=job["eos"], skip_special_tokens=True,
                             include_stop_str_in_output=True) for r in reqs]
    t = time.perf_counter()
    res = llm.generate([{"prompt_token_ids": r["prompt"]} for r in reqs], params, use_tqdm=False)
    per = (time.perf_counter() - t) / max(len(reqs), 1)
    gold_lp: list[float | None] = [None] * len(reqs)
    with_gold = [i for i, r in enumerate(reqs) if r["gold"]]
    if with_gold:
        tf = llm.generate([{"prompt_token_ids": reqs[i]["prompt"] + reqs[i]["gold"]} for i in with_gold],
                          SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        for i, r in zip(with_gold, tf, strict=True):
            gold = reqs[i]["gold"]
            entries = r.prompt_logprobs[-len(gold):]
            gold_lp[i] = float(sum(e[g].logprob for e, g in zip(entries, gold, strict=True)))
    answers = [{"tokens": list(r.outputs[0].token_ids), "text": r.outputs[0].text, "gold_logprob": lp,
                "seconds": per} for r, lp in zip(res, gold_lp, strict=True)]
    with open(sys.argv[2], "w") as f:
        json.dump({"answers": answers, "start_s": start}, f)
    # vLLM's CPU engine may abort in its C++ teardown at interpreter exit ("terminate called without an active
    # exception", exit -6: seen in CI) after all is done; stop the engine core now and leave without that teardown
    with contextlib.suppress(Exception):  # the results are written: a failing shutdown changes nothing in them
        llm.llm_engine.engine_core.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
