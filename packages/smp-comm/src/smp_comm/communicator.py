"""The :class:`Communicator`: on-demand tensor messages over MPI and direct paths.

``isend`` pickles the object's skeleton in the calling thread (tensors become stubs; a
pickling error raises there) and numbers the message for its destination. A payload of at
most ``inline_bytes`` rides inside the header, posted from that thread. Everything else
goes through threads (paper, Appendix G), each consuming one queue of messages:

``router``     (CommInitiator) picks the path and, for a direct path, reserves room in
               the destination's persistent buffer (else: the MPI fallback);
``direct``     (D2D send) copies the payload into the reserved region (shm memcpy, RMA
               ``Put``, CUDA IPC copy), then posts the header;
``requester``  (CommPreprocessing + CommRequester) stages GPU tensors to host and posts the
               header and payload ``Isend``\\ s of the MPI path;
``tracker``    (CommTracker) tests every outstanding MPI request, probes for incoming
               control messages (``Improbe`` + ``Mrecv``: never a blind receive), matches
               headers to posted receives and posts the payload ``Irecv``\\ s;
``postproc``   (CommPostprocessing, D2D recv) copies payloads out of the receive buffer
               (or hands out views of it), has the region freed (a ``FREE`` message back
               to the sender) and rebuilds the object.

A thread blocked in ``wait()`` runs the tracker's polling itself for a short while (see
``poll_spin``), so a small message costs no thread hand-off on either side.

A lone CPU tensor or array of at most ``small_message_bytes`` skips all of the above: it
travels as one self-describing frame (:mod:`smp_comm.fastpath`), ``Isend``-ed on a
communicator of its own from the calling thread, and is taken by whichever thread probes
it first (matched probes make that safe), usually the one waiting for it.

Matching semantics are MPI's: a header is matched, in arrival order, against the posted
receives in the order they were posted (the first posted receive whose source and tag
accept it wins); a header nobody waits for joins the unexpected queue, which a later
``irecv`` searches oldest first. Messages from one sender are matched in the order its
``isend`` calls were made: headers carry a per-destination sequence number and the
receiver processes them in that order, whichever thread and path carried each.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from mpi4py import MPI

from smp_comm import compiled as _compiled
from smp_comm import fastpath
from smp_comm.doorbell import Doorbells, doorbells_available
from smp_comm.errors import CommClosedError, CommError, PeerClosedError
from smp_comm.handles import Handle, RecvHandle, SendHandle
from smp_comm.paths import DirectPaths
from smp_comm.serialize import (
    Packed,
    TensorStub,
    finish_tensor,
    from_blobs,
    new_buffers,
    pack,
    torch,
    unpack,
)
from smp_comm.settings import PATHS, CommSettings

__all__ = ["ANY_SOURCE", "ANY_TAG", "Communicator"]

ANY_SOURCE: int = MPI.ANY_SOURCE
ANY_TAG: int = MPI.ANY_TAG

# Control-message tags on the private control communicator.
_T_HEADER, _T_FREE, _T_BYE, _T_DRAINED = 1, 2, 3, 4
_FAST = 0  # a fast-path frame waiting for its turn in its sender's order
# Fast-path probes a waiting thread makes between two full progress rounds: a round costs
# about as much as 10 probes, and the probes are what finds a small message soonest.
_SPIN_PROBES = 32
_LANE_PROBES = 8  # probes per call into the compiled fast path, which drops the GIL for them
_STOP = object()  # queue sentinel


@dataclass
class _Send:
    """An outgoing message as it moves between threads."""

    handle: SendHandle
    dest: int
    tag: int
    msg_id: int  # per-destination sequence number (also the payload's MPI tag)
    cuda_event: Any = None
    packed: Packed | None = None
    path: str = "mpi"
    region: int = -1
    wake: bool = True  # ring the destination's doorbell (isend's ``wake``)


@dataclass
class _Incoming:
    """An incoming message, from its header until its object is rebuilt."""

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
    done: bool = False
    result: Any = None
    error: BaseException | None = None


@dataclass
class _Tracked:
    """MPI requests the tracker tests; ``on_done`` runs in the tracker once all completed."""

    requests: list[MPI.Request]
    on_done: Callable[[], None]


class Communicator:
    """Tensor message backend over an MPI communicator (any intra-communicator).

    Construction and :meth:`close` are collective over ``mpi_comm``; ``isend``/``irecv`` are
    not, and may be called from any number of threads. See the module docstring for the
    threads and the matching rules, and :mod:`smp_comm.settings` for the keyword arguments.
    """

    def __init__(
        self,
        mpi_comm: MPI.Comm | None = None,
        *,
        buffer_bytes: int | str | None = None,
        gpu_buffer_bytes: int | str | None = None,
        inline_bytes: int | str | None = None,
        small_message_bytes: int | str | None = None,
        disable: str | set[str] | frozenset[str] | list[str] | tuple[str, ...] | None = None,
        node_id: str | int | None = None,
        shm_zero_copy: bool | None = None,
        close_timeout: float | None = None,
        poll_spin: float | None = None,
        doorbell: bool | None = None,
        compiled: bool | None = None,
    ) -> None:
        base = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise CommError(
                "smp-comm needs MPI initialized with MPI_THREAD_MULTIPLE "
                f"(got level {MPI.Query_thread()}); do not lower mpi4py.rc.thread_level"
            )
        if base.Is_inter():
            raise CommError("smp-comm needs an intra-communicator, got an inter-communicator")
        self.rank: int = base.Get_rank()
        self.size: int = base.Get_size()
        self.settings = CommSettings.resolve(
            self.rank,
            buffer_bytes=buffer_bytes,
            gpu_buffer_bytes=gpu_buffer_bytes,
            inline_bytes=inline_bytes,
            small_message_bytes=small_message_bytes,
            disable=disable,
            node_id=node_id,
            shm_zero_copy=shm_zero_copy,
            close_timeout=close_timeout,
            poll_spin=poll_spin,
            doorbell=doorbell,
            compiled=compiled,
        )
        # Collective set-up, in the same order on every rank: private communicators for
        # control messages, for MPI-path payloads and for fast-path frames (always created
        # and probed, so ranks with different small_message_bytes still talk), then the
        # persistent direct buffers.
        self._cc: MPI.Intracomm = base.Dup()  # type: ignore[assignment]
        self._dc: MPI.Intracomm = base.Dup()  # type: ignore[assignment]
        self._fc: MPI.Intracomm = base.Dup()  # type: ignore[assignment]
        self._fast_limit = self.settings.small_message_bytes
        self._fstatus = MPI.Status()
        # The compiled fast path (smp_comm.compiled), or None: the Python one. Either end
        # may use either: both send the same frames.
        self._lane = _compiled.load() if self._fast_limit and self.settings.compiled else None
        self._fc_handle: int = self._fc.handle
        # Fast-path messages and bytes sent, received; under _match_lock, which both ends
        # of the fast path hold anyway (a second lock per message costs latency).
        self._fast_count = [0, 0, 0, 0]
        self._tag_ub: int = int(self._cc.Get_attr(MPI.TAG_UB))  # type: ignore[arg-type]
        self._paths = DirectPaths(self._cc, self.settings)
        self._bell = self._open_doorbells()
        self._deep = False  # the tracker sleeps on its doorbell (not polling)

        self._closing = False
        self._closed = False
        self._close_lock = threading.Lock()
        self._fatal: BaseException | None = None
        self._seq_to = [0] * self.size  # next sequence number per destination
        self._seq_from = [0] * self.size  # next expected sequence number per source
        self._held: list[dict[int, tuple[int, Any]]] = [{} for _ in range(self.size)]
        self._stats_lock = threading.Lock()
        self._stats = {
            p: {"messages_sent": 0, "bytes_sent": 0, "messages_received": 0, "bytes_received": 0}
            for p in PATHS
        }
        self._fallbacks = 0

        # Matching state (guarded by _match_lock).
        self._match_lock = threading.Lock()
        self._posted: list[RecvHandle] = []
        self._unexpected: list[_Incoming] = []
        self._live_incs: dict[int, _Incoming] = {}  # id -> message not yet rebuilt
        self._bye_from: set[int] = set()
        self._drained_from: set[int] = set()
        self._open_sends: set[SendHandle] = set()

        self._router_q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._direct_q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._requester_q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._track_q: queue.SimpleQueue[_Tracked] = queue.SimpleQueue()
        self._post_q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._wake = threading.Event()  # nudges the tracker out of its idle sleep (_nudge)
        self._progress_lock = threading.Lock()  # one thread at a time runs _poll_once
        self._active: list[_Tracked] = []  # outstanding MPI requests (under _progress_lock)
        self._free_q: queue.SimpleQueue[tuple[str, int, int]] = queue.SimpleQueue()
        self._free_lock = threading.Lock()  # FREEs sent directly vs close()'s DRAINED
        self._status = MPI.Status()
        self._working = [0, 0, 0, 0]  # queued items: router, direct, requester, postproc
        self._working_lock = threading.Lock()
        self._drained = False  # set by close() once this rank sends no more FREEs
        # One entry per thread inside _wait's polling phase (list append/pop are atomic).
        self._spinners: list[None] = []
        self._tracker_stop = threading.Event()
        self._inflight_recv = 0  # incoming messages not yet rebuilt (tracker/postproc)

        self._threads = [
            self._thread("router", lambda: self._serve(0, self._router_q, self._route)),
            self._thread("direct", lambda: self._serve(1, self._direct_q, self._direct_send)),
            self._thread("requester", lambda: self._serve(2, self._requester_q, self._mpi_send)),
            self._thread("tracker", self._tracker_loop),
            self._thread("postproc", lambda: self._serve(3, self._post_q, self._finish)),
        ]
        for t in self._threads:
            t.start()
        _LIVE.add(self)

    # ------------------------------------------------------------------ public API

    def isend(self, obj: Any, dest: int, tag: int = 0, *, wake: bool = True) -> SendHandle:
        """Start sending ``obj`` (any picklable structure of tensors/arrays) to ``dest``.

        Returns at once. The tensors in ``obj`` must not be modified until the handle's
        ``wait()`` returns (as with ``MPI_Isend``).

        ``wake=False``: do not ring ``dest``'s doorbell. For a message nobody waits for at
        once (a hint, a clean-up note): ``dest`` takes it at its next progress round (a
        thread waiting there, its next rung message, or its tracker's idle timeout,
        at most 50 ms), and its compute is not interrupted for it.
        """
        if self._fast_limit and type(tag) is int and 0 <= tag <= self._tag_ub:
            # Fast path first: every check below costs, and a small message feels each one.
            item = obj if self._lane is not None else fastpath.encode(obj, self._fast_limit)
            if item is not None:
                handle = self._fast_send(item, dest, tag, wake)
                if handle is not None:
                    return handle
        self._check_open()
        self._check_rank(dest, "dest")
        if not isinstance(tag, int) or tag < 0:
            raise ValueError(f"smp-comm isend: tag must be an int >= 0, got {tag!r}")
        try:
            packed = pack(obj)  # the skeleton is pickled now: later changes to it don't travel
        except Exception as exc:
            raise CommError(
                f"smp-comm rank {self.rank}: cannot serialize message for rank {dest} (tag {tag}): {exc!r}"
            ) from exc
        handle = SendHandle(dest, tag, self.rank, self._wait)
        with self._match_lock:
            if self._closing:  # checked under the lock close() takes to number its BYEs
                raise CommClosedError(f"smp-comm rank {self.rank}: the Communicator is closed")
            if dest in self._bye_from:
                handle._complete(error=self._peer_closed(dest, f"send (tag {tag})"))
                return handle
            self._open_sends.add(handle)
            # Per-destination sequence number: the receiver matches headers in this order
            # whichever thread posts them (MPI's non-overtaking rule).
            seq = self._seq_to[dest]
            self._seq_to[dest] = seq + 1
        op = _Send(handle, dest, tag, seq, packed=packed, wake=wake)
        gpu = packed.on_gpu()
        if not any(gpu) and packed.nbytes <= self.settings.inline_bytes:
            # Fast lane: a small payload rides inside the header, posted from this thread.
            inline = [bytes(s) for s in packed.sources]
            self._post_header(op, (seq, tag, "mpi", -1, packed.skeleton, packed.stubs, inline), [])
            return handle
        if not any(gpu) and packed.nbytes <= self.settings.caller_copy_bytes:
            # Moderate CPU payload: route, and copy into shared memory, here; two thread
            # hand-offs (router, copier) cost more than copying up to a MiB.
            self._route(op, inline=True)
            return handle
        if any(gpu):
            # The payload may still be being computed on the caller's stream: record an
            # event there so the copying threads wait for it (and not for later work).
            op.cuda_event = torch.cuda.Event()
            op.cuda_event.record()
        self._enqueue(0, self._router_q, op)
        return handle

    def _fast_send(self, item: Any, dest: int, tag: int, wake: bool) -> SendHandle | None:
        """Send a fast-path frame from the calling thread (see :mod:`smp_comm.fastpath`).

        ``item``: the object itself when the compiled fast path is in use (it encodes and
        posts in one call under the lock, and ``None`` is returned, nothing sent, if the
        object does not qualify), else :func:`fastpath.encode`'s parts. Ordered for
        latency: the frame leaves first, the handle is made afterwards.
        """
        if self._closing or self._fatal is not None:
            self._check_open()
        if type(dest) is not int or not 0 <= dest < self.size:
            self._check_rank(dest, "dest")
        lane = self._lane
        with self._match_lock:
            if self._closing:  # checked under the lock close() takes to number its BYEs
                raise CommClosedError(f"smp-comm rank {self.rank}: the Communicator is closed")
            if dest in self._bye_from:
                handle = SendHandle(dest, tag, self.rank, self._wait)
                handle._complete(error=self._peer_closed(dest, f"send (tag {tag})"))
                return handle
            # Posted under the lock that numbers it: frames to one rank leave in sequence
            # order, and close() cannot number its BYE in between. ``sent``: the payload
            # bytes if the frame has left (small frames go out eagerly), else
            # (request, frame, payload bytes), the frame kept alive until MPI is done.
            seq = self._seq_to[dest]
            if lane is not None:
                sent = lane.send(self._fc_handle, item, self._fast_limit, seq, dest, tag)
                if sent is None:
                    return None  # not a fast-path object: seq stays unused
            else:
                buf = fastpath.frame(item, seq)
                req = self._fc.Isend(buf, dest, tag)  # (a bytes object: no datatype to parse)
                sent = len(item[-1]) if req.Test() else (req, buf, len(item[-1]))
            self._seq_to[dest] = seq + 1
            handle = SendHandle(dest, tag, self.rank, self._wait)
            counts = self._fast_count
            counts[0] += 1
            if type(sent) is int:
                counts[1] += sent
                handle._done = True  # nobody else holds the handle yet
            else:
                pending, frame, nbytes = sent
                counts[1] += nbytes
                self._open_sends.add(handle)
        if wake:
            self._ring(dest)
        if type(sent) is not int:
            req = pending if lane is None else MPI.Request.fromhandle(pending)
            self._track([req], lambda: self._fast_sent(handle, frame))
        return handle

    def _fast_sent(self, handle: SendHandle, buf: bytes) -> None:
        del buf  # kept alive by the callback until MPI is done with it
        handle._complete()
        with self._match_lock:
            self._open_sends.discard(handle)

    def irecv(self, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> RecvHandle:
        """Post a receive; ``wait()`` returns ``(obj, source, tag)``.

        ``source``/``tag`` may be :data:`ANY_SOURCE`/:data:`ANY_TAG`. When several posted
        receives accept a message, the one posted first gets it (MPI's rule).
        """
        self._check_open()
        if source != ANY_SOURCE:
            self._check_rank(source, "source")
        if not isinstance(tag, int) or (tag < 0 and tag != ANY_TAG):
            raise ValueError(f"smp-comm irecv: tag must be an int >= 0 or ANY_TAG, got {tag!r}")
        handle = RecvHandle(source, tag, self.rank, self._wait, self._cancel)
        with self._match_lock:
            for i, inc in enumerate(self._unexpected):
                if _accepts(handle, inc):
                    del self._unexpected[i]
                    self._bind(handle, inc)
                    return handle
            err = self._unreachable(source)
            if err is not None:
                handle._complete(error=err)
                return handle
            self._posted.append(handle)
        return handle

    @property
    def fast_path(self) -> str:
        """How this rank sends and takes small-message fast-path frames: ``"compiled"``
        (:mod:`smp_comm.compiled`), ``"python"`` (it could not be built, or
        ``compiled=False``: :func:`smp_comm.compiled.why_not` says why) or ``"off"``
        (``small_message_bytes=0``)."""
        if not self._fast_limit:
            return "off"
        return "python" if self._lane is None else "compiled"

    def stats(self) -> dict[str, dict[str, int]]:
        """Messages and payload bytes per path: ``{"mpi": {...}, "shm": ..., "cuda_ipc": ...,
        "rma": ...}``; each holds ``messages``/``bytes`` (sent + received) and the
        ``*_sent``/``*_received`` parts; ``mpi`` also counts ``fallbacks`` (messages that a
        direct path could have carried but whose destination buffer lacked room) and
        ``fast_sent``/``fast_received`` (its messages that took the small-message fast
        path, :mod:`smp_comm.fastpath`)."""
        with self._stats_lock:
            out = {}
            for p, s in self._stats.items():
                d = dict(s)
                d["messages"] = s["messages_sent"] + s["messages_received"]
                d["bytes"] = s["bytes_sent"] + s["bytes_received"]
                out[p] = d
            out["mpi"]["fallbacks"] = self._fallbacks
        with self._match_lock:
            fast = list(self._fast_count)
        # Fast-path messages are MPI messages: counted in "mpi" too.
        mpi = out["mpi"]
        mpi["fast_sent"], mpi["fast_received"] = fast[0], fast[2]
        mpi["messages_sent"] += fast[0]
        mpi["bytes_sent"] += fast[1]
        mpi["messages_received"] += fast[2]
        mpi["bytes_received"] += fast[3]
        mpi["messages"] += fast[0] + fast[2]
        mpi["bytes"] += fast[1] + fast[3]
        return out

    def path_to(self, dest: int, device: str = "cpu") -> str:
        """The path a large payload on ``device`` would take to ``dest`` with room to spare."""
        self._check_rank(dest, "dest")
        on_gpu = device.startswith("cuda")
        for p in self._paths.candidates(dest, all_gpu=on_gpu, any_gpu=on_gpu):
            return p
        return "mpi"

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout: float | None = None) -> None:
        """Collective: finish this rank's sends, tell every peer, serve their last messages,
        join every thread and free windows and communicators. Idempotent.

        A receive still posted fails with :class:`CommClosedError`. Raises
        :class:`CommError` (naming the ranks) if peers do not close within ``timeout``
        (default ``settings.close_timeout``); then windows are left to process exit.
        """
        with self._close_lock:
            if self._closed:
                return
            self._closing = True
            limit = self.settings.close_timeout if timeout is None else timeout
            deadline = time.monotonic() + limit
            try:
                self._close_protocol(deadline)
            finally:
                self._closed = True
                _LIVE.discard(self)

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers

    def _check_open(self) -> None:
        if self._closing:
            raise CommClosedError(f"smp-comm rank {self.rank}: the Communicator is closed")
        if self._fatal is not None:
            raise CommError(f"smp-comm rank {self.rank}: backend failed: {self._fatal!r}")

    def _check_rank(self, r: int, what: str) -> None:
        if not isinstance(r, int) or not 0 <= r < self.size:
            raise ValueError(
                f"smp-comm rank {self.rank}: {what}={r!r} is not a rank of a communicator of size {self.size}"
            )

    def _peer_closed(self, peer: int, what: str) -> PeerClosedError:
        return PeerClosedError(
            f"smp-comm rank {self.rank}: {what}: rank {peer} has closed its Communicator", peer
        )

    def _unreachable(self, source: int) -> BaseException | None:
        """Error for a receive that can never be matched any more (caller holds _match_lock)."""
        if self._fatal is not None:
            return CommError(f"smp-comm rank {self.rank}: backend failed: {self._fatal!r}")
        if source == ANY_SOURCE:
            others = set(range(self.size)) - {self.rank}
            if others and others <= self._bye_from:
                return CommError(
                    f"smp-comm rank {self.rank}: receive from any rank: every other rank "
                    f"({sorted(others)}) has closed its Communicator"
                )
            return None
        if source in self._bye_from:
            return self._peer_closed(source, "receive")
        return None

    def _cancel(self, handle: RecvHandle) -> bool:
        with self._match_lock:
            if handle in self._posted:
                self._posted.remove(handle)
                handle._complete(error=CommError(f"smp-comm rank {self.rank}: receive cancelled"))
                return True
        return False

    def _bind(self, handle: RecvHandle, inc: _Incoming) -> None:
        """Attach a receive to a message (caller holds _match_lock)."""
        inc.handle = handle
        if inc.done:
            self._deliver(inc)

    def _deliver(self, inc: _Incoming) -> None:
        assert inc.handle is not None
        if inc.error is not None:
            inc.handle._complete(error=inc.error)
        else:
            inc.handle._complete(result=(inc.result, inc.source, inc.tag))
        inc.result = None  # the handle holds it now

    def _count(self, path: str, direction: str, nbytes: int) -> None:
        with self._stats_lock:
            s = self._stats[path]
            s[f"messages_{direction}"] += 1
            s[f"bytes_{direction}"] += nbytes

    def _open_doorbells(self) -> Doorbells | None:
        """Doorbells when the setting allows and every rank shares this host (collective)."""
        want = self.settings.doorbell and doorbells_available()
        one_host = len(set(self._paths.node_of)) == 1
        if not self._cc.allreduce(bool(want and one_host), op=MPI.LAND):
            return None
        try:
            return Doorbells(self._cc)
        except OSError as exc:  # raised on every rank alike: all poll instead
            warnings.warn(f"smp-comm rank {self.rank}: {exc}; polling", RuntimeWarning, stacklevel=3)
            return None

    def _nudge(self) -> None:
        """Wake the tracker: local work for it (or a waiter handing progress back)."""
        self._wake.set()
        if self._bell is not None:
            self._bell.nudge()

    def _ring(self, dest: int) -> None:
        """After posting a message to ``dest``: wake its tracker if it sleeps."""
        if self._bell is not None:
            self._bell.ring(dest)

    def _thread(self, name: str, loop: Callable[[], None]) -> threading.Thread:
        return threading.Thread(target=self._guard(loop), name=f"smp-comm-{name}", daemon=True)

    def _guard(self, loop: Callable[[], None]) -> Callable[[], None]:
        """Run a thread loop; if it dies, fail every waiter instead of leaving it hanging."""

        def run() -> None:
            try:
                loop()
            except BaseException as exc:  # noqa: BLE001 - reported to every waiter
                self._fail_all(exc)
                raise

        return run

    def _fail_all(self, exc: BaseException) -> CommError:
        """The backend broke: fail every pending operation (nothing may hang on it)."""
        self._fatal = exc
        err = CommError(f"smp-comm rank {self.rank}: backend failed: {exc!r}")
        with self._match_lock:
            for h in self._posted:
                h._complete(error=err)
            self._posted.clear()
            for sh in list(self._open_sends):
                sh._complete(error=err)
            for inc in self._live_incs.values():
                if inc.handle is not None:
                    inc.handle._complete(error=err)
        return err

    def _send_done(self, op: _Send, nbytes: int, error: BaseException | None = None) -> None:
        if error is None:
            self._count(op.path, "sent", nbytes)
        op.handle._complete(error=error)
        with self._match_lock:
            self._open_sends.discard(op.handle)

    def _track(self, requests: list[MPI.Request], on_done: Callable[[], None]) -> None:
        # No Event wake-up: a polling tracker polls within 1 ms anyway, and a thread waiting
        # on the handle polls at once (waking the tracker would only contend for the GIL).
        # A tracker asleep on its doorbell is woken (a flag read when it is not).
        self._track_q.put(_Tracked(requests, on_done))
        if self._bell is not None:
            self._bell.nudge()

    def _post_header(self, op: _Send, header: tuple[Any, ...], extra: list[MPI.Request]) -> None:
        """Send the header (and any payload requests already posted) and track them all."""
        assert op.packed is not None
        req = self._cc.isend(header, dest=op.dest, tag=_T_HEADER)
        if op.wake:
            self._ring(op.dest)
        nbytes = op.packed.nbytes
        reqs = [req, *extra]
        if not extra and MPI.Request.Testall(reqs):
            self._send_done(op, nbytes)  # a small header usually leaves at once (eager)
            return
        self._track(reqs, lambda: self._send_done(op, nbytes))

    # ------------------------------------------------------------------ send side threads

    def _serve(self, i: int, q: queue.SimpleQueue[Any], handle: Callable[[Any], None]) -> None:
        """Thread body: hand each queued message to ``handle`` until the stop sentinel."""
        while (item := q.get()) is not _STOP:
            try:
                handle(item)
            finally:
                with self._working_lock:
                    self._working[i] -= 1

    def _route(self, op: _Send, inline: bool = False) -> None:
        """Choose the path (router thread; or the sending thread itself when ``inline``)."""
        packed = op.packed
        assert packed is not None
        gpu = packed.on_gpu()
        candidates = self._paths.candidates(op.dest, all_gpu=all(gpu), any_gpu=any(gpu))
        for path in candidates:
            region = self._paths.reserve(path, op.dest, packed.region_bytes)
            if region is not None:
                op.path, op.region = path, region
                if inline and path == "shm":
                    self._direct_send(op, inline=True)
                else:  # one copier thread per window: MPI passive-target RMA from several
                    self._enqueue(1, self._direct_q, op)  # threads at once is not safe
                return
        self._fall_back_to_mpi(op, inline, counted=bool(candidates))

    def _fall_back_to_mpi(self, op: _Send, inline: bool, counted: bool = True) -> None:
        """Send ``op`` over MPI: from this thread when ``inline``, else via the requester
        thread. ``counted``: a direct path was possible, so this is a fallback in stats()."""
        if counted:
            with self._stats_lock:
                self._fallbacks += 1
        op.path, op.region = "mpi", -1
        if inline:
            self._mpi_send(op)
        else:
            self._enqueue(2, self._requester_q, op)

    def _direct_send(self, op: _Send, inline: bool = False) -> None:
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
        header = (op.msg_id, op.tag, op.path, op.region, p.skeleton, p.stubs, None)
        self._post_header(op, header, [])

    def _mpi_send(self, op: _Send) -> None:
        p = op.packed
        assert p is not None
        if any(p.on_gpu()):
            if op.cuda_event is not None:
                op.cuda_event.synchronize()
            # Host staging (CommPreprocessing): MPI reads host memory only.
            p.sources = [s.cpu().numpy() if not isinstance(s, np.ndarray) else s for s in p.sources]
        header = (op.msg_id, op.tag, "mpi", -1, p.skeleton, p.stubs, None)
        data_tag = op.msg_id % (self._tag_ub + 1)
        # Header first, then payloads: the receiver posts matching Irecvs on the header.
        reqs = [
            self._dc.Isend([src, MPI.BYTE], dest=op.dest, tag=data_tag)
            for src in p.sources
            if src.size
        ]
        self._post_header(op, header, reqs)

    # ------------------------------------------------------------------ tracker

    def _poll_once(self) -> bool:
        """One round of MPI progress; the caller holds ``_progress_lock``. True if anything
        happened. Run by the tracker thread, and by threads blocked in ``wait`` (so a
        waiter does not pay a thread hand-off per message)."""
        busy = False
        while not self._track_q.empty():
            self._active.append(self._track_q.get())
            busy = True
        while not self._free_q.empty():
            path, source, region = self._free_q.get()
            if self._drained:
                continue  # the peers stopped listening for FREEs (close() is under way)
            req = self._post_free(path, source, region)
            if req is not None:
                self._active.append(_Tracked([req], _nothing))
            busy = True
        if self._active:
            still = []
            for t in self._active:
                if MPI.Request.Testall(t.requests):
                    t.on_done()
                    busy = True
                else:
                    still.append(t)
            self._active = still
        status = self._status
        for _ in range(64):
            msg = self._cc.improbe(ANY_SOURCE, ANY_TAG, status)
            if msg is None:
                break
            self._on_control(status.Get_source(), status.Get_tag(), msg.recv())
            busy = True
        for _ in range(64):
            if not self._take_fast():
                break
            busy = True
        return busy

    def _take_fast(self) -> bool:
        """Receive one fast-path frame if one has arrived (caller holds ``_progress_lock``)."""
        if self._lane is not None:
            got = self._lane.take(self._fc_handle, 1, self.rank)
            if got is None:
                return False
            self._on_taken(*got)
            return True
        msg = self._fc.Improbe(ANY_SOURCE, ANY_TAG, self._fstatus)
        if msg is None:
            return False
        self._on_frame(msg)
        return True

    def _on_frame(self, msg: MPI.Message) -> None:
        """Receive the frame ``msg`` just probed into ``_fstatus`` (caller holds
        ``_progress_lock``). A matched probe: the frame is this thread's alone once probed,
        so the tracker and waiting threads may all probe at once without stealing."""
        st = self._fstatus
        source, tag = st.Get_source(), st.Get_tag()
        buf = bytearray(st.Get_count(MPI.BYTE))
        msg.Recv(buf)
        self._on_taken(source, tag, fastpath.frame_seq(buf), buf, -1)

    def _on_taken(self, source: int, tag: int, seq: int, obj: Any, nbytes: int) -> None:
        """Order a received frame (caller holds ``_progress_lock``): ``obj`` is its object
        and ``nbytes`` its payload, or ``obj`` is the frame itself and ``nbytes`` -1."""
        if seq == self._seq_from[source] and not self._held[source]:
            self._seq_from[source] = seq + 1  # its turn already: the common case, inlined
            self._on_fast(source, seq, tag, obj, nbytes)
        else:
            self._in_order(source, seq, _FAST, (tag, obj, nbytes))

    def _tracker_loop(self) -> None:
        # No busy spinning here: a thread that keeps dropping and retaking the GIL starves
        # the others (CPython hands the GIL over only on request). Threads blocked in
        # wait() spin instead, briefly; the tracker sleeps between rounds, 20 us doubling
        # up to 1 ms while idle, and local work wakes it at once.
        # With doorbells, the first round that finds nothing sleeps until a sender rings
        # (a pipeline rank is idle between messages: fewer wake-ups, each one useful).
        sleep = 0.0
        while not (self._tracker_stop.is_set() and not self._active):
            if self._spinners:
                # A thread blocked in wait() is driving progress: stay out of its way.
                self._wake.wait(1e-3)
                self._wake.clear()
                continue
            with self._progress_lock:
                busy = self._poll_once()
            if busy:
                sleep = 0.0
                continue
            if self._bell is not None and not self._active:  # (requests in flight: poll)
                self._deep = True
                try:
                    self._bell.sleep(self._busy_before_sleep)
                finally:
                    self._deep = False
                self._wake.clear()
                continue
            sleep = min(1e-3, max(2e-5, sleep * 2))
            if self._wake.wait(sleep):
                self._wake.clear()
                sleep = 0.0

    def _busy_before_sleep(self) -> bool:
        """The tracker's last look before sleeping on its doorbell (its flag is set)."""
        if self._wake.is_set() or self._spinners or self._tracker_stop.is_set():
            return True
        with self._progress_lock:
            return self._poll_once() or bool(self._active)

    def _wait(self, handle: Handle, timeout: float | None, spin: float | None = None) -> bool:
        """Block until ``handle`` completes or ``timeout`` passes; True if it completed.

        For up to ``poll_spin`` seconds after the last event the waiting thread drives MPI
        progress itself (no thread hand-off on the critical path of a small message):
        mostly fast-path probes, the cheapest way to see a small message the moment it
        lands, with a full progress round every ``_SPIN_PROBES`` probes. After that it
        sleeps and the tracker thread takes over.
        """
        if handle._done:
            return True
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        spin_s = self.settings.poll_spin if spin is None else min(spin, self.settings.poll_spin)
        spin_until = now + spin_s
        self._spinners.append(None)
        if self._deep:  # this thread polls now: its tracker need not sleep through rings
            self._nudge()
        try:
            while not handle._done:
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    return handle._done
                if now >= spin_until or self._closed:
                    break
                if any(self._working):
                    # Backend threads have work: poll only every 200 us, or this thread
                    # would keep taking the GIL from them.
                    if handle._sleep(2e-4):
                        break
                if not self._progress_lock.acquire(timeout=5e-4):
                    # Another thread is polling (a round takes microseconds; it also
                    # completes our handle if our message is there).
                    continue
                try:
                    if self._spin_fast(handle):
                        if handle._done:
                            break  # (straight back: the common case, latency-critical)
                        spin_until = time.monotonic() + spin_s
                    elif self._poll_once():
                        spin_until = time.monotonic() + spin_s
                except Exception as exc:
                    raise self._fail_all(exc) from exc
                finally:
                    self._progress_lock.release()
        finally:
            self._spinners.pop()
        if handle._done:
            return True
        self._nudge()  # hand progress back to the tracker thread
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return handle._sleep(left)

    def _spin_fast(self, handle: Handle) -> bool:
        """Probe for fast-path frames until one arrives (True) or ``_SPIN_PROBES`` probes
        found none (False); the caller holds ``_progress_lock``."""
        lane = self._lane
        if lane is not None:  # probes in C, _LANE_PROBES at a time with the GIL released
            comm, rank = self._fc_handle, self.rank
            for _ in range(_SPIN_PROBES // _LANE_PROBES):
                got = lane.take(comm, _LANE_PROBES, rank)
                if got is not None:
                    self._on_taken(*got)
                    return True
                if handle._done:
                    return False
            return False
        probe, st = self._fc.Improbe, self._fstatus
        for _ in range(_SPIN_PROBES):
            msg = probe(ANY_SOURCE, ANY_TAG, st)
            if msg is not None:
                self._on_frame(msg)
                return True
            if handle._done:  # completed by another thread (or on a general path)
                return False
        return False

    def _on_control(self, source: int, tag: int, body: Any) -> None:
        if tag == _T_HEADER:
            self._in_order(source, body[0], _T_HEADER, body)
        elif tag == _T_BYE:
            self._in_order(source, body, _T_BYE, None)
        elif tag == _T_FREE:
            path, region = body
            self._paths.release(path, source, region)
        elif tag == _T_DRAINED:
            with self._match_lock:
                self._drained_from.add(source)
        else:  # pragma: no cover - only our own tags travel on this communicator
            raise CommError(
                f"smp-comm rank {self.rank}: unknown control tag {tag} from rank {source}"
            )

    def _in_order(self, source: int, seq: int, kind: int, item: Any) -> None:
        """Handle headers, fast-path frames and the final BYE in the sender's isend order
        (``seq``), whichever communicator and thread brought them; early ones wait."""
        held = self._held[source]
        if seq != self._seq_from[source]:
            held[seq] = (kind, item)
            return
        self._seq_from[source] = seq + 1
        self._dispatch(source, seq, kind, item)
        while held and self._seq_from[source] in held:
            seq = self._seq_from[source]
            kind, item = held.pop(seq)
            self._seq_from[source] = seq + 1
            self._dispatch(source, seq, kind, item)

    def _dispatch(self, source: int, seq: int, kind: int, item: Any) -> None:
        if kind == _FAST:
            self._on_fast(source, seq, *item)
        elif kind == _T_BYE:
            self._on_bye(source)
        else:
            _, utag, path, region, skeleton, stubs, inline = item
            self._on_header(_Incoming(source, utag, seq, path, region, skeleton, stubs, inline))

    def _on_fast(self, source: int, seq: int, tag: int, obj: Any, nbytes: int) -> None:
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
        with self._match_lock:
            for i, h in enumerate(self._posted):
                if (h.peer == ANY_SOURCE or h.peer == source) and (
                    h.tag == ANY_TAG or h.tag == tag
                ):
                    del self._posted[i]
                    break
            else:
                inc = _Incoming(source, tag, seq, "mpi", -1, b"", [], None)
                inc.done, inc.result, inc.error = True, obj, error
                self._unexpected.append(inc)
                h = None
            if error is None:
                counts = self._fast_count
                counts[2] += 1
                counts[3] += nbytes
        if h is not None:  # out of the posted list: no other thread completes it
            if error is None:
                h._complete((obj, source, tag))
            else:
                h._complete(error=error)

    def _on_header(self, inc: _Incoming) -> None:
        with self._match_lock:
            self._inflight_recv += 1
            self._live_incs[id(inc)] = inc
            for i, h in enumerate(self._posted):
                if _accepts(h, inc):
                    del self._posted[i]
                    inc.handle = h
                    break
            else:
                self._unexpected.append(inc)
        if inc.path == "mpi" and inc.inline is None:
            try:
                inc.finals, inc.views = new_buffers(inc.stubs, self.rank)
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
            self._track(reqs, lambda: self._to_postproc(inc))
        elif inc.path == "mpi" or (
            inc.path == "shm" and sum(st.nbytes for st in inc.stubs) <= self.settings.caller_copy_bytes
        ):
            # An inline payload, or a moderate one in shared memory: rebuild it on this
            # (probing) thread; a hand-off to the post-processing thread costs more.
            self._finish(inc)
        else:
            self._to_postproc(inc)

    def _to_postproc(self, inc: _Incoming) -> None:
        self._enqueue(3, self._post_q, inc)

    def _enqueue(self, i: int, q: queue.SimpleQueue[Any], item: Any) -> None:
        # _working[i] counts items queued for or being handled by thread i; a waiter spins
        # only while all are zero.
        with self._working_lock:
            self._working[i] += 1
        q.put(item)

    def _on_bye(self, source: int) -> None:
        """``source`` closed: it will send nothing more, so fail receives that need it."""
        with self._match_lock:
            self._bye_from.add(source)
            keep = []
            for h in self._posted:
                err = self._unreachable(h.peer)
                if err is not None:
                    h._complete(error=err)
                else:
                    keep.append(h)
            self._posted = keep

    # ------------------------------------------------------------------ receive side

    def _finish(self, inc: _Incoming) -> None:
        try:
            if inc.error is None:
                values = self._payload(inc)
                values = [finish_tensor(s, v) for s, v in zip(inc.stubs, values)]
                inc.result = unpack(inc.skeleton, values)
                self._count(inc.path, "received", sum(s.nbytes for s in inc.stubs))
        except Exception as exc:  # noqa: BLE001 - delivered to the waiter
            inc.error = CommError(
                f"smp-comm rank {self.rank}: cannot rebuild message from rank {inc.source} "
                f"(tag {inc.tag}): {exc!r}"
            )
        with self._match_lock:
            inc.done = True
            self._inflight_recv -= 1
            self._live_incs.pop(id(inc), None)
            if inc.handle is not None:
                self._deliver(inc)

    def _payload(self, inc: _Incoming) -> list[Any]:
        if inc.path == "mpi":
            if inc.inline is None:
                return inc.finals
            return from_blobs(inc.stubs, inc.inline, self.rank)
        # The region goes back to its sender (a FREE message) once copied out or, for
        # zero-copy views, once the last view is garbage collected. The callback holds no
        # reference to the message, so it cannot keep those views alive.
        release = _Once(self._send_free, (inc.path, inc.source, inc.region))
        try:
            return self._paths.read(inc.path, inc.region, inc.stubs, release)
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
            self._free_q.put(item)
            self._nudge()
            return
        try:
            if self._drained or self._closed:
                return  # the peers stopped listening for FREEs (close() is under way)
            req = self._post_free(*item)
        finally:
            self._free_lock.release()
        if req is not None:
            self._track([req], _nothing)

    def _post_free(self, path: str, source: int, region: int) -> MPI.Request | None:
        """Post a FREE; the request if it is still in flight (a tiny message usually
        leaves at once, eagerly: then nobody has to poll for it)."""
        req = self._cc.isend((path, region), dest=source, tag=_T_FREE)
        return None if req.Test() else req

    # ------------------------------------------------------------------ close

    def _close_protocol(self, deadline: float) -> None:
        def wait_for(done: Callable[[], bool], describe: Callable[[], str]) -> None:
            while not done():
                if self._fatal is not None:
                    raise CommError(f"smp-comm rank {self.rank}: backend failed: {self._fatal!r}")
                if time.monotonic() > deadline:
                    raise CommError(
                        f"smp-comm rank {self.rank}: close() timed out waiting for {describe()}"
                    )
                time.sleep(1e-3)

        everyone = set(range(self.size))
        try:
            # 1. Our sends finish (the peers' trackers keep serving us meanwhile).
            wait_for(
                lambda: not self._open_sends,
                lambda: f"sends to ranks {sorted({h.peer for h in self._open_sends})} to complete",
            )
            # 2. BYE: nothing more will come from us. MPI keeps per-sender order, so once a
            #    peer's BYE is here all its headers are here too.
            with self._match_lock:
                byes = [(r, self._seq_to[r]) for r in everyone]
                for r in everyone:
                    self._seq_to[r] += 1
            self._track([self._cc.isend(q, dest=r, tag=_T_BYE) for r, q in byes], _nothing)
            for r in everyone:
                self._ring(r)
            wait_for(
                lambda: self._bye_from == everyone,
                lambda: f"ranks {sorted(everyone - self._bye_from)} to call close()",
            )
            # 3. DRAINED: every payload for us has arrived and every FREE has been sent.
            wait_for(lambda: self._inflight_recv == 0, lambda: "incoming payloads")
            # No FREE may follow DRAINED on the wire: FREEs go out under one of these locks.
            with self._progress_lock, self._free_lock:
                self._drained = True
                reqs = [self._cc.isend(None, dest=r, tag=_T_DRAINED) for r in everyone]
            for r in everyone:
                self._ring(r)
            self._track(reqs, _nothing)
            wait_for(
                lambda: self._drained_from == everyone,
                lambda: f"ranks {sorted(everyone - self._drained_from)} to drain",
            )
        except BaseException:
            self._stop_threads()
            raise
        self._stop_threads()
        with self._match_lock:
            for h in self._posted:
                h._complete(
                    error=CommClosedError(f"smp-comm rank {self.rank}: closed while receiving")
                )
            self._posted.clear()
            self._unexpected.clear()
        # Collective frees, same order on every rank.
        self._paths.close()
        self._dc.Free()
        self._fc.Free()
        self._cc.Free()
        if self._bell is not None:
            self._bell.close()

    def _stop_threads(self) -> None:
        for q in (self._router_q, self._direct_q, self._requester_q, self._post_q):
            q.put(_STOP)
        for t in self._threads:
            if t.name != "smp-comm-tracker":
                t.join()
        self._tracker_stop.set()
        self._nudge()
        for t in self._threads:
            t.join()


def _accepts(h: RecvHandle, inc: _Incoming) -> bool:
    return (h.peer == ANY_SOURCE or h.peer == inc.source) and (h.tag == ANY_TAG or h.tag == inc.tag)


def _nothing() -> None:
    return None


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


_LIVE: weakref.WeakSet[Communicator] = weakref.WeakSet()


@atexit.register
def close_live_communicators() -> None:
    """At exit: a Communicator left open is closed before mpi4py finalizes MPI."""
    for comm in list(_LIVE):
        try:
            comm.close(timeout=10.0)
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
