"""Usage: slow_exit.py MARKER_DIR [deadline|none]. The exit protocol of
:mod:`smp_comm.shutdown` after a failed step, where the call a thread is blocked in is
released only when a peer that is slow to exit ends.

Ranks 0 and 1 each hold a thread blocked until rank 2 has ended (it waits for a file rank 2
writes last); rank 2's exit takes 6 s after it finalized MPI (a slow interpreter teardown on
a loaded machine; MPI_Finalize itself waits for every rank).
With ``deadline`` the blocked ranks' caller sets an exit deadline 20 s ahead, so they wait
for rank 2 and every rank exits normally. With ``none`` they give up 3 s after finalizing
MPI and leave without the C library's exit, and MPICH's launcher then kills the others (the
job fails): what the deadline is for.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time

from mpi4py import MPI
from smp_comm import shutdown

SLOW_EXIT_S = 6.0


def main() -> None:
    marker_dir, mode = sys.argv[1], sys.argv[2]
    rank = MPI.COMM_WORLD.Get_rank()
    marker = os.path.join(marker_dir, "rank2-ended")
    MPI.COMM_WORLD.Barrier()
    if rank == 2:

        def slow_exit() -> None:
            MPI.Finalize()
            time.sleep(SLOW_EXIT_S)
            print("rank 2 exits normally", flush=True)
            with open(marker, "w") as f:
                f.write("ended")

        atexit.register(slow_exit)
        return

    def blocked() -> None:
        while not os.path.exists(marker):
            time.sleep(0.01)

    thread = threading.Thread(target=blocked, name="blocked-collective", daemon=True)
    thread.start()
    shutdown.note_failed_step()
    if mode == "deadline":
        shutdown.set_exit_deadline(time.monotonic() + 20.0)

    def at_exit() -> None:
        shutdown.wait_for_threads_at_exit([thread], f"rank {rank}")
        print(f"rank {rank} exits normally", flush=True)

    atexit.register(at_exit)  # (after mpi4py's: runs before MPI_Finalize)


if __name__ == "__main__":
    main()
