"""Doorbells: an idle rank sleeps in the kernel and a sender wakes it.

MPI has no call that blocks until *any* message arrives without spinning a core (MPICH's
blocking probe busy-polls), so without help an idle tracker must wake every millisecond to
probe. On a machine with as many ranks as cores, those wake-ups take CPU from the rank that
is computing, and a message that lands just after a probe waits up to a millisecond.

When every rank of the communicator is on one Linux host, each rank gets two doorbells (a
datagram socket each, in the abstract namespace: no file to clean up) and three bytes in a
page of shared memory that all ranks map, each byte written by one side only:

- ``TRACKER``: "my tracker thread is asleep on its doorbell";
- ``WAITER``: "a thread blocked in ``wait`` is asleep on the waiter's doorbell" (the thread
  that waits for the message drives progress itself, so an arrival wakes one thread, not
  the tracker and then the waiter: see docs/perf-notes.md, "Waiting on the doorbell");
- ``POLLING``: "a thread of mine is polling right now": no ring is needed.

A sleeper sets its byte, takes a last look (``Progress.last_look``: a message posted before
the byte was visible is seen now), then blocks in ``select`` on its socket. Whoever posts a
message to a rank reads that rank's bytes and rings the waiter if it sleeps, else the
tracker if it sleeps, and nobody while a thread there polls (which, when it stops polling,
takes a last look the same way). A byte read costs tens of nanoseconds, so busy ranks pay
nothing; the syscall is paid only to wake a sleeper. Sleeps are bounded (``MAX_SLEEP_S``) as
a backstop: a lost ring costs at most that.
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

__all__ = ["MAX_SLEEP_S", "Doorbells", "doorbells_available"]

_LINE = 64  # one cache line per rank: flags of different ranks never share a line
MAX_SLEEP_S = 0.05  # longest sleep on a doorbell: what a lost ring costs at most
# Offsets of a rank's bytes in its line (see the module docstring).
TRACKER, WAITER, POLLING = 0, 1, 2


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
        self.woken = 0  # of those, the ones a ring or nudge ended (not the timeout)
        self.dozes = 0  # times a thread waiting for a message slept on the waiter's doorbell
        self.rung = 0  # of those, the ones a ring ended (not the timeout)
        self.polled = 0  # rings left out because a thread of the destination was polling
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
            base = os.path.basename(name).encode()
            self._addr = [b"\0" + base + b"-%d" % r for r in range(size)]
            self._waiter_addr = [b"\0" + base + b"-%d-w" % r for r in range(size)]
            self._sock = _bound(self._addr[self.rank])
            self._waiter_sock = _bound(self._waiter_addr[self.rank])
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
        """Wake whoever sleeps for ``dest``'s messages: its waiting thread, else its tracker
        (call after posting a message to it). Nothing while a thread there polls."""
        flags, line = self._flags, dest * _LINE
        if flags[line + POLLING]:
            self.polled += 1
        elif flags[line + WAITER]:
            if self._send(self._waiter_addr[dest]):
                self.rings += 1
        elif flags[line] and self._send(self._addr[dest]):
            self.rings += 1

    def nudge(self) -> None:
        """Wake this rank's own tracker if it sleeps (local work for it)."""
        if self._flags[self._me] and self._send(self._addr[self.rank]):
            self.nudges += 1

    def wake_waiter(self) -> None:
        """Wake this rank's waiting thread if it sleeps on its doorbell (its handle completed
        on another thread)."""
        if self._flags[self._me + WAITER]:
            self._send(self._waiter_addr[self.rank])

    def polling(self, on: bool) -> None:
        """Say whether a thread of this rank polls now (senders need not ring meanwhile).
        After ``polling(False)`` the caller probes once more before it relies on a ring."""
        self._flags[self._me + POLLING] = 1 if on else 0

    def _send(self, addr: bytes) -> bool:
        try:
            self._sock.sendto(b"\1", addr)
        except OSError:
            return False  # full queue: a ring is pending anyway; gone peer: nothing to wake
        return True

    def sleep(self, recheck_busy: Callable[[], bool], timeout: float = MAX_SLEEP_S) -> None:
        """Mark this rank asleep, run ``recheck_busy()`` (a last look: True if it found
        work) and, if it found none, block until rung or ``timeout`` passes."""
        self._flags[self._me] = 1
        try:
            # The flag store is published before the re-check reads MPI's queues: mpi4py drops
            # the GIL around each MPI call, and that mutex operation is a full memory barrier.
            if recheck_busy():
                return
            self.sleeps += 1
            if _select(self._sock, timeout):
                self.woken += 1
        finally:
            self._flags[self._me] = 0
        _drain(self._sock)

    def doze(self, recheck_done: Callable[[], bool], timeout: float = MAX_SLEEP_S) -> None:
        """The waiting thread's sleep (one thread at a time): mark the waiter asleep, run
        ``recheck_done()`` (a last look: True if its wait is over) and, if not, block
        until rung (by a sender, or by :meth:`wake_waiter`) or ``timeout`` passes."""
        waiter = self._me + WAITER
        self._flags[waiter] = 1
        try:
            if recheck_done():  # (published before the probes: see sleep())
                return
            self.dozes += 1
            if _select(self._waiter_sock, timeout):
                self.rung += 1
        finally:
            self._flags[waiter] = 0
        _drain(self._waiter_sock)

    def close(self) -> None:
        # The page stays mapped until garbage collected: a late nudge (a received tensor
        # freed after close) must still find it; the closed sockets then just refuse.
        for offset in (TRACKER, WAITER, POLLING):
            self._flags[self._me + offset] = 0
        self._sock.close()
        self._waiter_sock.close()


def _bound(addr: bytes) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setblocking(False)
    sock.bind(addr)
    return sock


def _select(sock: socket.socket, timeout: float) -> bool:
    """Block until ``sock`` has a datagram (True) or ``timeout`` passes (False)."""
    try:
        return bool(select.select([sock], [], [], timeout)[0])
    except (OSError, ValueError):  # closed meanwhile (the communicator is closing)
        return False


def _drain(sock: socket.socket) -> None:
    try:
        while sock.recv(64):
            pass
    except (OSError, ValueError):
        pass
