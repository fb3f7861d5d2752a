"""The receive side of the general path: payloads in, objects rebuilt, regions freed.

On a header's turn the polling thread matches it (:class:`~smp_comm.matching.MatchingTable`)
and posts the payload ``Irecv``\\ s of an MPI-path message; the ``postproc`` thread
(CommPostprocessing, D2D recv) copies payloads out of the receive buffer (or hands out
views of it), has the region freed (a ``FREE`` message back to the sender) and rebuilds
the object. Small payloads are rebuilt on the polling thread itself. A streamed payload
(:mod:`smp_comm.stream`) gets its tensors when its header arrives; the postproc thread
copies each chunk in as it lands and frees its region at once. A pulled payload
(:mod:`smp_comm.cma`) gets its tensor on the header's turn; postproc reads the sender's
bytes into it and replies.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

from smp_comm.cma import PULLED, PULLED_NEW, REFUSED, WANT_PULL
from smp_comm.errors import CommError
from smp_comm.matching import Incoming, MatchingTable
from smp_comm.paths import DirectPaths
from smp_comm.progress import Progress
from smp_comm.serialize import finish_tensor, from_blobs, new_buffers, out_buffers, unpack
from smp_comm.settings import CommSettings
from smp_comm.state import STOP, Backlog, Lifecycle, PathStats, nothing, start_thread
from smp_comm.stream import Assembly, ChunkBody, scratch_views
from smp_comm.wire import T_DRAINED, T_FREE, Header

__all__ = ["Receiver"]


class Receiver:
    """Rebuilds incoming general-path messages and gives their regions back; owns the
    postproc thread. ``_free_lock`` orders FREEs against DRAINED: no FREE may follow this
    rank's DRAINED on the wire (it guards ``_drained``)."""

    def __init__(
        self,
        rank: int,
        cc: MPI.Intracomm,
        dc: MPI.Intracomm,
        tag_ub: int,
        settings: CommSettings,
        paths: DirectPaths,
        table: MatchingTable,
        progress: Progress,
        backlog: Backlog,
        stats: PathStats,
        life: Lifecycle,
    ) -> None:
        self.rank = rank
        self._cc, self._dc, self._tag_ub = cc, dc, tag_ub
        self._caller_copy_bytes = settings.caller_copy_bytes
        self._paths, self._table, self._progress = paths, table, progress
        self._backlog, self._stats, self._life = backlog, stats, life
        self._post_q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._free_lock = threading.Lock()
        self._drained = False  # set once this rank sends no more FREEs
        self._thread: threading.Thread | None = None
        # Streamed messages being assembled, by (source, msg_id): touched by the polling
        # thread (new ones, their chunks' arrival) and postproc (chunks landed, completion);
        # single dict operations only, atomic under the GIL.
        self._streams: dict[tuple[int, int], tuple[Incoming, Assembly]] = {}
        self._early: dict[tuple[int, int], list[ChunkBody]] = {}
        # Senders told that this rank takes their large messages by pulling (WANT_PULL),
        # since their last pulled message did not go to an out= receive.
        self._told: set[int] = set()
        progress.attach(self.on_header, self._post_queued_free, self.on_chunk)

    def start(self) -> None:
        """Start the postproc thread."""
        b = self._backlog
        self._thread = start_thread(
            "postproc",
            lambda: b.serve(b.POSTPROC, self._post_q, self._finish),
            self._table.fail_all,
        )

    def stop(self) -> None:
        """Let the postproc thread finish its queue, then join it."""
        self._post_q.put(STOP)
        if self._thread is not None:
            self._thread.join()

    def on_header(self, source: int, seq: int, h: Header) -> None:
        """A header's turn (polling thread): match it, then receive or rebuild its payload."""
        inc = Incoming(source, h.tag, seq, h.path, h.region, h.skeleton, h.stubs, h.inline)
        self._table.on_header(inc)
        if inc.handle is not None and inc.handle.out is not None and inc.inline is None:
            inc.into = out_buffers(inc.stubs, inc.handle.out)
            if inc.into is not None and inc.path != "pull":
                self._offer_pull(inc)
        if inc.path == "pull":
            self._open_pull(inc)
        elif inc.path == "stream":
            self._open_stream(inc)
        elif inc.path == "mpi" and inc.inline is None:
            try:
                inc.finals, inc.views = inc.into or new_buffers(inc.stubs, self.rank)
            except Exception as exc:  # noqa: BLE001 - e.g. torch missing here
                inc.finals, inc.views = [], []
                inc.error = CommError(str(exc))
            data_tag = inc.msg_id % (self._tag_ub + 1)
            if inc.error is None:
                reqs = [
                    self._dc.Irecv([v, MPI.BYTE], source=inc.source, tag=data_tag)
                    for v in inc.views
                    if v.size
                ]
            else:  # still drain the payload so the sender completes
                reqs = [
                    self._dc.Irecv(
                        [np.empty(s.nbytes, np.uint8), MPI.BYTE], source=inc.source, tag=data_tag
                    )
                    for s in inc.stubs
                    if s.nbytes
                ]
            self._progress.track(reqs, lambda: self._to_postproc(inc))
        elif inc.path == "mpi" or (
            inc.path == "shm" and sum(st.nbytes for st in inc.stubs) <= self._caller_copy_bytes
        ):
            # An inline payload, or a moderate one in shared memory: rebuild it on this
            # (probing) thread; a hand-off to the post-processing thread costs more.
            self._finish(inc)
        else:
            self._to_postproc(inc)

    def on_chunk(self, source: int, body: ChunkBody) -> None:
        """A chunk of a streamed message landed (polling thread)."""
        key = (source, body[0])
        entry = self._streams.get(key)
        if entry is None:  # before its header's turn
            self._early.setdefault(key, []).append(body)
            return
        self._take_chunk(source, entry[1], body)

    def stop_frees(self, ranks: Iterable[int]) -> list[MPI.Request]:
        """Send DRAINED to ``ranks``: no FREE follows it (the caller holds the progress
        lock, under which the tracker sends queued FREEs)."""
        with self._free_lock:
            self._drained = True
            return [self._cc.isend(None, dest=r, tag=T_DRAINED) for r in ranks]

    # ------------------------------------------------------------------ helpers

    def receiving_streams(self) -> bool:
        """Whether streamed messages are being assembled here now (any thread)."""
        return bool(self._streams)

    def _to_postproc(self, inc: Incoming | _Landed | _Pull) -> None:
        self._backlog.put(Backlog.POSTPROC, self._post_q, inc)

    def _offer_pull(self, inc: Incoming) -> None:
        """A large message landed in an out= tensor by two copies: tell its sender that
        this rank would read such messages itself (once, until a pull goes elsewhere)."""
        source, limit = inc.source, self._paths.single_copy_min_bytes
        if source in self._told or not self._paths.pulls_from(source):
            return
        if limit and inc.stubs[0].nbytes >= limit:
            self._told.add(source)
            self._send_free((WANT_PULL, source, 0))

    def _open_pull(self, inc: Incoming) -> None:
        """A pulled message's turn (polling thread): its tensor now, the read on postproc."""
        address, inc.region = inc.region, -1
        keep = inc.into is not None or inc.handle is None  # (unexpected: nobody said no)
        if not keep:
            self._told.discard(inc.source)  # the sender goes back to the buffer
        try:
            inc.finals, inc.views = inc.into or new_buffers(inc.stubs, self.rank)
        except Exception as exc:  # noqa: BLE001 - still replied to, then reported
            inc.finals, inc.views = [], []
            inc.error = CommError(str(exc))
        self._to_postproc(_Pull(inc, address, PULLED if keep else PULLED_NEW))

    def _pull(self, job: _Pull) -> None:
        """Postproc: read the sender's bytes, reply, finish. If the kernel refuses the
        read, the bytes come over MPI instead (and this pair stops pulling)."""
        inc = job.inc
        if inc.error is None:
            try:
                self._paths.pull(inc.source, job.address, inc.views[0])
            except OSError:
                self._paths.stop_pulls(inc.source)
                self._told.discard(inc.source)
                inc.path = "mpi"
                data_tag = inc.msg_id % (self._tag_ub + 1)
                req = self._dc.Irecv([inc.views[0], MPI.BYTE], source=inc.source, tag=data_tag)
                self._progress.track([req], lambda: self._to_postproc(inc))
                self._reply(REFUSED, inc)
                return
        inc.path = "shm"  # (counted as a message of the node's direct path)
        self._reply(job.reply, inc)
        self._finish(inc)

    def _reply(self, reply: str, inc: Incoming) -> None:
        """Answer a pulled message's sender, and wake it: its send waits on this."""
        self._send_free((reply, inc.source, inc.msg_id))
        self._progress.ring(inc.source)

    def _open_stream(self, inc: Incoming) -> None:
        try:
            inc.finals, inc.views = inc.into or new_buffers(inc.stubs, self.rank)
        except Exception as exc:  # noqa: BLE001 - still drained, then reported
            inc.finals, inc.views = [], scratch_views(inc.stubs)
            inc.error = CommError(str(exc))
        asm = Assembly(inc.views, sum(s.nbytes for s in inc.stubs))
        key = (inc.source, inc.msg_id)
        self._streams[key] = (inc, asm)
        for body in self._early.pop(key, []):
            self._take_chunk(inc.source, asm, body)

    def _take_chunk(self, source: int, asm: Assembly, body: ChunkBody) -> None:
        """Copy a chunk in (postproc), or receive an MPI piece into place."""
        msg_id, index, start, nbytes, path, region = body
        asm.via = path
        landed = _Landed(source, msg_id, index, start, nbytes, path, region)
        if region >= 0:
            self._to_postproc(landed)
            return
        data_tag = msg_id % (self._tag_ub + 1)
        req = self._dc.Irecv([asm.target(index, start, nbytes), MPI.BYTE], source=source, tag=data_tag)
        self._progress.track([req], lambda: self._to_postproc(landed))

    def _land(self, piece: _Landed) -> None:
        """Postproc: one chunk's bytes are in place (copied here from the buffer, or
        received by MPI); the last one completes the message."""
        key = (piece.source, piece.msg_id)
        inc, asm = self._streams[key]
        if piece.region >= 0:
            try:
                self._paths.read_bytes(piece.path, piece.region, asm.target(piece.index, piece.start, piece.nbytes))
            finally:
                self._send_free((piece.path, piece.source, piece.region))
        if asm.landed(piece.nbytes):
            del self._streams[key]
            inc.path = asm.via  # (counted as a message of its direct path)
            self._finish(inc)

    def _finish(self, inc: Incoming | _Landed | _Pull) -> None:
        if isinstance(inc, _Landed):
            self._land(inc)
            return
        if isinstance(inc, _Pull):
            self._pull(inc)
            return
        try:
            if inc.error is None:
                values = self._payload(inc)
                if inc.into is None:  # (the caller's own tensor is left as it was given)
                    values = [finish_tensor(s, v) for s, v in zip(inc.stubs, values)]
                inc.result = unpack(inc.skeleton, values)
                self._stats.count(inc.path, "received", sum(s.nbytes for s in inc.stubs))
        except Exception as exc:  # noqa: BLE001 - delivered to the waiter
            inc.error = CommError(
                f"smp-comm rank {self.rank}: cannot rebuild message from rank {inc.source} "
                f"(tag {inc.tag}): {exc!r}"
            )
        self._table.finished(inc)

    def _payload(self, inc: Incoming) -> list[Any]:
        if inc.inline is not None:
            return from_blobs(inc.stubs, inc.inline, self.rank)
        if inc.region < 0:  # received into its own tensors (the MPI path, or streamed)
            return inc.finals
        # The region goes back to its sender (a FREE message) once copied out or, for
        # zero-copy views, once the last view is garbage collected. The callback holds no
        # reference to the message, so it cannot keep those views alive.
        release = _Once(self._send_free, (inc.path, inc.source, inc.region))
        try:
            return self._paths.read(inc.path, inc.region, inc.stubs, release, inc.into)
        except BaseException:
            release()
            raise

    def _send_free(self, item: tuple[str, int, int]) -> None:
        """Give a received region back to its sender: a FREE message, posted by the thread
        that let go of the region (often a worker dropping the last view mid-compute).

        Posted here, not by the tracker: waking a sleeping tracker costs the rank's compute
        thread far more than the post (on a shared core every wake-up preempts it). No ring:
        the sender needs the room back only when it next sends, and reads the FREE when it
        next polls. If the lock is taken (by close(), or by this very thread: a finalizer
        run by a garbage collection inside a send), the FREE goes through the tracker's
        queue instead.
        """
        if not self._free_lock.acquire(blocking=False):
            self._progress.free_q.put(item)
            self._progress.nudge()
            return
        try:
            if self._drained or self._life.closed:
                return  # the peers stopped listening for FREEs (close() is under way)
            req = self._post_free(*item)
        finally:
            self._free_lock.release()
        if req is not None:
            self._progress.track([req], nothing)

    def _post_queued_free(
        self, path: str, source: int, region: int
    ) -> tuple[bool, MPI.Request | None]:
        """A FREE the tracker sends (it holds the progress lock, so close() cannot send
        DRAINED meanwhile): whether it was sent, and its request if still in flight."""
        if self._drained:
            return False, None  # the peers stopped listening for FREEs (close() is under way)
        return True, self._post_free(path, source, region)

    def _post_free(self, path: str, source: int, region: int) -> MPI.Request | None:
        """Post a FREE; the request if it is still in flight (a tiny message usually
        leaves at once, eagerly: then nobody has to poll for it)."""
        req = self._cc.isend((path, region), dest=source, tag=T_FREE)
        return None if req.Test() else req


@dataclass
class _Landed:
    """One chunk of a streamed message: in the receive buffer at ``region``, or (-1)
    received by MPI straight into place."""

    source: int
    msg_id: int
    index: int
    start: int
    nbytes: int
    path: str
    region: int


@dataclass
class _Pull:
    """A pulled message waiting for postproc to read its bytes at the sender's
    ``address``, and the reply it gets once read."""

    inc: Incoming
    address: int
    reply: str  # PULLED, or PULLED_NEW: a receive without out= took it


class _Once:
    """Call ``fn(item)`` on the first call only (a region is freed exactly once)."""

    def __init__(self, fn: Callable[[Any], None], item: Any) -> None:
        self._fn, self._item = fn, item
        self._lock = threading.Lock()
        self._done = False

    def __call__(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        self._fn(self._item)
