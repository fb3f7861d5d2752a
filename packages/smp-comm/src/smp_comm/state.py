"""Small shared state of one Communicator: lifecycle flags, counters, the work backlog.

Each class here is either lock-free (documented why) or owns exactly one lock.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from smp_comm.settings import PATHS

__all__ = ["STOP", "Backlog", "FastCounts", "Lifecycle", "PathStats", "nothing", "start_thread"]

STOP = object()  # queue sentinel: the consuming thread ends


def nothing() -> None:
    """A completion callback with nothing left to do."""
    return None


@dataclass
class Lifecycle:
    """Whether the Communicator is closing/closed or broken. No lock: each flag is written
    once (``closing``/``closed`` by the close protocol under its lock, ``fatal`` by the first
    failure) and read as a plain attribute on the hot paths."""

    closing: bool = False
    closed: bool = False
    fatal: BaseException | None = None


@dataclass(slots=True)
class FastCounts:
    """Messages and payload bytes sent and received. A Communicator counts its fast-path
    messages under the matching table's lock, which both ends of the fast path hold anyway
    (a lock of its own costs latency per message)."""

    sent: int = 0
    sent_bytes: int = 0
    received: int = 0
    received_bytes: int = 0


class PathStats:
    """Messages and bytes per path for ``stats()``; ``_lock`` guards ``_counts`` and
    ``_fallbacks``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = {
            p: {
                "messages_sent": 0,
                "bytes_sent": 0,
                "messages_received": 0,
                "bytes_received": 0,
                "streamed_sent": 0,
            }
            for p in PATHS
        }
        self._fallbacks = 0

    def count(self, path: str, direction: str, nbytes: int) -> None:
        """One message of ``nbytes`` ``direction`` (``"sent"``/``"received"``) on ``path``."""
        with self._lock:
            s = self._counts[path]
            s[f"messages_{direction}"] += 1
            s[f"bytes_{direction}"] += nbytes

    def streamed(self, path: str) -> None:
        """One message sent through ``path`` in chunks (:mod:`smp_comm.stream`)."""
        with self._lock:
            self._counts[path]["streamed_sent"] += 1

    def fallback(self) -> None:
        """A direct path could have carried a message but its buffer lacked room."""
        with self._lock:
            self._fallbacks += 1

    def report(self, fast: FastCounts) -> dict[str, dict[str, int]]:
        """``Communicator.stats()``: fast-path messages are MPI messages, counted in
        ``"mpi"`` too."""
        with self._lock:
            out = {}
            for p, s in self._counts.items():
                d = dict(s)
                d["messages"] = s["messages_sent"] + s["messages_received"]
                d["bytes"] = s["bytes_sent"] + s["bytes_received"]
                out[p] = d
            out["mpi"]["fallbacks"] = self._fallbacks
        mpi = out["mpi"]
        mpi["fast_sent"], mpi["fast_received"] = fast.sent, fast.received
        mpi["messages_sent"] += fast.sent
        mpi["bytes_sent"] += fast.sent_bytes
        mpi["messages_received"] += fast.received
        mpi["bytes_received"] += fast.received_bytes
        mpi["messages"] += fast.sent + fast.received
        mpi["bytes"] += fast.sent_bytes + fast.received_bytes
        return out


class Backlog:
    """Items queued for, or being handled by, the queue-consuming threads (router, direct,
    requester, postproc). A waiting thread spins only while all are zero, so that it never
    takes the GIL from a busy backend thread. ``_lock`` guards ``counts``' updates (reads
    are lock-free: a stale count only shifts one spin)."""

    ROUTER, DIRECT, REQUESTER, POSTPROC = range(4)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts = [0, 0, 0, 0]

    def put(self, i: int, q: queue.SimpleQueue[Any], item: Any) -> None:
        """Queue ``item`` for thread ``i``."""
        with self._lock:
            self.counts[i] += 1
        q.put(item)

    def serve(self, i: int, q: queue.SimpleQueue[Any], handle: Callable[[Any], None]) -> None:
        """Thread ``i``'s body: hand each queued item to ``handle`` until :data:`STOP`."""
        while (item := q.get()) is not STOP:
            try:
                handle(item)
            finally:
                # Let go of the item before blocking on the next: a received message it
                # holds keeps zero-copy views, and so their buffer region, alive until the
                # next message came (a stream that fills the buffer then fell back to MPI).
                item = None
                with self._lock:
                    self.counts[i] -= 1


def start_thread(
    name: str, loop: Callable[[], None], on_crash: Callable[[BaseException], Any]
) -> threading.Thread:
    """Start daemon thread ``smp-comm-<name>`` running ``loop``; if the loop dies,
    ``on_crash(exc)`` fails every waiter instead of leaving it hanging."""

    def run() -> None:
        try:
            loop()
        except BaseException as exc:  # noqa: BLE001 - reported to every waiter
            on_crash(exc)
            raise

    t = threading.Thread(target=run, name=f"smp-comm-{name}", daemon=True)
    t.start()
    return t
