"""Multi-threaded random-order traffic with every payload kind, each path forced in turn.

One MPI job per mode; one pytest item per case of it (see conftest.py)."""

from __future__ import annotations

import pytest

MODES = [
    ("shm", 3),
    ("rma", 3),
    ("mpi-disabled", 3),
    ("mpi-tiny", 2),
    ("mixed", 4),
    ("stream", 3),
    ("stream-copy", 2),
    ("stream-rma", 2),
    ("stream-mpi", 2),
    ("stream-both", 3),
]
CASES = ["threaded-traffic", "views-survive", "first-posted-wins", "path-stats", "close"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(("mode", "n"), MODES)
def test_traffic(mpi_job, assert_case, mode: str, n: int, case: str) -> None:
    job = mpi_job("traffic.py", mode, n=n, timeout=180)
    assert_case(job, case, range(n))
    if case == CASES[-1]:
        for r in range(n):
            assert f"rank {r} OK {mode}" in job.output, job.output
