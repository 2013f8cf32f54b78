"""The tile store of `kvarn bench store` (one tile of every quantized layer, fresh stores holding the sink, the
model's own K/V and query statistics) called in a loop, for a profiler to attach to (docs/TASKS.md, "The widths'
store"):

    python scripts/store_loop.py kvarn-w2.5 300 &     # prints its pid in /tmp/kvarn-store-loop.pid when ready
    perf record -F 2000 -o perf.data -p "$(cat /tmp/kvarn-store-loop.pid)"
    perf report -i perf.data --no-children --sort dso,sym

It prints the mean ms a store over the loop (1 torch thread; setup untimed and outside the profile).
"""

from __future__ import annotations

import os
import sys
import time

import torch

from kvarn.bench.store import _store_call
from kvarn.eval.forward import capture_kv
from kvarn.eval.text import load_tokens
from kvarn.models import load_model
from kvarn.presets import get_preset

PID_FILE = "/tmp/kvarn-store-loop.pid"


def main(preset: str, calls: int) -> None:
    torch.set_num_threads(1)
    model, tok = load_model("default")
    p = get_preset(preset)
    ids = load_tokens(tok, None, 2048)
    with torch.no_grad():
        kv = capture_kv(model, ids[:, :p.sink + p.tile])
        store = _store_call(model, ids, preset, kv, calls + 1)
        store()  # warm-up
        with open(PID_FILE, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(2)  # for the profiler to attach
        t = time.perf_counter()
        for _ in range(calls):
            store()
    print(f"{preset}: {1e3 * (time.perf_counter() - t) / calls:.2f} ms a store (mean of {calls})")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "kvarn-w2.5", int(sys.argv[2]) if len(sys.argv) > 2 else 100)
