"""Run a script under ``python -m torch.distributed.run`` with a hard timeout."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).parent / "scripts"
FAST_EXIT_SITE = Path(__file__).parent / "fast_exit_site"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_torchrun(
    script: str, nprocs: int, *args: str, timeout: float = 120.0, fast_exit: bool = False
) -> tuple[int, str]:
    """Launch ``nprocs`` ranks of ``scripts/<script>``; return ``(exit status, combined
    output)``. On a timeout the whole process group is killed and an AssertionError shows
    every rank's output. ``fast_exit``: ``fast_exit_site`` on ``PYTHONPATH`` (for jobs whose
    exit is not what they test)."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nprocs),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        str(SCRIPTS / script), *args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCHELASTIC_ERROR_FILE="")
    if fast_exit:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(FAST_EXIT_SITE), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{script} with {nprocs} ranks timed out after {timeout}s:\n{out}") from None
    return proc.returncode, out


def torchrun(script: str, nprocs: int, *args: str, timeout: float = 120.0) -> str:
    """Launch ``nprocs`` ranks of ``scripts/<script>``; return the combined output.

    On a non-zero exit or a timeout the whole process group is killed and every rank's
    output is shown in the assertion message.
    """
    rc, out = run_torchrun(script, nprocs, *args, timeout=timeout, fast_exit=True)
    if rc != 0:
        raise AssertionError(f"{script} with {nprocs} ranks failed (rc={rc}):\n{out}")
    return out
