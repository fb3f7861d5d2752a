"""Shared helpers: run a script of ``tests/mpi_scripts`` under mpiexec, once per job.

A script runs several cases in one job (starting MPI jobs is what the suite's time goes
to) and prints ``rank R CASE-OK [case]`` after each. The tests make one pytest item per
case: :func:`mpi_job` launches a job the first time any of its items asks and caches the
outcome for the others, and :func:`assert_case` fails an item, naming its case, unless
every rank reported the case and the job as a whole succeeded (a failed or hung job fails
every item of it, never skips them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from smp_comm.testing import MPIRunError, run_mpi

SCRIPTS = Path(__file__).parent / "mpi_scripts"


@dataclass(frozen=True)
class Job:
    """The outcome of one MPI job: all ranks' output, and why it failed (None: it did not)."""

    output: str
    failure: str | None


_JOBS: dict[tuple[object, ...], Job] = {}


@pytest.fixture(scope="session")
def mpi_job() -> Callable[..., Job]:
    """``mpi_job(name, *args, n=2, timeout=120, env=None, launcher_args=()) -> Job``,
    launched once per distinct call in the session."""

    def run(
        name: str,
        *args: str,
        n: int = 2,
        timeout: float = 120,
        env: Mapping[str, str] | None = None,
        launcher_args: tuple[str, ...] = (),
    ) -> Job:
        key = (name, args, n, tuple(sorted((env or {}).items())), launcher_args)
        if key not in _JOBS:
            try:
                out = run_mpi(
                    [str(SCRIPTS / name), *args],
                    nprocs=n,
                    timeout=timeout,
                    env=env,
                    cwd=str(SCRIPTS),
                    launcher_args=launcher_args,
                )
                _JOBS[key] = Job(out, None)
            except MPIRunError as exc:
                _JOBS[key] = Job(str(exc), str(exc).splitlines()[0])
        return _JOBS[key]

    return run


def assert_case(job: Job, case: str, ranks: Sequence[int]) -> None:
    """Fail unless every rank of ``ranks`` printed ``CASE-OK [case]`` and the job succeeded;
    the message names the case and shows its lines, then the job's whole output."""
    # Searched in the whole output, not line by line: the launcher may splice two ranks'
    # lines together (it interleaves their output write by write).
    missing = [r for r in ranks if f"rank {r} CASE-OK [{case}]" not in job.output]
    if not missing and job.failure is None:
        return
    mine = [line for line in job.output.splitlines() if f"[{case}]" in line]
    if missing:
        why = f"case {case!r}: ranks {missing} did not report it"
    else:
        why = f"case {case!r} passed on every rank, but the job failed afterwards"
    if job.failure is not None:
        why += f" ({job.failure})"
    pytest.fail(
        f"{why}\n--- lines naming {case!r}:\n"
        + ("\n".join(mine) or "(none)")
        + f"\n--- the job's output:\n{job.output}",
        pytrace=False,
    )


@pytest.fixture(name="assert_case")
def assert_case_fixture() -> Callable[[Job, str, Sequence[int]], None]:
    """:func:`assert_case`, for the test modules."""
    return assert_case


@pytest.fixture
def mpi_script():
    """``mpi_script(name, *args, n=2, timeout=120, env=None) -> output of all ranks``."""

    def run(name: str, *args: str, n: int = 2, timeout: float = 120, env=None) -> str:
        return run_mpi(
            [str(SCRIPTS / name), *args], nprocs=n, timeout=timeout, env=env, cwd=str(SCRIPTS)
        )

    return run
