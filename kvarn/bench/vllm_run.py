"""One vLLM engine of `kvarn bench vllm`, in its own process (vLLM starts its engine with "spawn", and each
configuration must resolve its attention backend afresh).

    python -m kvarn.bench.vllm_run JOB.json OUT.json
JOB: {"llm": LLM kwargs, "prompts": [[token ids]], "max_tokens": n}
OUT: {"start_s", "warmup_s", "wall_s", "generated_tokens", "requests", "ttft_mean_s", "tpot_mean_s",
"preemptions"}: all prompts submitted at once (one `generate` call: vLLM batches them continuously and queues what
does not fit), greedy, ignore_eos so every request makes exactly n tokens; one short untimed request first.
TTFT and TPOT are vLLM's own per-request stats (`RequestOutput.metrics`, stats logging on): TTFT from arrival to the
first token (queueing included), TPOT = (last token - first token) / (n - 1); preemptions: vLLM's counter.
"""

from __future__ import annotations

import json
import sys
import time


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def main() -> None:
    from vllm import LLM, SamplingParams

    from kvarn.integrations.vllm import register

    register()  # what the entry point does; also for a checkout on PYTHONPATH (no entry point) whose engine runs
    # in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0: kvarn.bench.gpu_check)
    with open(sys.argv[1]) as f:
        job = json.load(f)
    t = time.perf_counter()
    llm = LLM(**{"disable_log_stats": False, **job["llm"]})
    start = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": job["prompts"][0][:32]}], SamplingParams(temperature=0.0, max_tokens=2),
                 use_tqdm=False)
    warm = time.perf_counter() - t
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    t = time.perf_counter()
    res = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], params, use_tqdm=False)
    wall = time.perf_counter() - t
    ttft, tpot, preempted = [], [], 0
    for r in res:
        m, n = r.metrics, len(r.outputs[0].token_ids)
        if m is None or not getattr(m, "first_token_ts", 0):
            continue
        ttft.append(m.first_token_latency)
        if n > 1:
            tpot.append((m.last_token_ts - m.first_token_ts) / (n - 1))
        preempted += int(m.num_preemptions > 0)
    counters = {x.name: x for x in llm.get_metrics()}
    pre = counters.get("vllm:num_preemptions")
    out = {"start_s": start, "warmup_s": warm, "wall_s": wall, "requests": len(res),
           "generated_tokens": sum(len(r.outputs[0].token_ids) for r in res), "ttft_mean_s": _mean(ttft),
           "tpot_mean_s": _mean(tpot), "preemptions": None if pre is None else int(pre.value),
           "preempted_requests": preempted if ttft else None}
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
