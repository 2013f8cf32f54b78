"""An engine start of the vLLM tests with vLLM's engine-core process and in-process (`engine_common.IN_PROCESS`),
interleaved: SmolLM2-135M at the default preset, one 1-token request, each run a fresh `run_llm.py` process (what
`engine_common.engine` starts). Prints each run's seconds and the greedy token (the same in both modes).

    .venv-vllm/bin/python scripts/vllm_start_time.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's tests package

from tests.integrations.vllm import engine_common as ec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    ec.record = lambda *a, **k: None  # these runs are not the tests' figures (out/vllm/engine.json)
    job = {"prompts": ec.prompts()[:1], "max_tokens": 1, "llm": ec.llm_kwargs(ec.kvarn(ec.AUTO))}
    modes = {"engine-core process": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, "in-process": ec.IN_PROCESS}
    for r in range(args.rounds):
        for name, env in modes.items():
            t = time.time()
            run = ec.run_llm(f"start-{r}", job, env)
            print(f"round {r} {name:20s} {time.time() - t:6.1f} s  token {run.out['tokens'][0]}", flush=True)


if __name__ == "__main__":
    main()
