"""The exit protocol after a failed step (smp_comm.shutdown) under a launcher that kills a
job whose rank leaves without the C library's exit: see mpi_scripts/slow_exit.py."""

from __future__ import annotations

from pathlib import Path

from smp_comm.testing import MPIRunError, run_mpi

SCRIPT = Path(__file__).parent / "mpi_scripts" / "slow_exit.py"


def test_exit_waits_for_a_slow_peer_until_the_deadline(tmp_path: Path) -> None:
    """Regression: with the fixed 3 s wait, a peer slower than that to exit made this rank
    leave with os._exit, and MPICH's launcher killed the job (exit 9)."""
    out = run_mpi([str(SCRIPT), str(tmp_path), "deadline"], 3, timeout=90)
    for r in range(3):  # (peers unseen and no check: point 3a does not apply)
        assert f"rank {r} exits normally" in out, out
    assert "still blocked" in out and "leaving" not in out, out


def test_without_a_deadline_peers_seen_in_proc_are_waited_for(tmp_path: Path) -> None:
    """No deadline, but every peer's process is known and on this host (as every
    Communicator makes them known): the exit waits for the slow peer too (the smp-pipeline
    tests' exit after a failed step, whose peer's end releases a blocked collective)."""
    out = run_mpi([str(SCRIPT), str(tmp_path), "seen"], 3, timeout=90)
    assert "rank 2 exits normally" in out, out
    for r in range(2):  # (each waits a while for the other's end, then finalizes: point 4)
        left = f"rank {r}: thread(s) blocked-collective released and every other rank has ended"
        assert f"rank {r} exits normally" in out or left in out, out
    assert "still blocked" in out and "leaving with status" not in out, out


def test_a_thread_released_by_the_peers_ends_skips_finalization(tmp_path: Path) -> None:
    """Point 3a: the one rank whose thread was blocked leaves without interpreter
    finalization once every peer has ended (torch's native threads may still touch the
    failed collective's tensors, which aborted a CI run in finalization); the job ends
    normally."""
    out = run_mpi([str(SCRIPT), str(tmp_path), "released"], 3, timeout=90)
    assert "rank 1 exits normally" in out and "rank 2 exits normally" in out, out
    assert "rank 0: thread(s) blocked-collective released and every other rank has ended" in out, out
    assert "rank 0 exits normally" not in out and "leaving with status" not in out, out


def test_without_a_deadline_the_launcher_kills_the_job(tmp_path: Path) -> None:
    """What the deadline prevents (this also shows the test above can fail)."""
    try:
        out = run_mpi([str(SCRIPT), str(tmp_path), "none"], 3, timeout=90)
    except MPIRunError as failed:  # (the launcher's status: 9, or 0 if it saw rank 0 first)
        out = str(failed)
    assert "after MPI finalized (the exit deadline passed); leaving with status 0" in out, out
    assert "rank 2 exits normally" not in out, out  # killed by the launcher


def test_exit_ends_once_every_peer_has_ended(tmp_path: Path) -> None:
    """A thread blocked for good (a module that never returns) holds the exit only until
    every other rank's process has ended, not until the deadline (60 s ahead here): rank 1
    leaves about when rank 0 ends, and the launcher kills nobody (rank 0 ends normally)."""
    out = run_mpi([str(SCRIPT), str(tmp_path), "peers_ended"], 2, timeout=40)
    assert "rank 0 exits normally" in out, out
    assert "after MPI finalized (every other rank has ended); leaving with status 0" in out, out


def test_the_settle_pause_grows_with_the_load_per_core() -> None:
    from smp_comm.shutdown import SETTLE_S, settle_seconds

    assert settle_seconds(load=0.3, cores=2) == SETTLE_S  # an idle host: the base pause
    assert settle_seconds(load=2.0, cores=2) == SETTLE_S
    assert settle_seconds(load=6.0, cores=2) == 3 * SETTLE_S  # three runnable per core
    assert settle_seconds(load=60.0, cores=2) == 4.0  # bounded
