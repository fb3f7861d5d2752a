"""Helpers for launching the MPI scripts in ``tests/scripts``."""

from __future__ import annotations

import json
import os
from typing import Any

from smp_comm.testing import run_mpi

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")


def launch(
    script: str, nprocs: int, *args: Any, timeout: float = 180.0, launcher_args: tuple[str, ...] = ()
) -> str:
    """Run ``scripts/<script>`` on ``nprocs`` ranks; JSON-encode non-string arguments."""
    argv = [os.path.join(SCRIPTS, script)]
    argv += [a if isinstance(a, str) else json.dumps(a) for a in args]
    env = {"OMP_NUM_THREADS": "1", "SMP_CONFIG": ""}
    return run_mpi(argv, nprocs, timeout=timeout, env=env, launcher_args=launcher_args)


def ok_cases(out: str) -> list[str]:
    return [line.split()[1] for line in out.splitlines() if line.startswith("CASE-OK ")]
