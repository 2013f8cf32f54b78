"""Triton GPU kernels: fused decode attention on packed KVarN tiles (split-K, online softmax, GQA, block table)
and the tile store (Hadamard + VarN + RTN + pack into a paged pool). Optional: `pip install "kvarn[triton]"`.

`available()` says whether triton imports; the kernels live in `ops` (launch wrappers) and `attention`
(the transformers-cache adapter), imported on use so that `import kvarn.kernels.triton` never needs triton.
"""

from __future__ import annotations

import importlib.util


def available() -> bool:
    """Whether the `triton` package is installed (kernels also need CUDA tensors or TRITON_INTERPRET=1)."""
    return importlib.util.find_spec("triton") is not None
