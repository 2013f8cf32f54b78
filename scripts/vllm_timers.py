"""Wall time of the attention layer's parts inside one vLLM `LLM.generate`, without a profiler: cProfile's hooks
slow Python many times over, and in a serving step the backend's Python is what is being measured. Needs vLLM
(`make vllm-venv`).

    PYTHONPATH=$PWD .venv-vllm/bin/python scripts/vllm_timers.py PRESET|stock [--requests 8] [--prompt-tokens 512]
        [--new 128] [--kv-mib 4096] [--dtype bfloat16|float16|float32|auto] [--max-num-seqs S] [--by-tokens]

The workload of `kvarn bench vllm`'s equal batch (R requests of P prompt tokens of `pydoc_data.topics` prose, N
greedy tokens, SmolLM2-135M-Instruct, bfloat16 unless --dtype, max_num_seqs R, enforce_eager; the engine in this
process), one short warm-up request first. Accumulators (`time.perf_counter`) wrap the model's forward, the attention
layer's forward, and for kvarn `write_step`, `attend_step`, `observe_queries`, `batched_decode`, `decode_batch`, the
prompt pieces' `_batched_pieces` (SDPA) or `_vllm_pieces` (vLLM's CPU attention), `store_tiles`, and the C++ decode
kernel (the seat's registered CPU kernel); each split into the first step (the prompts' prefill) and the decode
steps. --layer-parts adds each decoder layer's MLP and attention module (projections, RoPE and the attention layer).
--max-num-seqs S caps the sequences at once (default R: a memory-bound run queues more requests than run at once);
--by-tokens splits the later steps into "mixed" ones, whose forward has more than S tokens (prompt tokens in them),
and pure "decode" steps. The engine and prompts are scripts/vllm_profile.py's (prompt r: tokens 1000 r onwards).
Used for docs/VLLM.md ("The backend's Python in a serving step", "The engines' dtype", "The full grid").
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import time
import types

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

TOTAL: dict = collections.defaultdict(float)
CALLS: collections.Counter = collections.Counter()
STEP = [0]  # model forwards so far: step 0 is the prompts' prefill
PHASE = ["prefill"]  # the phase of the model forward under way (set by the "model" timer, read by the nested ones)
MIXED_ABOVE = [None]  # --by-tokens: later steps with more tokens than this carry prompt tokens ("mixed")


def _phase(args: tuple) -> str:
    """The phase of a model forward: the first step, then "decode", or with --by-tokens "mixed" for a later step
    whose token count (the length of its input ids) exceeds max_num_seqs, so that it carries prompt tokens (a step
    with fewer prompt tokens than that counts as decode)."""
    if STEP[0] == 0:
        return "prefill"
    if MIXED_ABOVE[0] is not None:
        tokens = next((x.shape[0] for x in args[1:3] if hasattr(x, "shape")), 0)
        if tokens > MIXED_ABOVE[0]:
            return "mixed"
    return "decode"


def timed(owner, name: str, label: str | None = None) -> None:
    """Replace owner.name by a wrapper that adds its wall time to TOTAL[(label, phase)]."""
    f = getattr(owner, name)
    label = label or name

    @functools.wraps(f)
    def wrapper(*a, **k):
        if label == "model":
            PHASE[0] = _phase(a)
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            key = (label, PHASE[0])
            TOTAL[key] += time.perf_counter() - t0
            CALLS[key] += 1
            if label == "model":
                STEP[0] += 1

    setattr(owner, name, wrapper)


def main() -> None:
    from vllm import SamplingParams
    from vllm.model_executor.models import llama
    from vllm_profile import warm_engine  # this folder: the same engine and prompts as the profile

    from kvarn.bench.vllm import DTYPES
    from kvarn.integrations.vllm import backend, paged
    from kvarn.ops import seats

    ap = argparse.ArgumentParser()
    ap.add_argument("preset")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--kv-mib", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    ap.add_argument("--layer-parts", action="store_true", help="also time each layer's MLP and attention module")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="the engine's max_num_seqs (default: --requests)")
    ap.add_argument("--by-tokens", action="store_true",
                    help="split the later steps into those carrying prompt tokens (mixed) and pure decode steps")
    a = ap.parse_args()
    if a.by_tokens:
        MIXED_ABOVE[0] = a.max_num_seqs or a.requests
    timed(llama.LlamaModel, "forward", "model")
    if a.layer_parts:  # what of the model's time is outside the attention layer (both engines run the same code)
        timed(llama.LlamaMLP, "forward", "mlp")
        timed(llama.LlamaAttention, "forward", "attention module")
    if a.preset == "stock":
        from vllm.v1.attention.backends import cpu_attn

        timed(cpu_attn.CPUAttentionBackendImpl, "forward", "attention forward")
    else:
        import kvarn.kernels.cpu.register  # noqa: F401  (the CPU kernels behind the seats)

        timed(backend.KVarNAttentionImpl, "forward", "attention forward")
        for name in ("write_step", "attend_step", "observe_queries"):
            timed(backend, name)
        for name in ("batched_decode", "decode_batch", "_batched_pieces", "_vllm_pieces", "store_tiles"):
            timed(paged, name)
        kernels = getattr(seats, "_KERNELS", None)  # None before b1aaddb (kernels reached through the op only)
        if kernels is not None:
            holder = types.SimpleNamespace(kernel=kernels["packed_decode", "cpu"])
            timed(holder, "kernel", "C++ decode kernel")
            kernels["packed_decode", "cpu"] = holder.kernel  # what `Seat` calls for CPU tensors
    llm, prompts = warm_engine(a.preset, a.new, a.requests, a.prompt_tokens, a.kv_mib, a.max_num_seqs, dtype=a.dtype)
    TOTAL.clear()
    CALLS.clear()
    STEP[0] = 0
    PHASE[0] = "prefill"
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(temperature=0.0, max_tokens=a.new, ignore_eos=True), use_tqdm=False)
    wall = time.perf_counter() - t0
    print(f"{a.preset}: wall {wall:.2f} s, {a.requests * a.new / wall:.1f} generated tokens/s")
    order = {"prefill": 0, "mixed": 1, "decode": 2}
    for (label, phase), s in sorted(TOTAL.items(), key=lambda kv: (order[kv[0][1]], -kv[1])):
        c = CALLS[label, phase]
        print(f"  {phase:8s} {label:20s} {s:7.3f} s in {c:5d} calls, {s / c * 1e3:7.3f} ms a call")


if __name__ == "__main__":
    main()
