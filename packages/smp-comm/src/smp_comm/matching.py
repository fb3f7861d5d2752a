"""The matching table: posted receives, unexpected messages, per-peer send numbering.

Matching semantics are MPI's: a message is matched, in its sender's order, against the
posted receives in the order they were posted (the first whose source and tag accept it
wins); a message nobody waits for joins the unexpected queue, which a later ``irecv``
searches oldest first.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from smp_comm import fastpath
from smp_comm.errors import CommClosedError, CommError, PeerClosedError
from smp_comm.handles import RecvHandle, SendHandle
from smp_comm.serialize import TensorStub
from smp_comm.state import FastCounts, Lifecycle
from smp_comm.wire import ANY_SOURCE, ANY_TAG

__all__ = ["Incoming", "MatchingTable", "accepts"]


@dataclass
class Incoming:
    """An incoming general-path message, from its header until its object is rebuilt."""

    source: int
    tag: int
    msg_id: int
    path: str
    region: int
    skeleton: bytes
    stubs: list[TensorStub]
    inline: list[bytes] | None
    finals: list[Any] = field(default_factory=list)
    views: list[np.ndarray] = field(default_factory=list)
    handle: RecvHandle | None = None
    # The receive's own tensor (irecv(out=...)) as (finals, views), when its receive was
    # posted before the header came and the message fits it: the bytes land there directly.
    into: tuple[list[Any], list[np.ndarray]] | None = None
    done: bool = False
    result: Any = None
    error: BaseException | None = None


def accepts(h: RecvHandle, inc: Incoming) -> bool:
    """Whether receive ``h`` takes message ``inc``."""
    return (h.peer == ANY_SOURCE or h.peer == inc.source) and (h.tag == ANY_TAG or h.tag == inc.tag)


class MatchingTable:
    """Who waits for what, and what arrived. ``lock`` guards every attribute but ``rank``,
    ``size`` and ``life``; the send paths also number their messages under it (``seq_to``),
    so that numbering and posting are one step and ``close()``'s BYE cannot come between."""

    def __init__(self, rank: int, size: int, life: Lifecycle) -> None:
        self.rank, self.size, self.life = rank, size, life
        self.lock = threading.Lock()
        self.posted: list[RecvHandle] = []
        self.unexpected: list[Incoming] = []
        self.live: dict[int, Incoming] = {}  # id -> message not yet rebuilt
        self.inflight = 0  # incoming general-path messages not yet rebuilt
        self.bye_from: set[int] = set()
        self.drained_from: set[int] = set()
        self.open_sends: set[SendHandle] = set()
        self.seq_to = [0] * size  # next sequence number per destination
        self.fast = FastCounts()

    # ------------------------------------------------------------------ receives

    def post(self, handle: RecvHandle) -> None:
        """``irecv``: take the oldest unexpected message it accepts, else wait in line."""
        with self.lock:
            for i, inc in enumerate(self.unexpected):
                if accepts(handle, inc):
                    del self.unexpected[i]
                    self._bind(handle, inc)
                    return
            err = self.unreachable(handle.peer)
            if err is not None:
                handle._complete(error=err)
                return
            self.posted.append(handle)

    def cancel(self, handle: RecvHandle) -> bool:
        """``RecvHandle.cancel``: withdraw a receive no message has matched yet."""
        with self.lock:
            if handle in self.posted:
                self.posted.remove(handle)
                handle._complete(error=CommError(f"smp-comm rank {self.rank}: receive cancelled"))
                return True
        return False

    def unreachable(self, source: int) -> BaseException | None:
        """Error for a receive that can never be matched any more (caller holds ``lock``)."""
        if self.life.fatal is not None:
            return CommError(f"smp-comm rank {self.rank}: backend failed: {self.life.fatal!r}")
        if source == ANY_SOURCE:
            others = set(range(self.size)) - {self.rank}
            if others and others <= self.bye_from:
                return CommError(
                    f"smp-comm rank {self.rank}: receive from any rank: every other rank "
                    f"({sorted(others)}) has closed its Communicator"
                )
            return None
        if source in self.bye_from:
            return self.peer_closed(source, "receive")
        return None

    def peer_closed(self, peer: int, what: str) -> PeerClosedError:
        """The error for an operation that needs ``peer``, which has closed."""
        return PeerClosedError(
            f"smp-comm rank {self.rank}: {what}: rank {peer} has closed its Communicator", peer
        )

    # ------------------------------------------------------------------ arrivals

    def on_header(self, inc: Incoming) -> None:
        """A general-path message's turn: give it to the first accepting receive, else
        keep it; it stays live until :meth:`finished`."""
        with self.lock:
            self.inflight += 1
            self.live[id(inc)] = inc
            for i, h in enumerate(self.posted):
                if accepts(h, inc):
                    del self.posted[i]
                    inc.handle = h
                    break
            else:
                self.unexpected.append(inc)

    def finished(self, inc: Incoming) -> None:
        """``inc``'s object is rebuilt (or failed): deliver it if a receive took it."""
        with self.lock:
            inc.done = True
            self.inflight -= 1
            self.live.pop(id(inc), None)
            if inc.handle is not None:
                self._deliver(inc)

    def on_fast(self, source: int, seq: int, tag: int, obj: Any, nbytes: int) -> None:
        """A fast-path frame's turn: match it like any other message. ``obj`` is the frame
        itself while ``nbytes`` is -1 (not rebuilt yet, or the compiled path failed to)."""
        error: BaseException | None = None
        if nbytes < 0:
            try:
                obj, nbytes = fastpath.decode(obj, self.rank)
            except Exception as exc:  # noqa: BLE001 - delivered to the waiter
                obj, nbytes = None, 0
                error = CommError(
                    f"smp-comm rank {self.rank}: cannot rebuild message from rank {source} "
                    f"(tag {tag}): {exc!r}"
                )
        with self.lock:
            for i, h in enumerate(self.posted):
                if (h.peer == ANY_SOURCE or h.peer == source) and (
                    h.tag == ANY_TAG or h.tag == tag
                ):
                    del self.posted[i]
                    break
            else:
                inc = Incoming(source, tag, seq, "mpi", -1, b"", [], None)
                inc.done, inc.result, inc.error = True, obj, error
                self.unexpected.append(inc)
                h = None
            if error is None:
                counts = self.fast
                counts.received += 1
                counts.received_bytes += nbytes
        if h is not None:  # out of the posted list: no other thread completes it
            if error is None:
                h._complete((obj, source, tag))
            else:
                h._complete(error=error)

    def on_bye(self, source: int) -> None:
        """``source`` closed: it will send nothing more, so fail receives that need it."""
        with self.lock:
            self.bye_from.add(source)
            keep = []
            for h in self.posted:
                err = self.unreachable(h.peer)
                if err is not None:
                    h._complete(error=err)
                else:
                    keep.append(h)
            self.posted = keep

    def on_drained(self, source: int) -> None:
        """``source`` will post no more FREEs."""
        with self.lock:
            self.drained_from.add(source)

    # ------------------------------------------------------------------ sends

    def send_done(self, handle: SendHandle, error: BaseException | None = None) -> None:
        """A send left this rank's buffers (or failed)."""
        handle._complete(error=error)
        with self.lock:
            self.open_sends.discard(handle)

    # ------------------------------------------------------------------ failure, close

    def fail_all(self, exc: BaseException) -> CommError:
        """The backend broke: fail every pending operation (nothing may hang on it)."""
        self.life.fatal = exc
        err = CommError(f"smp-comm rank {self.rank}: backend failed: {exc!r}")
        with self.lock:
            for h in self.posted:
                h._complete(error=err)
            self.posted.clear()
            for sh in list(self.open_sends):
                sh._complete(error=err)
            for inc in self.live.values():
                if inc.handle is not None:
                    inc.handle._complete(error=err)
        return err

    def close(self) -> None:
        """Closed: a receive still posted fails; unexpected messages are dropped."""
        with self.lock:
            for h in self.posted:
                h._complete(
                    error=CommClosedError(f"smp-comm rank {self.rank}: closed while receiving")
                )
            self.posted.clear()
            self.unexpected.clear()

    # ------------------------------------------------------------------ helpers

    def _bind(self, handle: RecvHandle, inc: Incoming) -> None:
        """Attach a receive to a message (caller holds ``lock``)."""
        inc.handle = handle
        if inc.done:
            self._deliver(inc)

    def _deliver(self, inc: Incoming) -> None:
        assert inc.handle is not None
        if inc.error is not None:
            inc.handle._complete(error=inc.error)
        else:
            inc.handle._complete(result=(inc.result, inc.source, inc.tag))
        inc.result = None  # the handle holds it now
