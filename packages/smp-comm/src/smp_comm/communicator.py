"""The :class:`Communicator`: on-demand tensor messages over MPI and direct paths.

``isend`` pickles the object's skeleton in the calling thread (tensors become stubs; a
pickling error raises there) and numbers the message for its destination. A payload of at
most ``inline_bytes`` rides inside the header, posted from that thread; a CPU payload of
at most ``caller_copy_bytes`` is routed and copied from that thread too. Everything else
goes through threads (paper, Appendix G), each consuming one queue of messages and each
belonging to one object:

=================  ===========================================  =========================
object (module)    threads                                      its lock guards
=================  ===========================================  =========================
``Sender``         router, direct, requester                    (none: queues only)
``Progress``       tracker (and any thread blocked in ``wait``)  one polling round at a time
``Receiver``       postproc                                     FREEs vs. DRAINED
``MatchingTable``  -                                            receives, messages, numbering
``CloseProtocol``  -                                            ``close()`` runs once
``PathStats``      -                                            ``stats()`` counters
``Backlog``        -                                            queued-work counts
=================  ===========================================  =========================

Each module imports only the ones below it: communicator → closing → sender, receiver →
progress → matching → wire, handles, state, settings.

A lone CPU tensor or array of at most ``small_message_bytes`` skips all of the above: it
travels as one self-describing frame (:mod:`smp_comm.fastpath`), ``Isend``-ed on a
communicator of its own from the calling thread, and is taken by whichever thread probes
it first (matched probes make that safe), usually the one waiting for it.

Messages from one sender are matched in the order its ``isend`` calls were made: headers
carry a per-destination sequence number and the receiver processes them in that order,
whichever thread and path carried each.
"""

from __future__ import annotations

import atexit
import os
import warnings
import weakref
from dataclasses import fields, replace
from typing import Any

from mpi4py import MPI

from smp_comm import compiled as _compiled
from smp_comm import fastpath
from smp_comm.closing import CloseProtocol
from smp_comm.doorbell import Doorbells, doorbells_available
from smp_comm.errors import CommClosedError, CommError
from smp_comm.handles import RecvHandle, SendHandle
from smp_comm.matching import MatchingTable
from smp_comm.paths import DirectPaths
from smp_comm.processes import ProcessInfo, know_peers
from smp_comm.progress import Progress
from smp_comm.receiver import Receiver
from smp_comm.sender import Outgoing, Sender
from smp_comm.serialize import pack, torch
from smp_comm.settings import CommSettings, auto_poll_spin
from smp_comm.state import Backlog, Lifecycle, PathStats
from smp_comm.wire import ANY_SOURCE, ANY_TAG

__all__ = ["ANY_SOURCE", "ANY_TAG", "Communicator", "close_live_communicators"]

_SETTING_NAMES = frozenset(f.name for f in fields(CommSettings))


class Communicator:
    """Tensor message backend over an MPI communicator (any intra-communicator).

    Construction and :meth:`close` are collective over ``mpi_comm``; ``isend``/``irecv`` are
    not, and may be called from any number of threads. See the module docstring for the
    threads and the matching rules.

    Args:
        mpi_comm: the communicator to duplicate (default ``MPI.COMM_WORLD``).
        settings: resolved settings to start from; default: :meth:`CommSettings.resolve`
            (environment variables, then defaults).
        **overrides: any :class:`~smp_comm.CommSettings` field (``buffer_bytes="64M"``,
            ``disable="shm"``, ...), parsed as ``CommSettings.resolve`` parses it; an
            unknown name raises ``TypeError`` naming it.
    """

    def __init__(
        self,
        mpi_comm: MPI.Comm | None = None,
        settings: CommSettings | None = None,
        **overrides: Any,
    ) -> None:
        unknown = sorted(set(overrides) - _SETTING_NAMES)
        if unknown:
            raise TypeError(
                f"Communicator() got unknown setting(s) {', '.join(map(repr, unknown))}; "
                f"the settings are {sorted(_SETTING_NAMES)}"
            )
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
        resolved = CommSettings.resolve(self.rank, **overrides)
        if settings is not None:  # the given settings, with the fields overridden here
            given = {k: getattr(resolved, k) for k, v in overrides.items() if v is not None}
            resolved = replace(settings, **given)
        self.settings = resolved
        # Collective set-up, in the same order on every rank: private communicators for
        # control messages, for MPI-path payloads and for fast-path frames (always created
        # and probed, so ranks with different small_message_bytes still talk), then the
        # persistent direct buffers.
        cc: MPI.Intracomm = base.Dup()  # type: ignore[assignment]
        dc: MPI.Intracomm = base.Dup()  # type: ignore[assignment]
        self._fc: MPI.Intracomm = base.Dup()  # type: ignore[assignment]
        self._fast_limit = self.settings.small_message_bytes
        # The compiled fast path (smp_comm.compiled), or None: the Python one. Either end
        # may use either: both send the same frames.
        self._lane = _compiled.load() if self._fast_limit and self.settings.compiled else None
        self._fc_handle: int = self._fc.handle
        self._tag_ub: int = int(cc.Get_attr(MPI.TAG_UB))  # type: ignore[arg-type]
        self._paths = DirectPaths(cc, self.settings)
        # Ranks on this node: with MPICH a fast-path frame to one completes without this
        # rank's progress (the receiver finishes the shared-memory transfer; measured, see
        # docs/packages/smp-comm.md, "Frames past MPI's eager size"), so its send is tracked lazily
        # (smp_comm.progress.Tracked). Other MPI libraries keep eager tracking.
        node = self._paths.node_of[self.rank]
        mpich = "MPICH" in MPI.Get_library_version()
        self._local = [mpich and n == node for n in self._paths.node_of]
        if self.settings.poll_spin is None:  # "auto": by how many ranks share this node
            here = self._paths.node_of.count(node)
            spin = auto_poll_spin(here, os.cpu_count())
            self.settings = replace(self.settings, poll_spin=spin)
        # Every rank's process: the exit protocol after a failed step watches their ends
        # (smp_comm.shutdown).
        know_peers(cc.allgather(ProcessInfo.here()), self.rank)
        self._bell = self._open_doorbells(cc)

        self._life = Lifecycle()
        self._stats = PathStats()
        backlog = Backlog()
        table = self._table = MatchingTable(self.rank, self.size, self._life)
        self._progress = Progress(
            self.rank, self.size, cc, self._fc, self._lane, float(self.settings.poll_spin or 0),
            table, self._paths, backlog, self._life, self._bell,
        )  # fmt: skip
        self._sender = Sender(
            cc, dc, self._tag_ub, self._paths, table, self._progress, backlog, self._stats
        )
        receiver = Receiver(
            self.rank, cc, dc, self._tag_ub, self.settings, self._paths, table,
            self._progress, backlog, self._stats, self._life,
        )  # fmt: skip
        self._sender.receiving_streams = receiver.receiving_streams
        self._closer = CloseProtocol(
            self.rank, self.size, (cc, dc, self._fc), self._life, table, self._progress,
            self._sender, receiver, self._paths, self._bell,
        )  # fmt: skip
        # Hot-path aliases: the same objects as the table's and the progress engine's, so
        # that a small-message send looks nothing up twice.
        self._match_lock = table.lock
        self._seq_to = table.seq_to
        self._bye_from = table.bye_from
        self._open_sends = table.open_sends
        self._fast_count = table.fast
        self._wait = self._progress.wait
        self._ring = self._progress.ring
        self._sender.start()
        self._progress.start()
        receiver.start()
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
            if self._life.closing:  # checked under the lock close() takes to number its BYEs
                raise CommClosedError(f"smp-comm rank {self.rank}: the Communicator is closed")
            if dest in self._bye_from:
                handle._complete(error=self._table.peer_closed(dest, f"send (tag {tag})"))
                return handle
            self._open_sends.add(handle)
            # Per-destination sequence number: the receiver matches headers in this order
            # whichever thread posts them (MPI's non-overtaking rule).
            seq = self._seq_to[dest]
            self._seq_to[dest] = seq + 1
        op = Outgoing(handle, dest, tag, seq, packed=packed, wake=wake)
        gpu = packed.on_gpu()
        if not any(gpu) and packed.nbytes <= self.settings.inline_bytes:
            # A small payload rides inside the header, posted from this thread.
            inline = [bytes(s) for s in packed.sources]
            header = (seq, tag, "mpi", -1, packed.skeleton, packed.stubs, inline)
            self._sender.post_header(op, header, [])
            return handle
        if not any(gpu) and packed.nbytes <= self.settings.caller_copy_bytes:
            # Moderate CPU payload: route, and copy into shared memory, here; two thread
            # hand-offs (router, copier) cost more than the copy (docs/perf-notes.md).
            self._sender.route(op, inline=True)
            return handle
        if any(gpu):
            # The payload may still be being computed on the caller's stream: record an
            # event there so the copying threads wait for it (and not for later work).
            op.cuda_event = torch.cuda.Event()
            op.cuda_event.record()
        self._sender.submit(op)
        return handle

    def _fast_send(self, item: Any, dest: int, tag: int, wake: bool) -> SendHandle | None:
        """Send a fast-path frame from the calling thread (see :mod:`smp_comm.fastpath`).

        ``item``: the object itself when the compiled fast path is in use (it encodes and
        posts in one call under the lock, and ``None`` is returned, nothing sent, if the
        object does not qualify), else :func:`fastpath.encode`'s parts. Ordered for
        latency: the frame leaves first, the handle is made afterwards.
        """
        life = self._life
        if life.closing or life.fatal is not None:
            self._check_open()
        if type(dest) is not int or not 0 <= dest < self.size:
            self._check_rank(dest, "dest")
        lane = self._lane
        with self._match_lock:
            if life.closing:  # checked under the lock close() takes to number its BYEs
                raise CommClosedError(f"smp-comm rank {self.rank}: the Communicator is closed")
            if dest in self._bye_from:
                handle = SendHandle(dest, tag, self.rank, self._wait)
                handle._complete(error=self._table.peer_closed(dest, f"send (tag {tag})"))
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
            counts.sent += 1
            if type(sent) is int:
                counts.sent_bytes += sent
                handle._done = True  # nobody else holds the handle yet
            else:
                pending, frame, nbytes = sent
                counts.sent_bytes += nbytes
                self._open_sends.add(handle)
        if wake:
            self._ring(dest)
        if type(sent) is not int:
            req = pending if lane is None else MPI.Request.fromhandle(pending)
            tracked = self._progress.track(
                [req], lambda: self._fast_sent(handle, frame), lazy=self._local[dest]
            )
            if tracked.lazy:  # (an eager one needs nothing when waited for)
                handle._want = lambda: self._progress.want(tracked)
        return handle

    def _fast_sent(self, handle: SendHandle, buf: bytes) -> None:
        del buf  # kept alive by the callback until MPI is done with it
        self._table.send_done(handle)

    def irecv(self, source: int = ANY_SOURCE, tag: int = ANY_TAG, *, out: Any = None) -> RecvHandle:
        """Post a receive; ``wait()`` returns ``(obj, source, tag)``.

        ``source``/``tag`` may be :data:`ANY_SOURCE`/:data:`ANY_TAG`. When several posted
        receives accept a message, the one posted first gets it (MPI's rule).

        ``out``: a contiguous CPU tensor the message (one tensor of its shape and dtype) is
        received into, instead of a new one; ``obj`` is then ``out``. Posted before the
        message comes, the bytes land in it directly (no allocation, no second copy). A
        message that does not fit it completes the receive with an error naming both.
        """
        self._check_open()
        if source != ANY_SOURCE:
            self._check_rank(source, "source")
        if not isinstance(tag, int) or (tag < 0 and tag != ANY_TAG):
            raise ValueError(f"smp-comm irecv: tag must be an int >= 0 or ANY_TAG, got {tag!r}")
        if out is not None:
            _check_out(out, self.rank)
        handle = RecvHandle(source, tag, self.rank, self._wait, self._table.cancel, out)
        self._table.post(handle)
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
        with self._match_lock:
            fast = replace(self._fast_count)
        return self._stats.report(fast)

    def path_to(self, dest: int, device: str = "cpu") -> str:
        """The path a large payload on ``device`` would take to ``dest`` with room to spare."""
        self._check_rank(dest, "dest")
        on_gpu = device.startswith("cuda")
        for p in self._paths.candidates(dest, all_gpu=on_gpu, any_gpu=on_gpu):
            return p
        return "mpi"

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._life.closed

    def close(self, timeout: float | None = None) -> None:
        """Collective: finish this rank's sends, tell every peer, serve their last messages,
        join every thread and free windows and communicators. Idempotent.

        A receive still posted fails with :class:`CommClosedError`. Raises
        :class:`CommError` (naming the ranks) if peers do not close within ``timeout``
        (default ``settings.close_timeout``); then windows are left to process exit.
        """
        limit = self.settings.close_timeout if timeout is None else timeout
        try:
            self._closer.close(limit)
        finally:
            if self._life.closed:
                _LIVE.discard(self)

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers

    def _check_open(self) -> None:
        if self._life.closing:
            raise CommClosedError(f"smp-comm rank {self.rank}: the Communicator is closed")
        if self._life.fatal is not None:
            raise CommError(f"smp-comm rank {self.rank}: backend failed: {self._life.fatal!r}")

    def _check_rank(self, r: int, what: str) -> None:
        if not isinstance(r, int) or not 0 <= r < self.size:
            raise ValueError(
                f"smp-comm rank {self.rank}: {what}={r!r} is not a rank of a communicator of size {self.size}"
            )

    def _open_doorbells(self, cc: MPI.Intracomm) -> Doorbells | None:
        """Doorbells when the setting allows and every rank shares this host (collective)."""
        want = self.settings.doorbell and doorbells_available()
        one_host = len(set(self._paths.node_of)) == 1
        if not cc.allreduce(bool(want and one_host), op=MPI.LAND):
            return None
        try:
            return Doorbells(cc)
        except OSError as exc:  # raised on every rank alike: all poll instead
            warnings.warn(
                f"smp-comm rank {self.rank}: {exc}; polling", RuntimeWarning, stacklevel=3
            )
            return None


_LIVE: weakref.WeakSet[Communicator] = weakref.WeakSet()


@atexit.register
def close_live_communicators() -> None:
    """At exit: a Communicator left open is closed before mpi4py finalizes MPI."""
    for comm in list(_LIVE):
        try:
            comm.close(timeout=10.0)
        except Exception:  # noqa: BLE001 - exiting anyway
            pass


def _check_out(out: Any, rank: int) -> None:
    """Refuse an ``irecv(out=...)`` target the bytes cannot land in as they come."""
    if not all(hasattr(out, a) for a in ("is_contiguous", "device", "copy_")):
        raise TypeError(f"smp-comm rank {rank}: irecv(out=...) takes a torch tensor, got {type(out).__name__}")
    if out.device.type != "cpu":
        raise ValueError(f"smp-comm rank {rank}: irecv(out=...) takes a CPU tensor, got one on {out.device}")
    if not out.is_contiguous():
        raise ValueError(f"smp-comm rank {rank}: irecv(out=...) takes a contiguous tensor")
