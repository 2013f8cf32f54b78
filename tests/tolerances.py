"""Tolerances shared by the tests, one named constant each, with the reason beside it.

The derivations are in the docstrings of the test modules that first stated them (named below); the bounds of one
stored tile against the float64 oracle live with that oracle, in tests/reference/store_check.py. A literal that
one assertion uses once stays beside that assertion and its stated reason.
"""

from __future__ import annotations

import torch

EPS32 = torch.finfo(torch.float32).eps  # float32 machine epsilon: the unit of every float32 rounding bound

# fp16-rounded stored fields (tests/quant/test_affine.py): a float32 value cast to fp16 moves by at most half an ulp
FP16_U = 2.0**-11 * (1 + 1e-6)  # relative half-ulp of fp16 (and the float32 -> fp16 cast)
FP16_ETA = 2.0**-25  # half the spacing of fp16 subnormals: absolute rounding error near zero

# Packed attention against the float64 oracle (tests/attention/test_attention.py, tests/kernels/test_cpu_decode.py)
ATTN_F64_REL = 1e-9  # float64 queries: x (1 + max|V|); measured ~1e-14, room for summation order over ~100s of terms
ATTN_F32 = 64 * EPS32  # float32 queries: x (1 + L) (1 + max|V|), L = max sum_d |q_d k_d| * scaling (logit rounding)

# The fused CPU tile store against the PyTorch reference (tests/kernels/test_cpu_store.py): the stds of VarN taken
# in double vs float32 sums agree to ~2^-24 relative; through 8 Sinkhorn steps a float32 scale moves <= ~32 ulp
SCALE_DRIFT = 1e-5

# Baseline codes against their float64 references (tests/quant/test_baselines.py): a code may move to its neighbour
# where the unrounded value lies within this many code units of a decision boundary
CODE_TIE_F64 = 1e-9  # the implementation computes in float64
CODE_TIE_F32 = 1e-4  # the implementation computes in float32

# Logits of two paths computing the same float32 attention in another order (tests/integrations/test_transformers.py):
# |diff| <= LOGITS_REL (1 + max|ref|); float32 rounding (~1e-7 relative per op) through a small model stays far below
LOGITS_REL = 1e-4
