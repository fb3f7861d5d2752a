"""Real MPI jobs: errors, big messages, full buffers, no torch (see tests/mpi_scripts)."""

from __future__ import annotations


def test_errors_name_the_peer_on_subcommunicators(mpi_script) -> None:
    out = mpi_script("errors.py", n=4, timeout=120)
    assert out.count("OK errors") == 4, out


def test_600mib_message_and_full_buffer_fallback(mpi_script) -> None:
    out = mpi_script("buffers.py", n=2, timeout=240)
    assert out.count("OK buffers") == 2, out


def test_numpy_only_without_torch(mpi_script) -> None:
    out = mpi_script("notorch.py", n=2, timeout=120)
    assert out.count("OK notorch") == 2, out


def test_doorbells_wake_sleeping_trackers(mpi_script) -> None:
    out = mpi_script("doorbell.py", n=3, timeout=120)
    for r in range(3):
        assert f"rank {r} OK doorbell" in out, out
