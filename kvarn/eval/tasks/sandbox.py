"""Run untrusted generated code: a fresh `python -I` subprocess in its own session and an empty temporary folder,
with a wall-clock timeout (its whole process group killed), resource limits (address space, CPU seconds, file size,
processes, open files) and no network (a new network namespace where the OS allows it, sockets disabled in any
case). Good enough for HumanEval's completions from a small model; not a security boundary against an adversary.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

# Runs in the child before the program: no sockets, then the program from stdin.
_PRELUDE = r"""
import ctypes, socket, sys
try:
    ctypes.CDLL(None, use_errno=True).unshare(0x40000000)  # CLONE_NEWNET: an empty network namespace, if permitted
except Exception:
    pass
def _no_network(*args, **kwargs):
    raise OSError("network access is disabled in the sandbox")
socket.socket = socket.create_connection = socket.getaddrinfo = _no_network
source = sys.stdin.read()
del ctypes, socket
exec(compile(source, "<completion>", "exec"), {"__name__": "__main__"})
"""


@dataclass(frozen=True)
class Limits:
    seconds: float = 10.0  # wall clock
    memory_mb: int = 1024  # address space
    cpu_seconds: int = 10
    file_mb: int = 16
    processes: int = 64  # RLIMIT_NPROC (the kernel ignores it for root)
    open_files: int = 64


@dataclass(frozen=True)
class Result:
    passed: bool
    status: str  # "passed", "failed", "timeout"
    detail: str  # the last line of stderr, or why


def _limit(limits: Limits):
    def apply() -> None:
        import resource

        mb = 1 << 20
        for name, value in (("RLIMIT_AS", limits.memory_mb * mb), ("RLIMIT_CPU", limits.cpu_seconds),
                            ("RLIMIT_FSIZE", limits.file_mb * mb), ("RLIMIT_NPROC", limits.processes),
                            ("RLIMIT_NOFILE", limits.open_files), ("RLIMIT_CORE", 0)):
            res = getattr(resource, name, None)
            if res is not None:
                resource.setrlimit(res, (value, value))

    return apply


def run_program(source: str, limits: Limits = Limits()) -> Result:
    """Execute `source`; passed when it exits 0 within the limits."""
    with tempfile.TemporaryDirectory(prefix="kvarn-sandbox-") as tmp:
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "PYTHONDONTWRITEBYTECODE": "1",
               "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _PRELUDE], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=tmp, env=env,
                                start_new_session=True, preexec_fn=_limit(limits), text=True)
        try:
            _, err = proc.communicate(source, timeout=limits.seconds)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return Result(False, "timeout", f"exceeded {limits.seconds:g} s")
    if proc.returncode == 0:
        return Result(True, "passed", "")
    lines = [x for x in (err or "").strip().splitlines() if x.strip()]
    return Result(False, "failed", lines[-1][:300] if lines else f"exit code {proc.returncode}")
