"""Heap settings for long runs that grow caches block by block."""

from __future__ import annotations

import ctypes


def release_freed_buffers(threshold: int = 128 * 1024) -> bool:
    """glibc only: serve every allocation >= `threshold` bytes with mmap, so freed buffers go back to the OS.

    Caches grow by concatenation at every block, so each step frees a buffer slightly smaller than the next one;
    glibc's adaptive mmap threshold then moves such buffers onto the heap, which fragments. Measured on the
    embedded model (one quantized run + reference over 2,048 tokens): RSS growth 1.52 GB -> 0.56 GB; a 4k
    pseudo-decode of 13 runs reached 13 GB at half length without it. Returns whether the setting applied.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-3, threshold))  # M_MMAP_THRESHOLD; fixing it also disables the adaptation
    except (OSError, AttributeError):
        return False
