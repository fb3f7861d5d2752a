"""Real MPI jobs: errors, big messages, full buffers, no torch (see tests/mpi_scripts).

Each script runs once; each of its cases is its own pytest item (see conftest.py)."""

from __future__ import annotations

import pytest

ERRORS = [
    "bad-arguments",
    "timeout-and-cancel",
    "self-send",
    "late-arrival",
    "peer-closed",
    "closed-errors",
]
BUFFERS = ["600mib-message", "held-views-fallback", "copy-out", "order-across-paths"]
NOTORCH = ["shm", "shm-disabled", "shm-too-big"]
DOORBELL = ["rings-and-sleeps", "doorbell-off", "own-nodes"]


@pytest.mark.parametrize("case", ERRORS)
def test_errors_name_the_peer_on_subcommunicators(mpi_job, assert_case, case: str) -> None:
    job = mpi_job("errors.py", n=4, timeout=120)
    assert_case(job, case, range(4))


@pytest.mark.parametrize("case", BUFFERS)
def test_600mib_message_and_full_buffer_fallback(mpi_job, assert_case, case: str) -> None:
    job = mpi_job("buffers.py", n=2, timeout=240)
    assert_case(job, case, range(2))


@pytest.mark.parametrize("case", NOTORCH)
def test_numpy_only_without_torch(mpi_job, assert_case, case: str) -> None:
    job = mpi_job("notorch.py", n=2, timeout=120)
    assert_case(job, case, range(2))


@pytest.mark.parametrize("case", DOORBELL)
def test_doorbells_wake_sleeping_trackers(mpi_job, assert_case, case: str) -> None:
    job = mpi_job("doorbell.py", n=3, timeout=120)
    assert_case(job, case, range(3))


@pytest.mark.parametrize("case", ["default", "copied", "streamed", "mpi", "bad-out"])
def test_receive_into_the_callers_tensor(mpi_job, assert_case, case: str) -> None:
    # irecv(out=...) on every path; posted first, the bytes land in place (no new buffer).
    job = mpi_job("recv_out.py", n=2, timeout=180)
    assert_case(job, case, range(2))


@pytest.mark.parametrize("case", ["pulled-into-out", "refused-at-start", "refused-later"])
def test_receive_into_the_callers_tensor_by_pulling(mpi_job, assert_case, case: str) -> None:
    # The pull path (smp_comm.cma): one copy, the send open until read, both fallbacks.
    job = mpi_job("recv_pull.py", n=2, timeout=180)
    assert_case(job, case, range(2))
