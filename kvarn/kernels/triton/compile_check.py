"""Compile the Triton kernels for a CUDA target without a GPU (triton bundles ptxas), to catch what the CPU
interpreter accepts but the compiler refuses (non-constexpr globals, layout or type errors, register blow-ups).

    python -m kvarn.kernels.triton.compile_check [--arch 90]

Compiles the decode kernels (version 1, tile: kvarn-k2v2 fp16 scales, ieee; kvarn-auto fp8 column scales, tf32;
version 2, planes: kvarn-k2v2 bf16x3 and kvarn-auto-k4v2 ieee at D = 128, kvarn-auto-k2v2 bf16x3 at D = 64; the
version 3 candidate, stacked: kvarn-k2v2 at D = 128, kvarn-auto-k2v2 at D = 64) and the
store kernel (keys and values, kvarn-k2v2 and auto) at G = 128. Must run with TRITON_INTERPRET unset.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path


def _signature(fn, ptrs: dict[str, str], consts: dict) -> dict[str, str]:
    return {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in fn.arg_names}


KINDS = {"decode_split_kernel": "tile", "decode_planes_kernel": "planes"}


def _resources(cubin: bytes | None) -> str:
    """Registers and spill stack per thread of a compiled kernel, read from its cubin with the cuobjdump that triton
    bundles (what occupancy follows from; no GPU needed)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cubin or not tool.exists():
        return "resources not read: no cubin or no cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return f"{found[1]} registers, {found[2]} B spill stack" if found else "resources not read"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10 (90: H100/H200)")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("unset TRITON_INTERPRET: the interpreter does not compile")
    import triton
    from triton.backends.compiler import GPUTarget

    from kvarn.kernels.triton.kernels.decode import decode_planes_kernel, decode_split_kernel
    from kvarn.kernels.triton.kernels.store import store_tiles_kernel
    from kvarn.kernels.triton.ops import DECODE_LAUNCH, NUM_WARPS

    target = GPUTarget("cuda", args.arch, 32)

    def build(fn, ptrs, consts, kind: str = "") -> None:
        t0 = time.perf_counter()
        src = triton.compiler.ASTSource(fn=fn, signature=_signature(fn, ptrs, consts), constexprs=consts)
        warps, stages, _ = DECODE_LAUNCH.get(kind or KINDS.get(fn.__name__, ""), (NUM_WARPS, 3, 1))
        kern = triton.compile(src, target=target, options={"num_warps": warps, "num_stages": stages})
        print(f"{fn.__name__} {consts}: compiled for sm_{args.arch} in {time.perf_counter() - t0:.1f} s "
              f"({warps} warps; {_resources(kern.asm.get('cubin'))})", flush=True)

    dec = {n: "*fp32" for n in ("q_ptr", "qr_ptr", "m_ptr", "l_ptr", "or_ptr", "op_ptr")}
    dec |= {n: "*i32" for n in ("bt_ptr", "nb_ptr")} | {n: "*u8" for n in ("kc_ptr", "vc_ptr", "kf_ptr", "vf_ptr")}
    dec |= {n: "*fp16" for n in ("ka_ptr", "kz_ptr", "va_ptr", "vz_ptr")}
    for col, rot, prec in (("*fp16", 1, 0), ("*fp8e4nv", 2, 1)):
        build(decode_split_kernel, dec | {"kt_ptr": col, "vt_ptr": col},
              {"MP": 16, "D": 128, "G": 128, "KBITS": 2, "VBITS": 2, "KROT": rot, "VROT": rot, "KCOL": True,
               "VCOL": True, "PLANES": False, "PREC": prec})
    for d, kbits, col, rot, prec in ((128, 2, "*fp16", 1, 2), (128, 4, "*fp8e4nv", 2, 0), (64, 2, "*fp8e4nv", 2, 2)):
        build(decode_planes_kernel, dec | {"kt_ptr": col, "vt_ptr": col},
              {"MP": 16, "D": d, "G": 128, "KBITS": kbits, "VBITS": 2, "KROT": rot, "VROT": rot, "KCOL": True,
               "VCOL": True, "PREC": prec, "UNROLL": 1, "STACK": False})
    for d, rot in ((128, 1), (64, 2)):  # STACK: the version 3 candidate
        build(decode_planes_kernel, dec | {"kt_ptr": "*fp16", "vt_ptr": "*fp16"},
              {"MP": 4, "D": d, "G": 128, "KBITS": 2, "VBITS": 2, "KROT": rot, "VROT": rot, "KCOL": True,
               "VCOL": True, "PREC": 2, "UNROLL": 1, "STACK": True}, "stacked")
    st = {"x_ptr": "*bf16", "dst_ptr": "*i32", "flag_ptr": "*u8", "hm_ptr": "*fp32", "c_ptr": "*u8", "f_ptr": "*u8",
          "a_ptr": "*fp16", "z_ptr": "*fp16", "t_ptr": "*fp16"}
    for channel, rot in ((True, 1), (False, 2)):
        build(store_tiles_kernel, st, {"D": 128, "G": 128, "R": 128, "C": 128, "BITS": 2, "AXIS_CHANNEL": channel,
                                       "ROT": rot, "VARN": True, "ITERS": 8, "WRITE_FLAG": rot == 2, "PLANES": False})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
