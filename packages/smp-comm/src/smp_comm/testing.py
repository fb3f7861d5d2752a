"""Helpers for tests that launch real MPI jobs (used by smp-comm and the packages above it).

``run_mpi`` starts ``mpiexec -n N python ARGS`` with a hard timeout. When the job hangs or
fails, it kills the whole process group and raises with every rank's output, so a broken
distributed test fails fast and says why instead of hanging CI.

``LoopbackWorld`` (from :mod:`smp_comm.loopback`) runs ranks as threads of one process,
for tests of code built on the communicator that need no MPI job.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence

from smp_comm.loopback import LoopbackCommunicator, LoopbackWorld

__all__ = [
    "FAST_EXIT_SITE",
    "LoopbackCommunicator",
    "LoopbackWorld",
    "MPIRunError",
    "mpiexec_path",
    "run_mpi",
]

#: A directory whose ``sitecustomize`` freezes the garbage collector at exit (``fast_exit``).
FAST_EXIT_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fast_exit_site")


class MPIRunError(AssertionError):
    """An MPI job exited non-zero or ran past its timeout; the message holds its output."""


def mpiexec_path() -> str:
    """The ``mpiexec`` beside the running interpreter (the ``mpich`` wheel), else on PATH."""
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.access(local, os.X_OK):
        return local
    found = shutil.which("mpiexec")
    if found is None:
        raise MPIRunError("mpiexec not found: `pip install mpich` or load a system MPI")
    return found


def run_mpi(
    args: Sequence[str],
    nprocs: int,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    launcher_args: Sequence[str] = (),
    fast_exit: bool = False,
) -> str:
    """Run ``mpiexec [launcher_args] -n nprocs python *args``; return the combined output of
    all ranks.

    ``fast_exit``: each rank freezes the garbage collector's objects as its last exit handler
    (:data:`FAST_EXIT_SITE` on ``PYTHONPATH``), so interpreter finalization skips collecting
    them: 0.4-1 s less per job of 2-4 ranks with torch imported, about 3 s for a rank that
    built a large model. For jobs whose exit is not what they test: a job that checks how
    ranks end after a failure must exit as a user's process does.

    ``launcher_args`` go to ``mpiexec`` itself, e.g. Hydra's ``-disable-auto-cleanup`` for a
    job whose ranks end with ``os._exit`` (without it, the first such exit makes the launcher
    kill the others, and the job's status depends on which exit it saw first).
    Raises :class:`MPIRunError` (with the output) on a non-zero exit or after ``timeout``
    seconds, having killed every process of the job.
    """
    cmd = [mpiexec_path(), *launcher_args, "-n", str(nprocs), sys.executable, *args]
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env["PYTHONUNBUFFERED"] = "1"
    if env:
        full_env.update(env)
    if fast_exit:
        full_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (FAST_EXIT_SITE, full_env.get("PYTHONPATH", "")) if p
        )
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=full_env,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, _ = proc.communicate()
        raise MPIRunError(
            f"{' '.join(cmd)} timed out after {timeout:.0f}s; output of all ranks:\n{out}"
        ) from None
    if proc.returncode != 0:
        raise MPIRunError(f"{' '.join(cmd)} exited {proc.returncode}; output:\n{out}")
    return out
