"""Float64 oracles written plainly (loops over tiles, rows and elements) from docs/SPEC.md, not from kvarn's code.

They are slow on purpose: every step is spelled out so a reader can check it against the SPEC text.
Tests compare kvarn's vectorized ops with them at stated tolerances.
"""
