"""Doorbells: an idle tracker sleeps in the kernel and a sender wakes it.

MPI has no call that blocks until *any* message arrives without spinning a core (MPICH's
blocking probe busy-polls), so without help an idle tracker must wake every millisecond to
probe. On a machine with as many ranks as cores, those wake-ups take CPU from the rank that
is computing, and a message that lands just after a probe waits up to a millisecond.

When every rank of the communicator is on one Linux host, each rank gets a doorbell:

- a datagram socket in the abstract namespace (no file to clean up), and
- one byte in a page of shared memory that all of them map: "my tracker is asleep".

A sleeping tracker sets its byte, probes once more (a message posted before the byte was
visible is seen now), then blocks in ``select`` on its socket. Whoever posts a message to a
rank reads that rank's byte and, only if it is set, sends one datagram. A byte read costs
tens of nanoseconds, so busy ranks pay nothing; the syscall is paid only to wake a sleeper.
The sleep is bounded (``_MAX_SLEEP_S``) as a backstop: a lost ring costs at most that.
"""

from __future__ import annotations

import mmap
import os
import select
import socket
import sys
import uuid
from collections.abc import Callable

from mpi4py import MPI

__all__ = ["Doorbells", "doorbells_available"]

_LINE = 64  # one cache line per rank: flags of different ranks never share a line
_MAX_SLEEP_S = 0.05


def doorbells_available() -> bool:
    """Doorbells need Linux (abstract-namespace sockets) and a shared-memory directory."""
    return sys.platform.startswith("linux") and os.path.isdir("/dev/shm")


class Doorbells:
    """The doorbells of one communicator's ranks (all on this host). Collective to build."""

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.rank = comm.Get_rank()
        size = comm.Get_size()
        self.rings = 0  # datagrams sent to wake sleeping peers
        self.nudges = 0  # datagrams sent to wake this rank's own tracker
        self.sleeps = 0  # times this rank's tracker slept on its doorbell
        name = None
        if self.rank == 0:
            name = os.path.join("/dev/shm", f"smp-comm-bell-{os.getpid()}-{uuid.uuid4().hex[:12]}")
            fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, _LINE * size)
            finally:
                os.close(fd)
        name = comm.bcast(name, root=0)
        failure = None
        try:
            fd = os.open(name, os.O_RDWR)
            try:
                self._flags = mmap.mmap(fd, _LINE * size)
            finally:
                os.close(fd)
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)
            base = os.path.basename(name).encode()
            self._addr = [b"\0" + base + b"-%d" % r for r in range(size)]
            self._sock.bind(self._addr[self.rank])
        except OSError as exc:
            failure = f"rank {self.rank}: {exc}"
        finally:
            comm.Barrier()  # every rank has mapped the page (or failed): unlink it now
            if self.rank == 0:
                os.unlink(name)
        failures = [f for f in comm.allgather(failure) if f]
        if failures:
            raise OSError("smp-comm doorbells unavailable: " + "; ".join(failures))
        self._me = self.rank * _LINE

    def ring(self, dest: int) -> None:
        """Wake ``dest``'s tracker if it sleeps (call after posting a message to it)."""
        if self._flags[dest * _LINE] and self._send(dest):
            self.rings += 1

    def nudge(self) -> None:
        """Wake this rank's own tracker if it sleeps (local work for it)."""
        if self._flags[self._me] and self._send(self.rank):
            self.nudges += 1

    def _send(self, dest: int) -> bool:
        try:
            self._sock.sendto(b"\1", self._addr[dest])
        except OSError:
            return False  # full queue: a ring is pending anyway; gone peer: nothing to wake
        return True

    def sleep(self, recheck_busy: Callable[[], bool], timeout: float = _MAX_SLEEP_S) -> None:
        """Mark this rank asleep, run ``recheck_busy()`` (one progress round: True if it found
        work) and, if it found none, block until rung or ``timeout`` passes."""
        self._flags[self._me] = 1
        try:
            # The flag store is published before the re-check reads MPI's queues: mpi4py drops
            # the GIL around each MPI call, and that mutex operation is a full memory barrier.
            if recheck_busy():
                return
            self.sleeps += 1
            select.select([self._sock], [], [], timeout)
        finally:
            self._flags[self._me] = 0
        self._drain()

    def _drain(self) -> None:
        try:
            while self._sock.recv(64):
                pass
        except OSError:
            pass

    def close(self) -> None:
        # The page stays mapped until garbage collected: a late nudge (a received tensor
        # freed after close) must still find it; the closed socket then just refuses.
        self._flags[self._me] = 0
        self._sock.close()
