"""The send side of the general path: the router, direct and requester threads.

``router``     (CommInitiator) picks the path and, for a direct path, reserves room in
               the destination's persistent buffer (else: the MPI fallback);
``direct``     (D2D send) copies the payload into the reserved region (shm memcpy, RMA
               ``Put``, CUDA IPC copy), then posts the header; or streams a payload that
               finds no room, chunk by chunk (:mod:`smp_comm.stream`);
``requester``  (CommPreprocessing + CommRequester) stages GPU tensors to host and posts the
               header and payload ``Isend``\\ s of the MPI path.

A lone large CPU tensor to a node peer that receives into ``irecv(out=...)`` takes the pull
path instead (:mod:`smp_comm.cma`): only a header goes, and the receiver reads the bytes.

A moderate CPU payload skips the hand-offs: the sending thread routes and copies it itself
(``route(op, inline=True)``).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
from mpi4py import MPI

from smp_comm.cma import PULLED_NEW, REFUSED, WANT_PULL
from smp_comm.handles import SendHandle
from smp_comm.matching import MatchingTable
from smp_comm.paths import DirectPaths
from smp_comm.progress import Progress
from smp_comm.serialize import Packed
from smp_comm.state import STOP, Backlog, PathStats, nothing, start_thread
from smp_comm.stream import (
    CHUNK_BYTES,
    ROOM_WAIT_S,
    chunks_of,
    source_bytes,
    wait_for_room,
)
from smp_comm.wire import T_CHUNK, T_HEADER, WireHeader

#: Stream a payload that finds no room even while this rank is receiving streamed messages
#: itself; False (the default) sends it over the MPI fallback then (see :meth:`Sender.route`).
#: The tests of the streaming mechanism under all-to-all traffic set it.
STREAM_WHILE_RECEIVING = False

__all__ = ["Outgoing", "Sender"]


@dataclass
class Outgoing:
    """An outgoing general-path message as it moves between threads."""

    handle: SendHandle
    dest: int
    tag: int
    msg_id: int  # per-destination sequence number (also the payload's MPI tag)
    cuda_event: Any = None
    packed: Packed | None = None
    path: str = "mpi"
    region: int = -1
    wake: bool = True  # ring the destination's doorbell (isend's ``wake``)
    via: str = ""  # a streamed message's direct path (path is then "stream")


class Sender:
    """Routes and posts general-path messages; owns the router, direct and requester
    threads and their queues. No lock of its own: the queues are thread-safe, the buffers'
    reservations are :class:`~smp_comm.paths.DirectPaths`' and the counts the
    :class:`~smp_comm.state.Backlog`'s and :class:`~smp_comm.state.PathStats`'."""

    def __init__(
        self,
        cc: MPI.Intracomm,
        dc: MPI.Intracomm,
        tag_ub: int,
        paths: DirectPaths,
        table: MatchingTable,
        progress: Progress,
        backlog: Backlog,
        stats: PathStats,
    ) -> None:
        self._cc, self._dc, self._tag_ub = cc, dc, tag_ub
        self._paths, self._table, self._progress = paths, table, progress
        self._backlog, self._stats = backlog, stats
        self._router_q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._direct_q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._requester_q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        # Whether this rank is itself receiving streamed messages (set by the communicator
        # from its receiver): see route().
        self.receiving_streams: Callable[[], bool] = lambda: False
        # The pull path (smp_comm.cma): sends waiting for their receiver's reply, by
        # (dest, msg_id), and the node peers whose last word was that they receive into
        # their own tensors. Single dict/set operations (router or caller, and tracker).
        self._pulls: dict[tuple[int, int], Outgoing] = {}
        self._wants_pull: set[int] = set()
        progress.on_pull_reply = self._on_pull_reply

    def start(self) -> None:
        """Start the three threads."""
        b, fail = self._backlog, self._table.fail_all
        self._threads = [
            start_thread("router", lambda: b.serve(b.ROUTER, self._router_q, self.route), fail),
            start_thread(
                "direct", lambda: b.serve(b.DIRECT, self._direct_q, self._direct_send), fail
            ),
            start_thread(
                "requester", lambda: b.serve(b.REQUESTER, self._requester_q, self._mpi_send), fail
            ),
        ]

    def stop(self) -> None:
        """Let each thread finish its queue, then join it."""
        for q in (self._router_q, self._direct_q, self._requester_q):
            q.put(STOP)
        for t in self._threads:
            t.join()

    def submit(self, op: Outgoing) -> None:
        """Hand ``op`` to the router thread."""
        self._backlog.put(Backlog.ROUTER, self._router_q, op)

    def route(self, op: Outgoing, inline: bool = False) -> None:
        """Choose the path (router thread; or the sending thread itself when ``inline``)."""
        packed = op.packed
        assert packed is not None
        gpu = packed.on_gpu()
        candidates = self._paths.candidates(op.dest, all_gpu=all(gpu), any_gpu=any(gpu))
        if (
            op.dest in self._wants_pull
            and len(packed.stubs) == 1
            and not gpu[0]
            and packed.nbytes >= self._paths.single_copy_min_bytes
            and self._paths.pulls_to(op.dest)
        ):
            self._pull_send(op)
            return
        host = [p for p in candidates if p in ("shm", "rma")] if not any(gpu) else []
        big = 0 < self._paths.stream_min_bytes <= packed.nbytes
        if big and host and packed.nbytes >= 2 * CHUNK_BYTES:
            if self._paths.copies_out(host[0], op.dest):  # two copies: overlap them
                self._stream(op, host[0])
                return
        for path in candidates:
            region = self._reserve(path, op.dest, packed.region_bytes)
            if region is not None:
                op.path, op.region = path, region
                if inline and path == "shm":
                    self._direct_send(op, inline=True)
                else:  # one copier thread per window: MPI passive-target RMA from
                    # several threads at once is not safe
                    self._backlog.put(Backlog.DIRECT, self._direct_q, op)
                return
        if (
            big
            and host
            and self._paths.slice_bytes(host[0], op.dest) >= 4 * (64 << 10)
            and (STREAM_WHILE_RECEIVING or not self.receiving_streams())
        ):
            self._stream(op, host[0])  # no room now: stream it through as room frees
            return
        # No room, and this rank copies streamed messages out as well (traffic both ways):
        # streaming costs two copies (ours in, the receiver's out), the fallback one (MPI's),
        # and with both ranks busy copying the total is what counts (bench_traffic "both
        # ways": 0.93-0.97x mpi4py streaming, 1.13-1.25x falling back).
        self._fall_back_to_mpi(op, inline, counted=bool(candidates))

    def post_header(self, op: Outgoing, header: WireHeader, extra: list[MPI.Request]) -> None:
        """Send the header (and any payload requests already posted) and track them all."""
        assert op.packed is not None
        req = self._cc.isend(header, dest=op.dest, tag=T_HEADER)
        if op.wake:
            self._progress.ring(op.dest)
        nbytes = op.packed.nbytes
        reqs = [req, *extra]
        if not extra and MPI.Request.Testall(reqs):
            self._sent(op, nbytes)  # a small header usually leaves at once (eager)
            return
        self._progress.track(reqs, lambda: self._sent(op, nbytes))

    # ------------------------------------------------------------------ helpers

    def _sent(self, op: Outgoing, nbytes: int) -> None:
        self._stats.count(op.path, "sent", nbytes)
        self._table.send_done(op.handle)

    def _pull_send(self, op: Outgoing) -> None:
        """Post a header carrying the address of the tensor's bytes; the send stays open
        until the receiver read them and replied (:meth:`_on_pull_reply`)."""
        p = op.packed
        assert p is not None
        op.path = "shm"  # (counted as a message of the node's direct path)
        self._pulls[(op.dest, op.msg_id)] = op  # keeps the bytes alive until the reply
        address = source_bytes(p.sources[0]).ctypes.data
        header: WireHeader = (op.msg_id, op.tag, "pull", address, p.skeleton, p.stubs, None)
        req = self._cc.isend(header, dest=op.dest, tag=T_HEADER)
        if op.wake:
            self._progress.ring(op.dest)
        if not req.Test():
            self._progress.track([req], nothing)

    def _on_pull_reply(self, reply: str, dest: int, msg_id: int) -> None:
        """The receiver's word on the pull path (tracker thread): see :mod:`smp_comm.cma`."""
        if reply == WANT_PULL:
            if self._paths.pulls_to(dest):
                self._wants_pull.add(dest)
            return
        op = self._pulls.pop((dest, msg_id), None)
        if op is None or op.packed is None:  # pragma: no cover - one reply per message
            return
        nbytes = op.packed.nbytes
        if reply == REFUSED:  # the receiver posted an Irecv for the bytes instead
            self._paths.stop_pulls(dest)
            self._wants_pull.discard(dest)
            op.path = "mpi"
            src = source_bytes(op.packed.sources[0])
            req = self._dc.Isend([src, MPI.BYTE], dest=dest, tag=op.msg_id % (self._tag_ub + 1))
            self._progress.track([req], lambda: self._sent(op, nbytes))
            return
        if reply == PULLED_NEW:  # no out= receive took it: back to the zero-copy buffer
            self._wants_pull.discard(dest)
        self._sent(op, nbytes)

    def _fall_back_to_mpi(self, op: Outgoing, inline: bool, counted: bool = True) -> None:
        """Send ``op`` over MPI: from this thread when ``inline``, else via the requester
        thread. ``counted``: a direct path was possible, so this is a fallback in stats()."""
        if counted:
            self._stats.fallback()
        op.path, op.region = "mpi", -1
        if inline:
            self._mpi_send(op)
        else:
            self._backlog.put(Backlog.REQUESTER, self._requester_q, op)

    def _stream(self, op: Outgoing, via: str) -> None:
        op.path, op.via, op.region = "stream", via, -1
        self._backlog.put(Backlog.DIRECT, self._direct_q, op)

    def _reserve(self, path: str, dest: int, nbytes: int) -> int | None:
        """A region of ``dest``'s ``path`` buffer, or None. When there is no room, the
        FREEs that would make it may already have arrived unread (a sender reads them only
        when it polls): one progress round reads them, then a second try. Without it a
        stream that fills the buffer took the MPI fallback on every third 64 MiB message at
        k=1, though the receiver had let go of the first long before."""
        region = self._paths.reserve(path, dest, nbytes)
        if region is None and path in ("shm", "rma"):
            self._poll()
            region = self._paths.reserve(path, dest, nbytes)
        return region

    def _poll(self) -> None:
        """Drive MPI progress from this thread (while waiting for room: the FREEs that
        make it arrive as control messages)."""
        progress = self._progress
        if progress.lock.acquire(timeout=1e-3):
            try:
                progress.poll_once()
            finally:
                progress.lock.release()

    def _stream_send(self, op: Outgoing) -> None:
        """Send ``op`` as a header, then chunks through ``op.via`` as room frees up (the
        direct thread; :mod:`smp_comm.stream`)."""
        p = op.packed
        assert p is not None
        path, dest, paths = op.via, op.dest, self._paths
        header: WireHeader = (op.msg_id, op.tag, "stream", -1, p.skeleton, p.stubs, None)
        reqs = [self._cc.isend(header, dest=dest, tag=T_HEADER)]
        if op.wake:
            self._progress.ring(dest)
        chunk = max(64 << 10, min(CHUNK_BYTES, paths.slice_bytes(path, dest) // 4))
        data_tag = op.msg_id % (self._tag_ub + 1)
        over_mpi = False  # once room failed to come, the rest goes over MPI
        for i, start, n in chunks_of(p.stubs, chunk):
            src = source_bytes(p.sources[i])[start : start + n]
            region = None
            if not over_mpi:
                region = wait_for_room(partial(paths.reserve, path, dest, n), self._poll, ROOM_WAIT_S)
            if region is not None:
                try:
                    paths.write_bytes(path, dest, region, src)
                except Exception:  # noqa: BLE001 - the MPI path still delivers it
                    paths.release(path, dest, region)
                    region = None
            if region is None:
                over_mpi = True
                reqs.append(self._cc.isend((op.msg_id, i, start, n, path, -1), dest=dest, tag=T_CHUNK))
                reqs.append(self._dc.Isend([src, MPI.BYTE], dest=dest, tag=data_tag))
            else:
                reqs.append(self._cc.isend((op.msg_id, i, start, n, path, region), dest=dest, tag=T_CHUNK))
            self._progress.ring(dest)
        if over_mpi:
            self._stats.fallback()
        self._stats.streamed(path)
        op.path = path  # (counted as a message of its direct path)
        nbytes = p.nbytes
        self._progress.track(reqs, lambda: self._sent(op, nbytes))

    def _direct_send(self, op: Outgoing, inline: bool = False) -> None:
        if op.path == "stream":
            self._stream_send(op)
            return
        assert op.packed is not None
        if op.cuda_event is not None:
            op.cuda_event.synchronize()
        try:
            self._paths.write(op.path, op.dest, op.region, op.packed)
        except Exception:  # noqa: BLE001 - the MPI path still delivers it
            self._paths.release(op.path, op.dest, op.region)
            self._fall_back_to_mpi(op, inline)
            return
        p = op.packed
        self.post_header(op, (op.msg_id, op.tag, op.path, op.region, p.skeleton, p.stubs, None), [])

    def _mpi_send(self, op: Outgoing) -> None:
        p = op.packed
        assert p is not None
        if any(p.on_gpu()):
            if op.cuda_event is not None:
                op.cuda_event.synchronize()
            # Host staging (CommPreprocessing): MPI reads host memory only.
            p.sources = [s.cpu().numpy() if not isinstance(s, np.ndarray) else s for s in p.sources]
        header: WireHeader = (op.msg_id, op.tag, "mpi", -1, p.skeleton, p.stubs, None)
        data_tag = op.msg_id % (self._tag_ub + 1)
        # Header first, then payloads: the receiver posts matching Irecvs on the header.
        reqs = [
            self._dc.Isend([src, MPI.BYTE], dest=op.dest, tag=data_tag)
            for src in p.sources
            if src.size
        ]
        self.post_header(op, header, reqs)
