"""How long collapsing an already-touched tensor into 2 MB huge pages takes (`madvise` MADV_HUGEPAGE, then
MADV_COLLAPSE, Linux >= 6.1): what giving kvarn's KV cache huge pages would cost at start-up, vLLM having zero-filled
it with 4 KB pages by then. Used for docs/VLLM.md ("Dense rows widened in L1, and huge pages").

    .venv/bin/python scripts/thp_collapse_time.py [--gib 1]

Prints the seconds of the two calls and AnonHugePages (/proc/meminfo) before and after.
"""

from __future__ import annotations

import argparse
import ctypes
import time

import torch

MADV_HUGEPAGE, MADV_COLLAPSE, HUGE = 14, 25, 2 << 20


def anon_huge_kib() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    args = ap.parse_args()
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    t = torch.zeros(int(args.gib * (1 << 30)), dtype=torch.uint8)  # touched: 4 KB pages, as vLLM's zero-filled cache
    lo = -(-t.data_ptr() // HUGE) * HUGE
    hi = (t.data_ptr() + t.numel()) // HUGE * HUGE
    before = anon_huge_kib()
    t0 = time.perf_counter()
    for advice in (MADV_HUGEPAGE, MADV_COLLAPSE):
        if libc.madvise(lo, hi - lo, advice) != 0:
            raise SystemExit(f"madvise({advice}) failed: errno {ctypes.get_errno()}")
    print(f"{args.gib:g} GiB collapsed in {time.perf_counter() - t0:.2f} s; AnonHugePages {before} -> "
          f"{anon_huge_kib()} KiB")


if __name__ == "__main__":
    main()
