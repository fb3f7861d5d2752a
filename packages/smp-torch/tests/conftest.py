"""Helpers for launching the MPI scripts in ``tests/scripts``."""

from __future__ import annotations

import json
import os
from typing import Any

import pipeline_modes
import pytest
from smp_comm.testing import run_mpi

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")


# A 16 MiB shared-memory receive buffer per rank instead of the 128 MiB default: the test
# jobs' messages are small (a larger one takes the MPI path, also tested), and reserving
# 128 MiB in /dev/shm (posix_fallocate) stalled one rank 0.4-9.9 s at a communicator's
# creation, intermittently, on the 2-core CI machine (docs/perf-notes.md): an equivalence
# job of 10 cases took 20-47 s with it and ~7 s without. The default size stays covered by
# smp-comm's own suite and by test_examples / test_big_model, which run as a user would.
SMALL_SHM = {"SMP_COMM_BUFFER_BYTES": str(16 << 20)}


def launch(
    script: str, nprocs: int, *args: Any, timeout: float = 180.0, launcher_args: tuple[str, ...] = ()
) -> str:
    """Run ``scripts/<script>`` on ``nprocs`` ranks; JSON-encode non-string arguments."""
    argv = [os.path.join(SCRIPTS, script)]
    argv += [a if isinstance(a, str) else json.dumps(a) for a in args]
    env = {"OMP_NUM_THREADS": "1", "SMP_CONFIG": "", **SMALL_SHM}
    return run_mpi(argv, nprocs, timeout=timeout, env=env, launcher_args=launcher_args)


def ok_cases(out: str) -> list[str]:
    return [line.split()[1] for line in out.splitlines() if line.startswith("CASE-OK ")]


# Rows of the fault suite's table (tests/faults): (fault, config, victim, launcher, seconds
# from the fault until the last rank ended, message), printed in the terminal summary.
FAULT_TABLE = pytest.StashKey[list[tuple[str, str, str, str, float, str]]]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[FAULT_TABLE] = []


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    tr = terminalreporter
    modes = pipeline_modes.summary_lines()
    if modes:
        tr.write_sep("=", f"pipeline mode overlay ({pipeline_modes.ENV_MODE})")
        for line in modes:
            tr.write_line(line)
    rows = config.stash.get(FAULT_TABLE, [])
    if not rows:
        return
    tr.write_sep("=", "fault table: seconds from the fault until the last rank ended")
    tr.write_line(f"{'fault':<15}{'config':<8}{'victim':<18}{'launcher':<22}{'last exit s':>11}  message")
    for fault, cfg, victim, launcher, seconds, message in rows:
        tr.write_line(f"{fault:<15}{cfg:<8}{victim:<18}{launcher:<22}{seconds:>11.2f}  {message}")
