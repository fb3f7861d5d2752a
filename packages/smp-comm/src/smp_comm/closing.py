"""The collective close protocol of a Communicator.

1. This rank's sends finish (the peers' trackers keep serving them meanwhile).
2. BYE to every rank, numbered after its last message: once a peer's BYE is handled, all
   its messages have been. Wait for every rank's BYE.
3. Once every incoming payload is in, DRAINED (no FREE follows it); wait for every rank's.
Then the threads stop and the windows and communicators are freed in the same order on
every rank.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from mpi4py import MPI

from smp_comm.doorbell import Doorbells
from smp_comm.errors import CommError
from smp_comm.matching import MatchingTable
from smp_comm.paths import DirectPaths
from smp_comm.progress import Progress
from smp_comm.receiver import Receiver
from smp_comm.sender import Sender
from smp_comm.state import Lifecycle, nothing
from smp_comm.wire import T_BYE

__all__ = ["CloseProtocol"]


class CloseProtocol:
    """Closes one Communicator, once. ``_lock`` serializes ``close()`` calls; it guards the
    lifecycle's ``closing``/``closed`` transitions."""

    def __init__(
        self,
        rank: int,
        size: int,
        comms: tuple[MPI.Intracomm, MPI.Intracomm, MPI.Intracomm],
        life: Lifecycle,
        table: MatchingTable,
        progress: Progress,
        sender: Sender,
        receiver: Receiver,
        paths: DirectPaths,
        bell: Doorbells | None,
    ) -> None:
        self.rank, self.size = rank, size
        self._comms = comms  # control, payload, fast-path: freed in this order's reverse
        self._life, self._table, self._progress = life, table, progress
        self._sender, self._receiver, self._paths, self._bell = sender, receiver, paths, bell
        self._lock = threading.Lock()

    def close(self, limit: float) -> bool:
        """Run the protocol within ``limit`` seconds; False if it had already run."""
        with self._lock:
            if self._life.closed:
                return False
            self._life.closing = True
            deadline = time.monotonic() + limit
            try:
                self._run(deadline)
            finally:
                self._life.closed = True
            return True

    def _run(self, deadline: float) -> None:
        life, table, progress = self._life, self._table, self._progress

        def wait_for(done: Callable[[], bool], describe: Callable[[], str]) -> None:
            while not done():
                if life.fatal is not None:
                    raise CommError(f"smp-comm rank {self.rank}: backend failed: {life.fatal!r}")
                if time.monotonic() > deadline:
                    raise CommError(
                        f"smp-comm rank {self.rank}: close() timed out waiting for {describe()}"
                    )
                time.sleep(1e-3)

        everyone = set(range(self.size))
        cc = self._comms[0]
        progress.end_lazy()  # the tracker completes lazily tracked sends now (waited below)
        try:
            wait_for(
                lambda: not table.open_sends,
                lambda: f"sends to ranks {sorted({h.peer for h in table.open_sends})} to complete",
            )
            with table.lock:
                byes = [(r, table.seq_to[r]) for r in everyone]
                for r in everyone:
                    table.seq_to[r] += 1
            progress.track([cc.isend(q, dest=r, tag=T_BYE) for r, q in byes], nothing)
            for r in everyone:
                progress.ring(r)
            wait_for(
                lambda: table.bye_from == everyone,
                lambda: f"ranks {sorted(everyone - table.bye_from)} to call close()",
            )
            wait_for(lambda: table.inflight == 0, lambda: "incoming payloads")
            # FREEs go out under the receiver's lock or (queued) under the progress lock.
            with progress.lock:
                reqs = self._receiver.stop_frees(everyone)
            for r in everyone:
                progress.ring(r)
            progress.track(reqs, nothing)
            wait_for(
                lambda: table.drained_from == everyone,
                lambda: f"ranks {sorted(everyone - table.drained_from)} to drain",
            )
        except BaseException:
            self._stop_threads()
            raise
        self._stop_threads()
        table.close()
        # Collective frees, same order on every rank.
        self._paths.close()
        cc, dc, fc = self._comms
        dc.Free()
        fc.Free()
        cc.Free()
        if self._bell is not None:
            self._bell.close()

    def _stop_threads(self) -> None:
        # The queue consumers first (they may still post requests), the tracker last.
        self._sender.stop()
        self._receiver.stop()
        self._progress.stop()
