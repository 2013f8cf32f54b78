"""The rich console every command prints its tables to."""

from __future__ import annotations

import sys

from rich.console import Console


def console() -> Console:
    """A terminal keeps its own width; piped or redirected output gets 200 columns rather than rich's 80, so
    tables written to a log or a file keep their numbers whole."""
    return Console(width=None if sys.stdout.isatty() else 200)
