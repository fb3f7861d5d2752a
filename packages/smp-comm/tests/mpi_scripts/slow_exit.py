"""Usage: slow_exit.py MARKER_DIR [deadline|seen|released|none|peers_ended]. The exit protocol of
:mod:`smp_comm.shutdown` after a failed step, where the call a thread is blocked in is
released only when a peer that is slow to exit ends.

Ranks 0 and 1 each hold a thread blocked until rank 2 has ended (it waits for a file rank 2
writes last); rank 2's exit takes 6 s after it finalized MPI (a slow interpreter teardown on
a loaded machine; MPI_Finalize itself waits for every rank).
With ``deadline`` the blocked ranks' caller sets an exit deadline 20 s ahead, so they wait
for rank 2 and every rank exits normally; with ``seen`` no deadline is set, but every peer
runs on this host and its process is known (as every Communicator makes it known), so they
wait for rank 2 too. With ``none`` (a peer as if on another host, no deadline) they give up 3 s after
finalizing MPI and leave without the C library's exit, and MPICH's launcher then kills the
others (the job fails): what the deadline and the /proc view are for.

``released``: only rank 0 holds a blocked thread (rank 1 exits normally at once), every
peer seen: once rank 2's end released it and every peer has ended, rank 0 leaves without
interpreter finalization (point 3a of the protocol), the job ending normally.

``peers_ended`` (two ranks): rank 1's thread is blocked for good (a module that never
returns); rank 0 exits normally, slowly. Rank 1's deadline is far ahead, but its check of
rank 0's process (as smp-torch's watcher does in ``/proc``) ends the wait once rank 0 has
ended, so the job ends soon after rank 0 and nobody is killed.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time

from mpi4py import MPI
from smp_comm import shutdown
from smp_comm.processes import ProcessInfo, know_peers

SLOW_EXIT_S = 6.0


def main() -> None:
    marker_dir, mode = sys.argv[1], sys.argv[2]
    rank = MPI.COMM_WORLD.Get_rank()
    marker = os.path.join(marker_dir, "rank2-ended")
    infos = MPI.COMM_WORLD.allgather(ProcessInfo.here())
    pids = [i.pid for i in infos]
    if mode == "peers_ended":
        peers_ended(rank, pids[0])
        return
    if rank == 2:

        def slow_exit() -> None:
            MPI.Finalize()
            time.sleep(SLOW_EXIT_S)
            print("rank 2 exits normally", flush=True)
            with open(marker, "w") as f:
                f.write("ended")

        atexit.register(slow_exit)
        return

    if mode == "released" and rank == 1:  # a rank with nothing blocked
        atexit.register(lambda: print("rank 1 exits normally", flush=True))
        return

    def blocked() -> None:
        while not os.path.exists(marker):
            time.sleep(0.01)

    thread = threading.Thread(target=blocked, name="blocked-collective", daemon=True)
    thread.start()
    shutdown.note_failed_step()
    if mode == "deadline":
        shutdown.set_exit_deadline(time.monotonic() + 20.0)
    elif mode in ("seen", "released"):  # what every Communicator does at construction
        know_peers(infos, rank)

    def at_exit() -> None:
        shutdown.wait_for_threads_at_exit([thread], f"rank {rank}")
        print(f"rank {rank} exits normally", flush=True)

    atexit.register(at_exit)  # (after mpi4py's: runs before MPI_Finalize)


def _ended(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


def peers_ended(rank: int, pid0: int) -> None:
    if rank == 0:

        def slow_exit() -> None:
            MPI.Finalize()
            time.sleep(SLOW_EXIT_S / 2)
            print("rank 0 exits normally", flush=True)

        atexit.register(slow_exit)
        return
    never = threading.Event()
    thread = threading.Thread(target=never.wait, name="stuck-module", daemon=True)
    thread.start()
    shutdown.note_failed_step()
    began = time.monotonic()
    shutdown.set_exit_deadline(began + 60.0)
    shutdown.set_peers_ended_check(lambda: _ended(pid0))

    def at_exit() -> None:
        print(f"rank 1 exit began after {time.monotonic() - began:.1f} s", flush=True)
        shutdown.wait_for_threads_at_exit([thread], "rank 1")

    atexit.register(at_exit)


if __name__ == "__main__":
    main()
