"""One prepared GPU check of the Triton kernels (kvarn.kernels.triton): correctness on real-size shapes, then timing.

    bash kvarn/bench/gpu_check.sh                   # on a CUDA machine (writes $OUT/gpu_check.{json,md})
    python -m kvarn.bench.gpu_check --out DIR       # the check alone (what the shell wrapper runs)
    TRITON_INTERPRET=1 python -m kvarn.bench.gpu_check --smoke --out /tmp/gc   # the same steps, tiny, on the CPU

Steps (each guarded: a failure is printed and recorded, the next step still runs):
  1. decode correctness: paged_decode over a pool read through a permuted block table (batch rows of different
     lengths, sink/tail/fresh exact regions), Qwen3-4B-like heads (32 q / 8 KV, head_dim 128, G = 128), presets
     kvarn-k2v2, kvarn-k4v2, kvarn-auto-k2v2, every decode kernel version and precision (`DECODE_VARIANTS`);
     against float64 attention over the dequantized K/V. Bound: no worse than 4x float32 attention over the same
     K/V (+16 eps max|V|), for "ieee" and "bf16x3" (the callers' "auto" precisions). "tf32" is
     measured, not checked: on the H200 (2026-12-04) its error was 1.5-3.6e-3 max|V|, 8-18x that of attention
     with q, K, p, V rounded to tf32 (`tf32`), likely because the kernel's logits (q a) @ codes + q . z cancel two
     large terms; and it was no faster than ieee.
  2. store correctness: store_tiles vs AffineQuantizer.encode (kvarn-k2v2 keys/values; rtn bit-exact).
  3. timing (triton.testing.do_bench, medians): decode of one token at 4k/8k/16k/32k context, batch 1 and 8 -
     fused packed decode (whole call, and the split kernel alone; the default version and version 1) vs SDPA over
     dense bf16 K/V (and FlashAttention's flash_attn_with_kvcache when installed).
  4. the decode kernel alone over versions, warps, stages, unroll and blocks per split (`SWEEP`; registers,
     spills, shared memory); --ncu-target launches the default alone, for ncu.
  5. timing of the store of one tile of every KV head per batch row.
  6. the vLLM plugin's CUDA path on one layer, no vLLM needed (`paged_check`): prefill + one batched decode step
     through the real slot plan and page pool, Triton store and decode, vs float64 attention over the stored K/V.
  7. the transformers cache end to end on a random-weight model with a real model's attention shapes (`e2e_check`):
     the packed path (Triton decode) against the reference path (PyTorch over dequantized K/V) on the same prompt,
     then decode tokens/s of KVarNCache presets vs DynamicCache at the given contexts.
  8. with vLLM installed and --vllm-model DIR (a local folder: the machine may have no network): generated tokens/s
     of stock bf16 KV, stock fp8 KV and kvarn at the same KV budget (`vllm_throughput`); skipped otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import time
import traceback
from pathlib import Path

import torch

RESULTS: dict = {"checks": [], "timings": [], "errors": []}
STEPS: set[str] = set()  # the step numbers to run (--steps); empty: all
OUT: list[Path] = []  # where write() puts the results (after every step and timing row: a timeout keeps them)


def encode_pool(quantizer, x: torch.Tensor, flag: torch.Tensor):
    """AffineTiles [NB, H, ...] of tiles x [NB, H, G, D]; rotate="auto" tiles take the rotation flag [NB, H] given
    (both candidates encoded by the quantizer), so rotated and plain tiles are both present. Shared with the tests."""
    from kvarn.quant.affine import AffineQuantizer

    flat = x.flatten(0, 1)
    if quantizer.config.rotate == "auto":
        rot = AffineQuantizer(quantizer.config, "always").encode(flat)
        plain = AffineQuantizer(quantizer.config, "never").encode(flat).tensors()
        keep = flag.flatten()
        fields = {k: torch.where(keep.view(-1, *[1] * (v.dim() - 1)), v, plain[k]) for k, v in rot.items()}
        fields["rotated"] = keep.to(torch.uint8)
        tiles = rot.with_tensors(fields)
    else:
        tiles = quantizer.encode(flat)
    return tiles.map(lambda v: v.unflatten(0, x.shape[:2]).contiguous())  # encode may return views


DECODE_VARIANTS = [("planes", "bf16x3"), ("planes", "ieee"), ("tile", "ieee"), ("stacked", "bf16x3")]  # version 2
# (the default), version 1, the version 3 candidate
SWEEP = {"planes": [(2, 2, 1), (1, 2, 1), (2, 3, 1), (2, 2, 2), (4, 2, 1)], "tile": [(8, 3, 1)],
         "stacked": [(4, 2, 1), (2, 2, 1), (8, 2, 1)]}  # step 4's (warps, stages, unroll) per version


def smoke_configs(configs: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """The first of each unroll of a kernel's sweep: the interpreter ignores warps and stages, so the smoke run's other
    configurations would repeat the same Python."""
    return [c for i, c in enumerate(configs) if c[2] not in {u for _, _, u in configs[:i]}]


def sweep_splits(kind: str, unroll: int, smoke: bool) -> tuple[int | None, ...]:
    """Blocks per split timed in step 4 (None: "auto"). The smoke run sets an explicit split size once, on the
    default kernel's first configuration: the interpreter's times mean nothing, only that each path runs."""
    if kind == "tile":
        return (8,)
    if not smoke:
        return (None, 4)
    return (None, 2) if kind == "planes" and unroll == 1 else (None,)


@contextlib.contextmanager
def decode_kernel(kind: str):
    """Force `ops.DECODE_KERNEL` (the decode kernel version) inside the block."""
    from kvarn.kernels.triton import ops

    old, ops.DECODE_KERNEL = ops.DECODE_KERNEL, kind
    try:
        yield
    finally:
        ops.DECODE_KERNEL = old


def tf32(x: torch.Tensor) -> torch.Tensor:
    """x rounded to tf32 (10 mantissa bits, nearest, ties away from zero as the tensor cores' conversion), float32."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def log(msg: str) -> None:
    print(msg, flush=True)


def step(name: str):
    """Run the decorated step now (unless --steps leaves its number out); record its failure instead of stopping."""

    def run(fn):
        if STEPS and name.split(".")[0] not in STEPS:
            return fn
        log(f"\n== {name}")
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:  # one failing step must not hide the others
            log(f"!! {name} FAILED: {type(e).__name__}: {e}")
            traceback.print_exc()
            RESULTS["errors"].append({"step": name, "error": f"{type(e).__name__}: {e}"})
        log(f"   ({time.perf_counter() - t0:.1f} s)")
        write()
        return fn

    return run


def check(name: str, ok: bool, **info) -> None:
    RESULTS["checks"].append({"name": name, "ok": bool(ok), **info})
    log(f"   [{'PASS' if ok else 'FAIL'}] {name} " + " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                                        for k, v in info.items()))


def bench(fn, smoke: bool) -> float:
    """Median milliseconds of fn()."""
    if smoke:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu_check_out")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, CPU interpreter (TRITON_INTERPRET=1)")
    ap.add_argument("--contexts", default="4096,8192,16384,32768")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", default="", help="comma-separated step numbers to run (default: all)")
    ap.add_argument("--ncu-target", action="store_true",
                    help="only launch the decode kernel (batch 8, 32k, kvarn-k2v2) 3 times, for `ncu` to profile")
    ap.add_argument("--e2e-contexts", default="8192,32768", help="step 7's prompt lengths")
    ap.add_argument("--e2e-steps", type=int, default=32, help="step 7's timed decode steps per cache and context")
    ap.add_argument("--vllm-model", default=None, help="local model folder for step 6 (skipped without it)")
    ap.add_argument("--vllm-preset", default="kvarn-k4v2-g128")
    ap.add_argument("--vllm-kv-gib", type=float, default=4.0, help="the KV cache budget of every step-6 run")
    ap.add_argument("--vllm-prompts", default="32,1024,256", help="prompts,prompt tokens,generated tokens")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    OUT.append(out)
    smoke = args.smoke
    STEPS.update(x.strip() for x in args.steps.split(",") if x.strip())
    if args.ncu_target:
        STEPS.add("none")  # no step runs; the sweep's fields, launched alone
    dev = torch.device("cpu" if smoke else "cuda")

    import triton

    from kvarn.kernels.triton import ops
    from kvarn.kernels.triton.attention import paged_decode
    from kvarn.presets import get_preset
    from kvarn.quant.affine import AffineConfig, AffineQuantizer
    from kvarn.quant.policy import kernel_weighted

    env = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
           "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu (interpreter)",
           "smoke": smoke}
    RESULTS["env"] = env
    log(f"environment: {env}")
    hq, hkv, d = (8, 2, 64) if smoke else (32, 8, 128)
    g_tile = 64 if smoke else 128

    def store_args(q):
        """The encoding parameters ops.store_tiles takes besides the tiles' format."""
        return {"varn": q.config.varn, "varn_iters": q.config.varn_iters, "weighted": bool(kernel_weighted(q.policy))}

    @step("1. decode correctness vs float64")
    def _decode_correct():
        gen = torch.Generator(device=dev).manual_seed(0)
        for preset in ("kvarn-k2v2", "kvarn-k4v2", "kvarn-auto-k2v2"):
            name = f"{preset}-g{g_tile}"
            kq, vq = get_preset(name).quantizers(d)
            lens = [3, 2] if smoke else [32, 20]  # blocks per batch row (4k and 2.5k tokens at G = 128)
            nb_pool = sum(lens) + 3
            xk = torch.randn(nb_pool, hkv, g_tile, d, generator=gen, device=dev)
            xk = xk * torch.linspace(0.2, 4.0, d, device=dev)  # channel scales, as real keys have
            xv = torch.randn(nb_pool, hkv, g_tile, d, generator=gen, device=dev)
            flag = torch.rand(nb_pool, hkv, generator=gen, device=dev) < 0.5
            kf, vf = encode_pool(kq, xk, flag), encode_pool(vq, xv, ~flag)
            perm = torch.randperm(nb_pool, generator=gen, device=dev).to(torch.int32)
            table = torch.zeros(2, max(lens), dtype=torch.int32, device=dev)
            table[0, :lens[0]] = perm[:lens[0]]
            table[1, :lens[1]] = perm[lens[0]:lens[0] + lens[1]]
            n_blocks = torch.tensor(lens, dtype=torch.int32, device=dev)
            sink = [torch.randn(2, hkv, 4, d, generator=gen, device=dev) for _ in range(2)]
            tail = [torch.randn(2, hkv, 7, d, generator=gen, device=dev) for _ in range(2)]
            tail_len = torch.tensor([7, 3], dtype=torch.int32, device=dev)
            new = [torch.randn(2, hkv, 1, d, generator=gen, device=dev) for _ in range(2)]
            q = torch.randn(2, hq, d, generator=gen, device=dev)
            exact = [(sink[0], sink[1], None), (tail[0], tail[1], tail_len), (new[0], new[1], None)]
            keys, values = ops.TileFields.from_pool(kf), ops.TileFields.from_pool(vf)
            for kind, prec in DECODE_VARIANTS + ([] if smoke else [("tile", "tf32")]):
                with decode_kernel(kind):
                    got = paged_decode(q, keys, values, table, n_blocks, exact, precision=prec)
                for r in range(2):
                    blk = table[r, :lens[r]].long()
                    kd = kq.decode(kf.select(blk).flatten(2))  # [n*H, G, D]
                    vd = vq.decode(vf.select(blk).flatten(2))
                    kd = kd.view(lens[r], hkv, g_tile, d).transpose(0, 1).reshape(hkv, -1, d)
                    vd = vd.view(lens[r], hkv, g_tile, d).transpose(0, 1).reshape(hkv, -1, d)
                    t = int(tail_len[r])
                    k_all = torch.cat([sink[0][r], kd, tail[0][r, :, :t], new[0][r]], 1)  # [Hkv, T, D]
                    v_all = torch.cat([sink[1][r], vd, tail[1][r, :, :t], new[1][r]], 1)
                    ref = {}
                    for dt in (torch.float64, torch.float32, "tf32"):
                        rd = (lambda x: tf32(x).double()) if dt == "tf32" else (lambda x, t=dt: x.to(t))
                        kk = rd(k_all).repeat_interleave(hq // hkv, 0)
                        vv = rd(v_all).repeat_interleave(hq // hkv, 0)
                        p = torch.softmax(rd(q[r] * d ** -0.5).unsqueeze(1) @ kk.transpose(1, 2), -1)
                        ref[dt] = (rd(p) @ vv).squeeze(1)  # [Hq, D]
                    err = float((got[r].double() - ref[torch.float64]).abs().max())
                    err32 = float((ref[torch.float32].double() - ref[torch.float64]).abs().max())
                    err_tf32 = float((ref["tf32"] - ref[torch.float64]).abs().max())
                    vmax = float(v_all.abs().max())
                    eps = torch.finfo(torch.float32).eps
                    if prec == "tf32":  # measured, not checked: no caller uses tf32 (see the docstring)
                        row = {"tf32_error": f"decode {name} row {r}", "err_over_max_v": err / vmax,
                               "err_tf32_emulated_over_max_v": err_tf32 / vmax}
                        RESULTS["timings"].append(row)
                        log("   " + json.dumps(row))
                        continue
                    bound = 4 * err32 + 16 * eps * vmax
                    check(f"decode {name} {kind} {prec} row {r} ({k_all.shape[1]} tokens)", err <= bound, err=err,
                          bound=bound, err_f32_torch=err32)

    @step("2. store correctness vs AffineQuantizer.encode")
    def _store_correct():
        gen = torch.Generator(device=dev).manual_seed(1)
        n = 2 if smoke else 16
        # the kvarn-k2v2 key and value configurations (reused by step 4: no extra compile) and RTN alone (bit-exact)
        for cfg in ((2, "channel", "hadamard", True), (2, "token", "hadamard", True), (2, "channel", "none", False)):
            q = AffineQuantizer(AffineConfig(*cfg, tile=g_tile))
            x = torch.randn(n, hkv, g_tile, d, generator=gen, device=dev) * torch.linspace(0.2, 4.0, d, device=dev)
            x = x.to(torch.bfloat16)  # as a model hands K/V over
            want_t = q.encode(x.flatten(0, 1))
            pool = want_t.map(lambda v: torch.zeros((n + 2, hkv, *v.shape[1:]), dtype=v.dtype, device=dev))
            dst = torch.randperm(n + 2, generator=gen, device=dev)[:n].to(torch.int32)
            ops.store_tiles(x, ops.TileFields.from_pool(pool), dst, **store_args(q))
            got_t = want_t.with_tensors({k: v[dst.long()].flatten(0, 1) for k, v in pool.items()})
            from kvarn.ops.packing import unpack_codes

            a = unpack_codes(got_t.codes, cfg[0]).int()
            b = unpack_codes(want_t.codes, cfg[0]).int()
            diff = float((a != b).float().mean())
            step_max = int((a - b).abs().max())
            xf = x.flatten(0, 1).float()
            err = float((q.decode(got_t) - xf).square().mean())
            ref = float((q.decode(want_t) - xf).square().mean())
            exact = cfg[2] == "none" and not cfg[3]
            ok = (diff == 0) if exact else (diff <= 0.01 and step_max <= 1 and err <= 1.01 * ref)
            check(f"store {q.name} d={d}", ok, codes_differing=diff, max_code_step=step_max, mse=err, mse_ref=ref)

    @step("3. timing: decode of one token, fused packed vs SDPA over dense bf16")
    def _timing():
        try:
            from flash_attn import flash_attn_with_kvcache  # optional
        except Exception:
            flash_attn_with_kvcache = None
            log("   flash_attn not installed: FlashAttention column skipped (SDPA picks its own flash backend)")
        # smoke: one shape with a batch of 2 runs every timed path once (the interpreter's times mean nothing)
        contexts = [256] if smoke else [int(c) for c in args.contexts.split(",")]
        batches = [2] if smoke else [int(b) for b in args.batches.split(",")]
        kq, vq = get_preset(f"kvarn-k2v2-g{g_tile}").quantizers(d)
        gen = torch.Generator(device=dev).manual_seed(2)

        def decode_row(bsz: int, ctx: int, row: dict) -> None:
            """Fill one timing row (a function, so the timed lambdas close over its locals only)."""
            keys, values, table, n_blocks, packed = random_pool(kq, vq, bsz, ctx, hkv, d, g_tile, gen, dev)
            q = torch.randn(bsz, hq, d, generator=gen, device=dev, dtype=torch.bfloat16)
            fresh = [torch.randn(bsz, hkv, 1, d, device=dev, dtype=torch.bfloat16) for _ in range(2)]
            exact = [(fresh[0], fresh[1], None)]
            qs = q.float().view(bsz, hkv, hq // hkv, d) * d ** -0.5
            qh = qs @ ops.hadamard_f32(d, dev)
            for kind, tag in (("auto", "packed"), ("tile", "packed_v1")):  # the default (version 2) and version 1
                with decode_kernel(kind):
                    row[f"{tag}_ms"] = bench(lambda: paged_decode(q, keys, values, table, n_blocks, exact), smoke)
                    row[f"{tag}_kernel_only_ms"] = bench(
                        lambda: ops.decode_partials(qs, qh, keys, values, table, n_blocks), smoke)
            kd = torch.randn(bsz, hkv, ctx, d, device=dev, dtype=torch.bfloat16)
            vd = torch.randn(bsz, hkv, ctx, d, device=dev, dtype=torch.bfloat16)
            q4 = q.unsqueeze(2)  # [B, Hq, 1, D]
            sdpa = torch.nn.functional.scaled_dot_product_attention
            try:
                row["sdpa_bf16_ms"] = bench(lambda: sdpa(q4, kd, vd, enable_gqa=True), smoke)
            except (TypeError, RuntimeError) as e:  # torch < 2.5: no enable_gqa; expand K/V up front
                log(f"   SDPA enable_gqa failed ({e}); timing SDPA over K/V repeated to {hq} heads")
                ke, ve = (t.repeat_interleave(hq // hkv, 1) for t in (kd, vd))
                row["sdpa_bf16_ms"] = bench(lambda: sdpa(q4, ke, ve), smoke)
                row["sdpa_note"] = "K/V expanded to Hq heads before timing"
                del ke, ve
            if flash_attn_with_kvcache is not None:
                kf_, vf_ = kd.transpose(1, 2).contiguous(), vd.transpose(1, 2).contiguous()  # [B, T, H, D]
                qf = q.unsqueeze(1)  # [B, 1, Hq, D]
                row["flash_attn_bf16_ms"] = bench(lambda: flash_attn_with_kvcache(qf, kf_, vf_), smoke)
            row["kv_bytes_dense"] = 2 * kd.numel() * kd.element_size()
            row["kv_bytes_packed"] = packed
            for tag in ("packed", "packed_kernel_only", "packed_v1"):
                row[f"ratio_{tag}_vs_sdpa"] = row[f"{tag}_ms"] / row["sdpa_bf16_ms"]

        for bsz in batches:
            for ctx in contexts:
                row = {"batch": bsz, "context": ctx}
                try:
                    decode_row(bsz, ctx, row)
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {e}"
                    traceback.print_exc()
                RESULTS["timings"].append(row)
                log("   " + json.dumps(row))
                write()
                if dev.type == "cuda":
                    torch.cuda.empty_cache()

    @step("4. decode kernel sweep: versions, warps, stages, unroll, blocks per split (kernel alone, kvarn-k2v2)")
    def _sweep():
        decode_sweep(dev, smoke, hq, hkv, d, g_tile)

    if args.ncu_target:
        decode_sweep(dev, smoke, hq, hkv, d, g_tile, ncu=True)
        return 0

    @step("5. timing: store of one tile per KV head and batch row")
    def _store_timing():
        def store_row(bsz: int, kind: str, q: AffineQuantizer, row: dict) -> None:
            x = torch.randn(bsz, hkv, g_tile, d, device=dev, dtype=torch.bfloat16)
            want = q.encode(x[:1, :1].flatten(0, 1).float())
            pool = want.map(lambda v: torch.zeros((bsz, hkv, *v.shape[1:]), dtype=v.dtype, device=dev))
            f = ops.TileFields.from_pool(pool)
            dst = torch.arange(bsz, dtype=torch.int32, device=dev)
            row[f"store_{kind}_ms"] = bench(lambda: ops.store_tiles(x, f, dst, **store_args(q)), smoke)
            row[f"encode_torch_{kind}_ms"] = bench(lambda: q.encode(x.flatten(0, 1)), smoke)

        kq, vq = get_preset(f"kvarn-k2v2-g{g_tile}").quantizers(d)
        for bsz in [1, 2] if smoke else [1, 8]:
            row = {"store_batch": bsz}
            store_row(bsz, "keys", kq, row)
            store_row(bsz, "values", vq, row)
            RESULTS["timings"].append(row)
            log("   " + json.dumps(row))

    @step("6. vLLM paged decode (Triton) vs float64 on a real page pool")
    def _paged_correct():
        paged_check(dev, smoke, hq, hkv, d, g_tile)

    @step("7. transformers cache end to end: packed (Triton) vs reference, decode tokens/s vs DynamicCache")
    def _e2e():
        e2e_check(dev, smoke, args)

    @step("8. vLLM throughput: stock bf16 KV, stock fp8 KV, kvarn")
    def _vllm_throughput():
        vllm_throughput(args, out)

    n_fail = sum(not c["ok"] for c in RESULTS["checks"]) + len(RESULTS["errors"])
    log(f"\n{len(RESULTS['checks'])} checks, {n_fail} failures/errors; results in {out}/gpu_check.json and .md")
    return 1 if n_fail else 0


def paged_check(dev: torch.device, smoke: bool, hq: int, hkv: int, d: int, g: int) -> None:
    """The vLLM plugin's CUDA path on one layer (`kvarn.integrations.vllm.paged`, no vLLM needed): a bf16 page pool
    (`LayerPool`, fp slots planned by the real `SlotTable`), a prefill of three requests (completed blocks stored by
    the Triton store kernel), then one decode step of all three in one Triton launch (`paged.triton_decode`): one
    request with a sink, 4 packed blocks and a current block, one whose token completes its block, one still in its
    first (sink) block. Reference: float64 attention over the same stored K/V (packed blocks decoded from the pool's
    own fields, exact rows from the bf16 slots); bound as step 1 (4x float32 attention's error + 16 eps max|V|)."""
    from kvarn.integrations.vllm import paged
    from kvarn.integrations.vllm.layout import PageGeometry, TileLayout
    from kvarn.integrations.vllm.pool import LayerPool, SlotTable
    from kvarn.presets import get_preset

    if smoke:  # the CPU pool takes the CUDA path: the Triton kernels on the interpreter
        paged.decode_kernel = lambda device: "triton"
    gen = torch.Generator(device=dev).manual_seed(3)
    lengths = [5 * g + 17, 2 * g - 1, 40]
    for preset in ("kvarn-k4v2",) if smoke else ("kvarn-k4v2", "kvarn-k2v2"):
        lay = TileLayout(get_preset(f"{preset}-g{g}"), d, torch.bfloat16)
        e = next(e for e in lay.share_choices() if lay.blocks_per_slot(e) <= 8)  # every choice holds whole rows
        geo = PageGeometry(lay, hkv, e)
        nb = 12 * geo.blocks_per_slot
        pool = LayerPool(torch.zeros(nb, hkv, g, geo.c, dtype=torch.uint8, device=dev), geo)
        table = SlotTable(pool.n_slots, g, 1)
        free = (torch.randperm(nb - 1, generator=torch.Generator().manual_seed(4)) + 1).tolist()
        blocks = [[free.pop() for _ in range(-(-(n + 1) // g))] for n in lengths]
        scale = torch.linspace(0.2, 4.0, d, device=dev)
        kv = [(torch.randn(n + 1, hkv, d, generator=gen, device=dev) * scale).bfloat16() for n in lengths]
        vv = [torch.randn(n + 1, hkv, d, generator=gen, device=dev).bfloat16() for n in lengths]
        starts = [sum(lengths[:i]) for i in range(3)]
        plan = table.plan([(s, s + n) for s, n in zip(starts, lengths)], [0] * 3, lengths, blocks)
        paged.write_step(pool, plan, torch.cat([k[:-1] for k in kv]), torch.cat([v[:-1] for v in vv]), "L0")
        plan = table.plan([(i, i + 1) for i in range(3)], lengths, [n + 1 for n in lengths], blocks)
        batch = paged.decode_batch(plan, pool)
        q = torch.randn(3, hq, d, generator=gen, device=dev)
        out = torch.zeros(3, hq, d, device=dev)
        exact = paged.write_step(pool, plan, torch.stack([k[-1] for k in kv]), torch.stack([v[-1] for v in vv]), "L0")
        paged.attend_step(pool, plan, q, out, exact, d ** -0.5, None, "L0")
        check(f"paged decode {preset}-g{g}: one Triton launch for the 3 decode rows",
              batch is not None and len(batch.requests) == 3 and pool.triton_store is True)
        for r, n in enumerate(lengths):
            j = n // g  # current block; block 0 is the sink, blocks 1 .. j-1 packed
            ks, vs = [kv[r][:min(j, 1) * g]], [vv[r][:min(j, 1) * g]]
            if j > 1:
                idx = torch.tensor(blocks[r][1:j], device=dev)
                for q_, fields, out_ in ((lay.key_q, pool.key_fields, ks), (lay.value_q, pool.value_fields, vs)):
                    dec = q_.decode(fields.select(idx).flatten(2), torch.float32)  # [n*H, G, D]
                    out_.append(dec.view(j - 1, hkv, g, d).transpose(1, 2).reshape(-1, hkv, d))
            ks.append(kv[r][j * g:])
            vs.append(vv[r][j * g:])
            k_all, v_all = torch.cat([x.float() for x in ks]), torch.cat([x.float() for x in vs])  # [T, H, D]
            ref = {}
            for dt in (torch.float64, torch.float32):
                kk = k_all.to(dt).repeat_interleave(hq // hkv, 1).transpose(0, 1)  # [Hq, T, D]
                vvv = v_all.to(dt).repeat_interleave(hq // hkv, 1).transpose(0, 1)
                p = torch.softmax(q[r].to(dt).unsqueeze(1) @ kk.transpose(1, 2) * d ** -0.5, -1)
                ref[dt] = (p @ vvv).squeeze(1)
            err = float((out[r].double() - ref[torch.float64]).abs().max())
            err32 = float((ref[torch.float32].double() - ref[torch.float64]).abs().max())
            bound = 4 * err32 + 16 * torch.finfo(torch.float32).eps * float(v_all.abs().max())
            check(f"paged decode {preset}-g{g} request {r} ({n + 1} tokens)", err <= bound, err=err, bound=bound,
                  err_f32_torch=err32)


def random_pool(kq, vq, bsz: int, ctx: int, hkv: int, d: int, g: int, gen: torch.Generator, dev: torch.device):
    """Random packed 2-bit fields of `ctx // g` blocks per batch row in the layout of kq / vq (kvarn-k2v2: keys
    [D, G], values [G, D], fp16 scales), read through a permuted block table, for timing: (keys, values, table,
    n_blocks, bytes of the packed fields)."""
    from kvarn.kernels.triton import ops

    nblk = ctx // g
    total = bsz * nblk

    def fields(rows: int, cols: int) -> dict[str, torch.Tensor]:
        return {"codes": torch.randint(0, 256, (total, hkv, rows, cols // 4), dtype=torch.uint8, generator=gen,
                                       device=dev),
                "row_scale": torch.rand(total, hkv, rows, generator=gen, device=dev).half(),
                "row_zero": -torch.rand(total, hkv, rows, generator=gen, device=dev).half(),
                "col_scale": torch.rand(total, hkv, cols, generator=gen, device=dev).half() + 0.5}

    kf, vf = fields(d, g), fields(g, d)
    keys = ops.TileFields.from_pool(kq.template(d).with_tensors(kf))
    values = ops.TileFields.from_pool(vq.template(d).with_tensors(vf))
    table = torch.randperm(total, generator=gen, device=dev).to(torch.int32).view(bsz, nblk)
    n_blocks = torch.full((bsz,), nblk, dtype=torch.int32, device=dev)
    packed = sum(t.numel() * t.element_size() for t in (*kf.values(), *vf.values()))
    return keys, values, table, n_blocks, packed


def decode_sweep(dev: torch.device, smoke: bool, hq: int, hkv: int, d: int, g: int, ncu: bool = False) -> None:
    """`ops.decode_partials` alone at batch 1 and 8, 32k context (smoke: tiny), over the kernel versions, their
    `ops.DECODE_LAUNCH` (`SWEEP`) and blocks per split ("auto": `ops._splits`), with the registers, spills and
    shared memory of every compiled variant: where the decode kernel's time goes. ncu: batch 8 only, the default
    configuration launched 3 times and nothing timed (for `ncu --launch-skip 2`)."""
    from kvarn.kernels.triton import ops
    from kvarn.kernels.triton.kernels.decode import decode_planes_kernel, decode_split_kernel
    from kvarn.presets import get_preset

    kq, vq = get_preset(f"kvarn-k2v2-g{g}").quantizers(d)
    gen = torch.Generator(device=dev).manual_seed(6)
    ctx = 256 if smoke else 32768  # smoke: 4 blocks, so 2 splits at 2 blocks a split (the merge runs)
    launch0 = dict(ops.DECODE_LAUNCH)
    try:
        for bsz in (8,) if ncu and not smoke else (2,) if smoke else (1, 8):
            keys, values, table, n_blocks, packed = random_pool(kq, vq, bsz, ctx, hkv, d, g, gen, dev)
            qs = torch.randn(bsz, hkv, hq // hkv, d, generator=gen, device=dev)
            qh = qs @ ops.hadamard_f32(d, dev)
            call = (qs, qh, keys, values, table, n_blocks)
            if ncu:
                for _ in range(3):
                    ops.decode_partials(*call)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                return
            for kind, prec in [v for v in DECODE_VARIANTS if v != ("planes", "ieee")]:  # 2-13x slower (run 1)
                for warps, stages, unroll in smoke_configs(SWEEP[kind]) if smoke else SWEEP[kind]:
                    ops.DECODE_LAUNCH[kind] = (warps, stages, unroll)
                    for bps in sweep_splits(kind, unroll, smoke):
                        with decode_kernel(kind):
                            ms = bench(lambda b_=bps, p=prec, a=call: ops.decode_partials(*a, b_, p), smoke)
                        row = {"sweep_batch": bsz, "context": ctx, "kernel": kind, "precision": prec,
                               "warps": warps, "stages": stages, "unroll": unroll, "blocks_per_split": bps or "auto",
                               "kernel_ms": ms, "GB_per_s": packed / ms / 1e6}
                        RESULTS["timings"].append(row)
                        log("   " + json.dumps(row))
        try:  # registers and spills of the compiled variants (Triton's per-device cache of compiled kernels)
            for fn in (decode_split_kernel, decode_planes_kernel):
                for cache in fn.device_caches.values():
                    for kern in cache[0].values():
                        log(f"   compiled {fn.__name__}: warps={kern.metadata.num_warps} "
                            f"stages={kern.metadata.num_stages} regs={kern.n_regs} spills={kern.n_spills} "
                            f"shared={kern.metadata.shared}")
        except Exception as e:  # the cache's shape is Triton's internals
            log(f"   (registers not read: {type(e).__name__}: {e})")
    finally:
        ops.DECODE_LAUNCH.update(launch0)
    write()


def e2e_check(dev: torch.device, smoke: bool, args: argparse.Namespace) -> None:
    """KVarNCache as a user passes it, on a random-weight Llama (32 q / 8 KV heads, head_dim 128, 4 layers; bf16).

    Correctness: after a prefill and a few decode steps, the last logits with the packed path (the Triton decode seat
    on CUDA) against `attention="reference"` (PyTorch over the dequantized cache) on the same tokens; both read the
    same stored tiles (the store is deterministic), so they differ only by attention arithmetic: bound 2e-2 relative,
    the reference's (its attention runs in the model's bf16, the packed path in float32; the H200 gave 0.018 through
    the Triton decode and through PyTorch's packed path alike). The Triton launches are counted, so a silent fallback
    to PyTorch fails the check.
    Timing: median ms per decode step (CUDA-synchronized) of each cache after its own prefill."""

    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    from kvarn.integrations.transformers import KVarNCache, cache_kwarg
    from kvarn.kernels.triton import ops

    cfg = LlamaConfig(hidden_size=512 if smoke else 4096, intermediate_size=1024 if smoke else 14336,
                      num_attention_heads=8 if smoke else 32, num_key_value_heads=2 if smoke else 8,
                      head_dim=64 if smoke else 128, num_hidden_layers=2 if smoke else 4, vocab_size=32000,
                      max_position_embeddings=65536, attn_implementation="sdpa")
    torch.manual_seed(0)
    dtype = torch.float32 if smoke else torch.bfloat16
    with torch.device(dev):  # initialised on the device: 1.1e9 parameters take a while on the CPU
        model = LlamaForCausalLM(cfg).to(dtype).eval()
    kw = cache_kwarg(model)
    launches = [0]
    real = ops.decode_attention

    def counted(*a, **k):
        launches[0] += 1
        return real(*a, **k)

    ops.decode_attention = counted
    contexts = [300] if smoke else [int(c) for c in args.e2e_contexts.split(",")]
    steps = 3 if smoke else args.e2e_steps
    gen = torch.Generator().manual_seed(5)
    try:
        ids = torch.randint(100, 30000, (1, contexts[0] + 8), generator=gen).to(dev)

        @torch.no_grad()
        def logits(cache) -> torch.Tensor:
            model(ids[:, :contexts[0]], **{kw: cache}, use_cache=True, logits_to_keep=1)
            out = None
            for i in range(contexts[0], contexts[0] + 8):
                out = model(ids[:, i:i + 1], **{kw: cache}, use_cache=True).logits[0, -1].double()
            return out

        for preset in ("kvarn-k2v2-g128", "kvarn-auto-k2v2-g128"):
            launches[0] = 0
            got = logits(KVarNCache(cfg, preset))
            n_launch = launches[0]
            ref = logits(KVarNCache(cfg, preset, attention="reference"))
            rel = float((got - ref).norm() / ref.norm())
            same = bool(got.argmax() == ref.argmax())
            check(f"e2e {preset}: packed vs reference logits after {contexts[0]} + 8 tokens", rel <= 2e-2 and
                  (n_launch > 0 or smoke), rel=rel, argmax_same=same, triton_launches=n_launch)
        for ctx in contexts:
            ids = torch.randint(100, 30000, (1, ctx + steps + 3), generator=gen).to(dev)
            row = {"e2e_context": ctx, "steps": steps}
            for name in ("dynamic", "dynamic-no-cudnn", "kvarn-k2v2-g128", "kvarn-auto-k2v2-g128"):
                cache = DynamicCache(config=cfg) if name.startswith("dynamic") else KVarNCache(cfg, name)
                if dev.type == "cuda":  # cuDNN's SDPA plans per new KV length (docs/gpu, run 4)
                    torch.backends.cuda.enable_cudnn_sdp(name != "dynamic-no-cudnn")
                with torch.no_grad():
                    model(ids[:, :ctx], **{kw: cache}, use_cache=True, logits_to_keep=1)
                    times = []
                    for i in range(ctx, ctx + steps + 1):
                        if dev.type == "cuda":
                            torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        model(ids[:, i:i + 1], **{kw: cache}, use_cache=True)
                        if dev.type == "cuda":
                            torch.cuda.synchronize()
                        times.append(time.perf_counter() - t0)
                times = sorted(times[1:])  # the first step warms up
                row[f"{name}_ms"] = 1e3 * times[len(times) // 2]
                if ctx == contexts[-1] and not smoke and name != "dynamic":  # where a step's time goes: top operators
                    from torch.profiler import ProfilerActivity, profile

                    i = ctx + steps + 1
                    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                        model(ids[:, i:i + 1], **{kw: cache}, use_cache=True)
                        torch.cuda.synchronize()
                    log(f"   profile of one {name} step at {ctx}:\n" + prof.key_averages().table(
                        sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
                del cache
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            if dev.type == "cuda":
                torch.backends.cuda.enable_cudnn_sdp(True)
            for name in ("kvarn-k2v2-g128", "kvarn-auto-k2v2-g128"):
                row[f"{name}_vs_dynamic_tps"] = row["dynamic_ms"] / row[f"{name}_ms"]
                row[f"{name}_vs_no_cudnn_tps"] = row["dynamic-no-cudnn_ms"] / row[f"{name}_ms"]
            RESULTS["timings"].append(row)
            log("   " + json.dumps(row))
            write()
    finally:
        ops.decode_attention = real


def vllm_throughput(args: argparse.Namespace, out: Path) -> None:
    """Generated tokens/s of vLLM on this GPU, same model, prompts and KV budget: stock with a bf16 KV cache, stock
    with kv_cache_dtype="fp8", and the kvarn plugin (`--vllm-preset`); each engine in its own process through `kvarn
    bench vllm`'s runner (`kvarn.bench.vllm._engine`: one untimed warm-up request, then all prompts at once, greedy,
    ignore_eos), vLLM's default CUDA graph settings. Skipped, and recorded so, without vLLM or `--vllm-model`. The
    engine runs in the runner's process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that the runner's `register()` is the
    one it uses (a checkout on PYTHONPATH has no installed entry point); a kvarn run whose log lacks the plugin's
    page report is recorded as not active (its figure would be stock's)."""
    import os

    from kvarn.bench import vllm as vb

    why = vb.missing() or (None if args.vllm_model else "no --vllm-model given")
    if why is not None:
        log(f"   skipped: {why}")
        RESULTS["vllm"] = {"skipped": why}
        return
    n, t, m = (int(x) for x in args.vllm_prompts.split(","))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 30000, (t,), generator=gen).tolist() for _ in range(n)]  # ids any vocab has
    base = {"model": args.vllm_model, "dtype": "bfloat16", "max_model_len": t + m + 16, "max_num_seqs": n,
            "seed": 0, "kv_cache_memory_bytes": int(args.vllm_kv_gib * 2**30), "block_size": 128}
    runs = {"stock_bf16": {}, "stock_fp8": {"kv_cache_dtype": "fp8"},
            "kvarn": {"additional_config": {"kvarn": {"preset": args.vllm_preset}}}}
    RESULTS["vllm"] = {"model": args.vllm_model, "prompts": n, "prompt_len": t, "max_tokens": m,
                       "kv_gib": args.vllm_kv_gib, "runs": {}}
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    for name, extra in runs.items():
        try:
            row = vb._engine(name, {**base, **extra}, prompts, m)
        except Exception as e:  # one engine failing must not hide the others
            row = {"error": f"{type(e).__name__}: {str(e)[-500:]}"}
        RESULTS["vllm"]["runs"][name] = row
        log(f"   {name}: {json.dumps(row)}")
        write()
    rows = RESULTS["vllm"]["runs"]
    check("vLLM runs (stock bf16, stock fp8, kvarn active)", all("error" not in r for r in rows.values())
          and rows["kvarn"].get("kvarn_active", False))


def write() -> None:
    out = OUT[0]
    (out / "gpu_check.json").write_text(json.dumps(RESULTS, indent=2))
    lines = ["# kvarn Triton GPU check", "", f"Environment: {RESULTS.get('env')}", "",
             "Command: `bash kvarn/bench/gpu_check.sh`", ""]
    if RESULTS.get("env", {}).get("smoke"):
        lines += ["**Smoke run on the CPU interpreter: the timings measure the interpreter, not the kernels.**", ""]
    lines += ["## Correctness", "", "| check | ok | details |",
             "| --- | --- | --- |"]
    for c in RESULTS["checks"]:
        det = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in c.items()
                        if k not in ("name", "ok"))
        lines.append(f"| {c['name']} | {'PASS' if c['ok'] else 'FAIL'} | {det} |")
    dec = [r for r in RESULTS["timings"] if "context" in r and "batch" in r]
    if dec:
        cols = [k for k in ("packed_ms", "packed_kernel_only_ms", "packed_v1_ms", "packed_v1_kernel_only_ms",
                            "sdpa_bf16_ms", "flash_attn_bf16_ms", "ratio_packed_vs_sdpa",
                            "ratio_packed_kernel_only_vs_sdpa", "ratio_packed_v1_vs_sdpa")
                if any(k in r for r in dec)]
        lines += ["", "## Decode of one token (median ms; ratio < 1: packed faster)", "",
                  "| batch | context | " + " | ".join(cols) + " |", "|" + " --- |" * (len(cols) + 2)]
        for r in dec:
            cells = [f"{r[k]:.4g}" if isinstance(r.get(k), float) else str(r.get(k, r.get("error", "")))
                     for k in cols]
            lines.append(f"| {r['batch']} | {r['context']} | " + " | ".join(cells) + " |")
    st = [r for r in RESULTS["timings"] if "store_batch" in r]
    if st:
        lines += ["", "## Store of one tile per KV head and batch row (median ms)", "",
                  "| batch | " + " | ".join(k for k in st[0] if k != "store_batch") + " |",
                  "|" + " --- |" * len(st[0])]
        for r in st:
            lines.append(f"| {r['store_batch']} | " + " | ".join(f"{v:.4g}" for k, v in r.items()
                                                               if k != "store_batch") + " |")
    tf = [r for r in RESULTS["timings"] if "tf32_error" in r]
    if tf:
        lines += ["", "## tf32 decode error (measured, not checked; no caller uses tf32)", "",
                  "| case | max error / max abs V | tf32-rounded operands, emulated |", "| --- | --- | --- |"]
        lines += [f"| {r['tf32_error']} | {r['err_over_max_v']:.3g} | {r['err_tf32_emulated_over_max_v']:.3g} |"
                  for r in tf]
    sw = [r for r in RESULTS["timings"] if "sweep_batch" in r]
    if sw:
        lines += ["", "## Decode kernel alone: version x warps x stages x unroll x blocks per split (median ms, "
                  "packed bytes / time)", "",
                  "| batch | context | kernel | precision | warps | stages | unroll | blocks/split | ms | GB/s |",
                  "|" + " --- |" * 10]
        lines += [f"| {r['sweep_batch']} | {r['context']} | {r.get('kernel', 'tile')} | {r.get('precision', 'ieee')} "
                  f"| {r['warps']} | {r.get('stages', 3)} | {r.get('unroll', '-')} | {r['blocks_per_split']} | "
                  f"{r['kernel_ms']:.4g} | {r['GB_per_s']:.4g} |" for r in sw]
    e2e = [r for r in RESULTS["timings"] if "e2e_context" in r]
    if e2e:
        cols = [k for k in e2e[0] if k not in ("e2e_context", "steps")]
        lines += ["", "## Transformers cache, one decode step of a 4-layer random-weight model (median ms)", "",
                  "| context | " + " | ".join(cols) + " |", "|" + " --- |" * (len(cols) + 1)]
        for r in e2e:
            lines.append(f"| {r['e2e_context']} | " + " | ".join(f"{r[k]:.4g}" for k in cols) + " |")
    vl = RESULTS.get("vllm")
    if vl:
        lines += ["", "## vLLM generate throughput (`kvarn.bench.vllm_run`)", ""]
        if "skipped" in vl:
            lines.append(f"Skipped: {vl['skipped']}.")
        else:
            lines += [f"{vl['model']}, {vl['prompts']} prompts x {vl['prompt_len']} tokens, {vl['max_tokens']} "
                      f"generated each, KV budget {vl['kv_gib']} GiB", "", "| run | generated tokens/s | detail |",
                      "| --- | --- | --- |"]
            for name, r in vl["runs"].items():
                tps = f"{r['tokens_per_s']:.1f}" if "tokens_per_s" in r else ""
                tpot = r.get("tpot_mean_s")
                det = r.get("error") or f"KV tokens {r.get('kv_tokens')}, TPOT " + (
                    f"{tpot * 1e3:.2f} ms" if tpot is not None else "?") + (
                    f", kvarn active: {r['kvarn_active']}" if name == "kvarn" else "")
                lines.append(f"| {name} | {tps} | {det} |")
    if RESULTS["errors"]:
        lines += ["", "## Errors", ""] + [f"- {e['step']}: {e['error']}" for e in RESULTS["errors"]]
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
