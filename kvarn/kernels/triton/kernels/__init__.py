"""The `@triton.jit` code of kvarn's GPU kernels (launched by `kvarn.kernels.triton.ops`, never directly)."""
