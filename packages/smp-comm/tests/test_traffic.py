"""Multi-threaded random-order traffic with every payload kind, each path forced in turn."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    ("mode", "n"),
    [("shm", 3), ("rma", 3), ("mpi-disabled", 3), ("mpi-tiny", 2), ("mixed", 4)],
)
def test_traffic(mpi_script, mode: str, n: int) -> None:
    out = mpi_script("traffic.py", mode, n=n, timeout=180)
    for r in range(n):
        assert f"rank {r} OK {mode}" in out, out
