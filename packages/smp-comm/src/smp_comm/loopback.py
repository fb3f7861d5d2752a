"""An in-process stand-in for :class:`smp_comm.Communicator`: threads play the ranks.

For tests of code built on the communicator (smp-pipeline's servers, order streams) that
should run in one process, without ``mpiexec``::

    world = LoopbackWorld(2)
    a, b = world.communicator(0), world.communicator(1)
    a.isend({"x": torch.ones(3)}, dest=1, tag=7)
    obj, source, tag = b.irecv().wait(timeout=5)      # a copy: b owns its tensors

Messages follow the real Communicator's rules: per (source, dest) order is ``isend``
order; a message goes to the first posted receive whose source and tag accept it, else to
the unexpected queue, which a later ``irecv`` searches oldest first; the receiver gets a
copy (the object is serialized with smp-comm's own :func:`~smp_comm.serialize.pack` in
``isend``, so tensors arrive as new tensors with dtype, shape and ``requires_grad`` kept,
and later changes to the sent object do not travel). The handles are the real
:class:`~smp_comm.SendHandle` / :class:`~smp_comm.RecvHandle`, so ``wait``, ``test``,
``cancel``, ``add_done_callback`` and :class:`~smp_comm.CommTimeoutError` behave alike; a
receive's callbacks run on the thread of the ``isend`` that completed it.

Differences: a send completes inside ``isend`` (the copy is taken there); ``close()`` is
local (it does not wait for the other ranks to close); ``wake`` and ``spin`` are accepted
and have no effect; ``stats()`` counts everything under ``"mpi"``. It needs no MPI job and
makes no MPI call, but ``import smp_comm`` still imports mpi4py (which initializes MPI as a
singleton process): the wildcards are the real :data:`smp_comm.ANY_SOURCE` and
:data:`smp_comm.ANY_TAG`, whose values depend on the MPI library.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any

import numpy as np

from smp_comm.errors import CommClosedError, CommError, PeerClosedError
from smp_comm.handles import RecvHandle, SendHandle
from smp_comm.serialize import finish_tensor, from_blobs, pack, unpack
from smp_comm.settings import PATHS
from smp_comm.state import FastCounts
from smp_comm.wire import ANY_SOURCE, ANY_TAG

__all__ = ["LoopbackCommunicator", "LoopbackWorld"]


class _Message:
    """A message waiting in its destination's unexpected queue (already a private copy)."""

    __slots__ = ("obj", "source", "tag")

    def __init__(self, obj: Any, source: int, tag: int) -> None:
        self.obj, self.source, self.tag = obj, source, tag


class _Mailbox:
    """One rank's matching table. ``lock`` guards every attribute below it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.posted: list[RecvHandle] = []
        self.unexpected: list[_Message] = []
        self.closed = False
        self.bye_from: set[int] = set()  # ranks that closed (they send nothing more)
        self.counts = FastCounts()  # every message counts as "mpi" here


def _accepts(h: RecvHandle, source: int, tag: int) -> bool:
    return (h.peer == ANY_SOURCE or h.peer == source) and (h.tag == ANY_TAG or h.tag == tag)


def _copy(obj: Any, rank: int) -> tuple[Any, int]:
    """A private copy of ``obj`` made the way the real backend makes one, and its payload
    bytes: the skeleton pickled, each tensor's bytes copied and the tensor rebuilt."""
    packed = pack(obj)
    blobs = [
        (s if isinstance(s, np.ndarray) else s.cpu().numpy()).tobytes() for s in packed.sources
    ]
    values = from_blobs(packed.stubs, blobs, rank)
    values = [finish_tensor(s, v) for s, v in zip(packed.stubs, values)]
    return unpack(packed.skeleton, values), packed.nbytes


class LoopbackWorld:
    """``size`` ranks in this process; :meth:`communicator` gives each rank's end."""

    def __init__(self, size: int) -> None:
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"LoopbackWorld: size must be an int >= 1, got {size!r}")
        self.size = size
        self._boxes = [_Mailbox() for _ in range(size)]
        self._comms = [LoopbackCommunicator(self, r) for r in range(size)]

    def communicator(self, rank: int) -> LoopbackCommunicator:
        """Rank ``rank``'s communicator (the same object on every call)."""
        if not isinstance(rank, int) or not 0 <= rank < self.size:
            raise ValueError(f"LoopbackWorld: rank {rank!r} is not in a world of size {self.size}")
        return self._comms[rank]

    def close(self) -> None:
        """Close every rank's communicator."""
        for c in self._comms:
            c.close()


class LoopbackCommunicator:
    """One rank of a :class:`LoopbackWorld`; the API of :class:`smp_comm.Communicator`
    that callers use (``isend``, ``irecv``, ``close``, ``closed``, ``stats``, context
    manager). Thread-safe: any number of threads may send and receive at once."""

    fast_path = "off"

    def __init__(self, world: LoopbackWorld, rank: int) -> None:
        self.rank: int = rank
        self.size: int = world.size
        self._world = world
        self._box = world._boxes[rank]

    # ------------------------------------------------------------------ public API

    def isend(self, obj: Any, dest: int, tag: int = 0, *, wake: bool = True) -> SendHandle:
        """Copy ``obj`` into ``dest``'s matching table; the handle is complete on return
        (with :class:`~smp_comm.PeerClosedError` if ``dest`` has closed)."""
        del wake  # no doorbells here: a waiting receiver is completed at once
        self._check_open()
        self._check_rank(dest, "dest")
        if not isinstance(tag, int) or tag < 0:
            raise ValueError(f"smp-comm isend: tag must be an int >= 0, got {tag!r}")
        try:
            copy, nbytes = _copy(obj, dest)
        except Exception as exc:
            raise CommError(
                f"smp-comm rank {self.rank}: cannot serialize message for rank {dest} (tag {tag}): {exc!r}"
            ) from exc
        handle = SendHandle(dest, tag, self.rank)
        box = self._world._boxes[dest]
        match: RecvHandle | None = None
        with box.lock:
            if box.closed:
                handle._complete(error=self._peer_closed(dest, f"send (tag {tag})"))
                return handle
            for i, h in enumerate(box.posted):
                if _accepts(h, self.rank, tag):
                    match = box.posted.pop(i)
                    break
            else:
                box.unexpected.append(_Message(copy, self.rank, tag))
            box.counts.received += 1
            box.counts.received_bytes += nbytes
        with self._box.lock:
            self._box.counts.sent += 1
            self._box.counts.sent_bytes += nbytes
        handle._complete()
        if match is not None:  # out of the posted list: no other thread completes it
            match._complete((copy, self.rank, tag))
        return handle

    def irecv(self, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> RecvHandle:
        """Post a receive; ``wait()`` returns ``(obj, source, tag)``."""
        self._check_open()
        if source != ANY_SOURCE:
            self._check_rank(source, "source")
        if not isinstance(tag, int) or (tag < 0 and tag != ANY_TAG):
            raise ValueError(f"smp-comm irecv: tag must be an int >= 0 or ANY_TAG, got {tag!r}")
        handle = RecvHandle(source, tag, self.rank, None, self._cancel)
        box = self._box
        with box.lock:
            for i, m in enumerate(box.unexpected):
                if _accepts(handle, m.source, m.tag):
                    del box.unexpected[i]
                    break
            else:
                m = None
                err = self._unreachable(source)
                if err is None:
                    box.posted.append(handle)
                    return handle
        if m is not None:
            handle._complete((m.obj, m.source, m.tag))
        else:
            handle._complete(error=err)
        return handle

    def stats(self) -> dict[str, dict[str, int]]:
        """The real ``stats()``'s shape; every message counts as ``"mpi"``."""
        with self._box.lock:
            c = replace(self._box.counts)
        out: dict[str, dict[str, int]] = {}
        for p in PATHS:
            m = c if p == "mpi" else FastCounts()
            out[p] = {
                "messages_sent": m.sent,
                "bytes_sent": m.sent_bytes,
                "messages_received": m.received,
                "bytes_received": m.received_bytes,
                "messages": m.sent + m.received,
                "bytes": m.sent_bytes + m.received_bytes,
            }
        out["mpi"].update(fallbacks=0, fast_sent=0, fast_received=0)
        return out

    def path_to(self, dest: int, device: str = "cpu") -> str:
        """Always ``"mpi"``: there is one path here."""
        del device
        self._check_rank(dest, "dest")
        return "mpi"

    @property
    def closed(self) -> bool:
        return self._box.closed

    def close(self, timeout: float | None = None) -> None:
        """Close this rank (idempotent, local): its posted receives fail with
        :class:`~smp_comm.CommClosedError`; the other ranks' receives that only this rank
        could satisfy fail with :class:`~smp_comm.PeerClosedError`, as with the real one.
        Messages it sent before closing stay receivable."""
        del timeout
        box = self._box
        with box.lock:
            if box.closed:
                return
            box.closed = True
            failed, box.posted = box.posted, []
            box.unexpected.clear()
        for h in failed:
            h._complete(error=CommClosedError(f"smp-comm rank {self.rank}: closed while receiving"))
        for other in self._world._comms:
            if other is not self:
                other._on_peer_closed(self.rank)

    def __enter__(self) -> LoopbackCommunicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers

    def _on_peer_closed(self, peer: int) -> None:
        box = self._box
        failed: list[tuple[RecvHandle, BaseException]] = []
        with box.lock:
            box.bye_from.add(peer)
            keep = []
            for h in box.posted:
                err = self._unreachable(h.peer)
                if err is None:
                    keep.append(h)
                else:
                    failed.append((h, err))
            box.posted = keep
        for h, err in failed:
            h._complete(error=err)

    def _unreachable(self, source: int) -> BaseException | None:
        """Error for a receive nothing can match any more (caller holds the box lock)."""
        bye = self._box.bye_from
        if source == ANY_SOURCE:
            others = set(range(self.size)) - {self.rank}
            if others and others <= bye:
                return CommError(
                    f"smp-comm rank {self.rank}: receive from any rank: every other rank "
                    f"({sorted(others)}) has closed its Communicator"
                )
            return None
        if source in bye:
            return self._peer_closed(source, "receive")
        return None

    def _cancel(self, handle: RecvHandle) -> bool:
        with self._box.lock:
            if handle not in self._box.posted:
                return False
            self._box.posted.remove(handle)
        handle._complete(error=CommError(f"smp-comm rank {self.rank}: receive cancelled"))
        return True

    def _check_open(self) -> None:
        if self._box.closed:
            raise CommClosedError(f"smp-comm rank {self.rank}: the Communicator is closed")

    def _check_rank(self, r: Any, what: str) -> None:
        if not isinstance(r, int) or not 0 <= r < self.size:
            raise ValueError(
                f"smp-comm rank {self.rank}: {what}={r!r} is not a rank of a communicator of size {self.size}"
            )

    def _peer_closed(self, peer: int, what: str) -> PeerClosedError:
        return PeerClosedError(
            f"smp-comm rank {self.rank}: {what}: rank {peer} has closed its Communicator", peer
        )
