"""Shared helper: run a script of ``tests/mpi_scripts`` under mpiexec."""

from __future__ import annotations

from pathlib import Path

import pytest
from smp_comm.testing import run_mpi

SCRIPTS = Path(__file__).parent / "mpi_scripts"


@pytest.fixture
def mpi_script():
    """``mpi_script(name, *args, n=2, timeout=120, env=None) -> output of all ranks``."""

    def run(name: str, *args: str, n: int = 2, timeout: float = 120, env=None) -> str:
        return run_mpi(
            [str(SCRIPTS / name), *args], nprocs=n, timeout=timeout, env=env, cwd=str(SCRIPTS)
        )

    return run
