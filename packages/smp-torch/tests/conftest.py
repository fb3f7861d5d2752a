"""Helpers for launching the MPI scripts in ``tests/scripts``."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

import pipeline_modes
import pytest
from smp_comm.testing import MPIRunError, run_mpi

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")


# A 16 MiB shared-memory receive buffer per rank instead of the 128 MiB default: the test
# jobs' messages are small (a larger one takes the MPI path, also tested), and reserving
# 128 MiB in /dev/shm (posix_fallocate) stalled one rank 0.4-9.9 s at a communicator's
# creation, intermittently, on the 2-core CI machine (docs/perf-notes.md): an equivalence
# job of 10 cases took 20-47 s with it and ~7 s without. The default size stays covered by
# smp-comm's own suite and by test_examples / test_big_model, which run as a user would.
SMALL_SHM = {"SMP_COMM_BUFFER_BYTES": str(16 << 20)}


def launch(
    script: str,
    nprocs: int,
    *args: Any,
    timeout: float = 180.0,
    launcher_args: tuple[str, ...] = (),
    fast_exit: bool = True,
) -> str:
    """Run ``scripts/<script>`` on ``nprocs`` ranks; JSON-encode non-string arguments.

    ``fast_exit`` (``run_mpi``'s): off for a job that checks how the ranks end after a failure,
    so they exit as a user's processes do."""
    argv = [os.path.join(SCRIPTS, script)]
    argv += [a if isinstance(a, str) else json.dumps(a) for a in args]
    env = {"OMP_NUM_THREADS": "1", "SMP_CONFIG": "", **SMALL_SHM}
    return run_mpi(argv, nprocs, timeout=timeout, env=env, launcher_args=launcher_args, fast_exit=fast_exit)


def ok_cases(out: str) -> list[str]:
    return [line.split()[1] for line in out.splitlines() if line.startswith("CASE-OK ")]


FAILED = "THE SHARED JOB FAILED"


class SharedJob:
    """The case lists of several tests run by ONE launch of a script that takes a JSON list
    of cases (``CASE-OK <name>`` per case). Every launch costs its ranks' imports of torch and
    smp (5-20 s for 4 ranks on the 2-core CI machine, more than many groups' cases take), so
    tests of one script and world size share it: the first test that asks runs every group
    registered by then, in order, and each test then checks its own group's cases.

    The job's bound is the sum of its groups' own bounds (each group keeps the time it had as
    a job of its own). A case that fails ends the job: its group fails, and so does every
    group after it (its cases never ran), each with the whole output. ``with_dir``: the
    script's first argument is a scratch directory (``checkpointing.py``), made for the job.
    """

    def __init__(self, script: str, nprocs: int, with_dir: bool = False) -> None:
        self.script, self.nprocs, self.with_dir = script, nprocs, with_dir
        self.groups: dict[str, list[dict]] = {}
        self.timeout = 0.0
        self.out: str | None = None

    def add(self, group: str, cases: list[dict], timeout: float) -> None:
        """Register ``group``'s cases (before the job runs) with the bound its job had."""
        assert self.out is None, f"{self.script}: group {group!r} added after the job ran"
        names = [c["name"] for c in cases]
        taken = {c["name"] for g in self.groups.values() for c in g}
        assert group not in self.groups and not taken & set(names), (group, taken & set(names))
        self.groups[group] = cases
        self.timeout += timeout

    def _run(self) -> str:
        cases = [c for g in self.groups.values() for c in g]
        scratch = tempfile.mkdtemp(prefix="smp-shared-") if self.with_dir else None
        args: list[Any] = [scratch] if scratch else []
        try:
            return launch(self.script, self.nprocs, *args, cases, timeout=self.timeout)
        except MPIRunError as exc:  # judged per group: the groups before the failure passed
            return f"{FAILED}\n{exc}"
        finally:
            if scratch:
                shutil.rmtree(scratch, ignore_errors=True)

    def output(self) -> str:
        """The job's output (every rank's), running it on the first call."""
        if self.out is None:
            self.out = self._run()
        return self.out

    def check(self, group: str, expect: list[str] | None = None) -> str:
        """Assert that every case of ``group`` (or those named in ``expect``: a case that must
        fail prints no ``CASE-OK``) passed, in order; return the job's output."""
        out = self.output()
        names = [c["name"] for c in self.groups[group]]
        want = names if expect is None else expect
        got = [n for n in ok_cases(out) if n in set(names)]
        assert got == want, f"group {group!r}: {got} passed of {want}\n{out}"
        if out.startswith(FAILED):
            # Passed only if a later case is what failed (not this group's exit or teardown).
            order = [c["name"] for g in self.groups.values() for c in g]
            later = order[order.index(names[-1]) + 1 :]
            assert set(later) - set(ok_cases(out)), f"group {group!r}: the job failed after its cases\n{out}"
        return out


# Launches shared across test modules (each module adds its groups at import, before any
# test runs; the bounds summed stay within pytest's 1200 s per test).
EQUIVALENCE_TWO = SharedJob("equivalence.py", 2)  # test_delayed, test_equivalence
EQUIVALENCE_FOUR = SharedJob("equivalence.py", 4)  # test_delayed, test_equivalence
CHECKPOINT_FOUR = SharedJob("checkpointing.py", 4, with_dir=True)  # test_checkpoint, test_sharded


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
