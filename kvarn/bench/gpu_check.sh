#!/usr/bin/env bash
# One prepared check of kvarn's Triton kernels on a CUDA machine: correctness vs float64 on real-size shapes, then
# timing of fused packed decode vs SDPA (and FlashAttention if installed) over dense bf16 K/V at 4k-32k context.
# Installs nothing: needs python with torch (CUDA) and triton; kvarn is this checkout (PYTHONPATH, no install;
# kvarn.kernels.triton needs only torch + triton). Writes $OUT/gpu_check.{json,md,log} ($OUT defaults to
# ./gpu_check_out). Exit status: 0 all checks pass, 1 a check failed, 2 the environment is not usable.
# Step 5 checks the vLLM plugin's CUDA path on one layer (no vLLM needed); step 6 times vLLM (stock bf16, stock fp8,
# kvarn) when vLLM is installed and a local model folder is given (--vllm-model DIR), else it is skipped.
#   bash kvarn/bench/gpu_check.sh [--contexts 4096,8192] [--batches 1] [--vllm-model DIR]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
LOG="$OUT/gpu_check.log"
echo "== kvarn Triton GPU check: $(date -u) on $(hostname)" | tee "$LOG"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$LOG"
unset TRITON_INTERPRET  # a leftover interpreter setting would run the kernels on the CPU
"$PY" - <<'PY' 2>&1 | tee -a "$LOG"
import sys
try:
    import torch
except Exception as e:
    sys.exit(f"ENV FAIL: torch does not import: {e}")
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if not torch.cuda.is_available():
    sys.exit("ENV FAIL: torch sees no CUDA device")
try:
    import triton
except Exception as e:
    sys.exit(f"ENV FAIL: triton does not import ({e}); pip install triton matching this torch")
print("triton", triton.__version__, "device", torch.cuda.get_device_name(0))
PY
status=${PIPESTATUS[0]}
if [ "$status" -ne 0 ]; then echo "environment not usable (see above)" | tee -a "$LOG"; exit 2; fi
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}" \
  timeout "${GPU_CHECK_TIMEOUT:-540}" "$PY" -m kvarn.bench.gpu_check --out "$OUT" "$@" 2>&1 | tee -a "$LOG"
status=${PIPESTATUS[0]}
[ "$status" -eq 124 ] && echo "kvarn.bench.gpu_check timed out; partial results (if any) in $OUT" | tee -a "$LOG"
echo "== exit $status; results: $OUT/gpu_check.md" | tee -a "$LOG"
exit "$status"
