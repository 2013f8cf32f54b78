"""Benchmarks: speed and memory measured side by side in one process, reported as ratios."""
