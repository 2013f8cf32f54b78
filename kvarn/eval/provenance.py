"""What a results file records besides the results: config, versions, git revision, machine, time."""

from __future__ import annotations

import functools
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import torch


@functools.cache
def git_revision() -> str | None:
    """HEAD's short hash, with "-dirty" when tracked files differ from it (the figures came from uncommitted code).
    Taken once per process: `kvarn.eval.options.seed_everything` asks first, so a long run records the code it
    started with, not the checkout's state when it finished."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent,
                              timeout=5).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        return (head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")) or None
    except (OSError, subprocess.SubprocessError):
        return None


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo; else what platform knows): timings differ between machines of one kind."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model")) and ":" in line:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def provenance(**config: Any) -> dict[str, Any]:
    """What a results file records besides the results: config, versions, revision, machine, time."""
    import transformers

    import kvarn

    return {
        "config": config,
        "kvarn": kvarn.__version__,
        "git": git_revision(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": f"{platform.machine()} {cpu_model()} threads={torch.get_num_threads()}",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
