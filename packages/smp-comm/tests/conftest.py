"""Shared helpers: run a script of ``tests/mpi_scripts`` under mpiexec."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from smp_comm.testing import run_mpi

SCRIPTS = Path(__file__).parent / "mpi_scripts"


def shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:  # pragma: no cover - not Linux
        return set()


@pytest.fixture
def mpi_script():
    """``mpi_script(name, *args, n=2, timeout=120, env=None) -> output``; also checks that
    the job left no new entry in ``/dev/shm``."""

    def run(name: str, *args: str, n: int = 2, timeout: float = 120, env=None) -> str:
        before = shm_entries()
        out = run_mpi(
            [str(SCRIPTS / name), *args], nprocs=n, timeout=timeout, env=env, cwd=str(SCRIPTS)
        )
        # Other MPI jobs on this machine create (and unlink a moment later) their own
        # segments; a leak of ours is one that is still there after a grace period.
        deadline = time.monotonic() + 5.0
        leftover = shm_entries() - before
        while leftover and time.monotonic() < deadline:
            time.sleep(0.2)
            leftover &= shm_entries()
        assert not leftover, f"leftover /dev/shm entries after {name}: {sorted(leftover)}"
        return out

    return run
