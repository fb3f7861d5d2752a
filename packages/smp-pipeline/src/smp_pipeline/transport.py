"""The messages of one pipeline rank: receiving, serve order, sending, aborts and timeouts.

The main thread receives directly from the communicator (no receiver thread; see
docs/perf-notes.md): one receive is always posted, and its arrival releases the main loop's
wake-up baton (and calls ``on_arrival``, for preemption). Arrived messages wait in the
inbox, served by kind and then microbatch (:func:`smp_pipeline.protocol.priority`).

Failures never hang: :meth:`Transport.abort` sends an :class:`~smp_pipeline.protocol.Abort`
to every pipeline rank (and ``abort_ranks``), and every rank raises; a request outstanding
longer than ``timeout_s``, or a rank that makes no progress for that long, aborts with a
message naming what it waits for and, through :attr:`Transport.explain_stall`, the chain of
waits behind it on every rank (:mod:`smp_pipeline.diagnosis`). Stall queries and reports are
taken here, by whichever wait of the main thread receives them, never by the inbox.
:meth:`Transport.interrupt` (any thread) makes this rank alone raise at its next wait, for
failures learnt outside the pipeline.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, cast

from smp_comm import ANY_SOURCE, CommTimeoutError
from smp_comm.shutdown import note_failed_step

from smp_pipeline.actions import ActionKind, ProgramRecorder
from smp_pipeline.errors import (
    PipelineError,
    PipelineInterruptedError,
    PipelineRemoteError,
    PipelineTimeoutError,
)
from smp_pipeline.frames import DEFAULT_LIMIT, decode, encode, wire_code
from smp_pipeline.protocol import (
    Abort,
    BwdReq,
    BwdResp,
    FwdReq,
    FwdResp,
    Message,
    StallQuery,
    StallReport,
    priority,
)
from smp_pipeline.seqruns import span_label
from smp_pipeline.stall import request_text

# Seconds between abort checks while waiting for sends to leave (:meth:`Transport.flush`).
_FLUSH_SLICE_S = 0.1
# Idle main loop: drive the communicator for at most this long before sleeping on the
# receive (see docs/perf-notes.md, "Idle wait").
_SPIN_S = 2e-4


class Transport:
    """Sends and receives one rank's pipeline messages over an smp-comm communicator.

    Args:
        comm: anything with smp-comm's ``isend``/``irecv`` API.
        pp_rank: this rank's pipeline index; ``comm_ranks[r]`` is pp rank r's communicator rank.
        tag: the message tag.
        timeout_s: the longest a request may stay unanswered, and the longest a rank may go
            without progress.
        abort_ranks: further communicator ranks told about an abort (e.g. the other
            pipelines' ranks, whose tensor-parallel peers would otherwise wait forever).
        wake: called when a message arrives (on the communicator's thread): releases the
            main loop's wake-up baton.
        on_arrival: called with each completed receive handle, on the communicator's
            thread (the server's preemption; it reads the message with
            :meth:`arrived_message`); None: nothing more than ``wake``.
        recorder: notes every tensor-carrying message sent, and every one taken off the
            wire (in arrival order: per peer, the order it was sent in), in this rank's
            program (see :mod:`smp_pipeline.actions`); None: a disabled one.
    """

    def __init__(
        self,
        comm: Any,
        pp_rank: int,
        comm_ranks: Sequence[int],
        tag: int,
        timeout_s: float,
        abort_ranks: Sequence[int],
        wake: Callable[[], None],
        on_arrival: Callable[[Any], None] | None = None,
        recorder: ProgramRecorder | None = None,
    ) -> None:
        self.comm = comm
        self.recorder = recorder if recorder is not None else ProgramRecorder(enabled=False)
        self.pp_rank = pp_rank
        self.pp_size = len(comm_ranks)
        self.comm_ranks = list(comm_ranks)
        self.comm_rank = self.comm_ranks[pp_rank]
        self.tag = tag
        self.timeout_s = timeout_s
        self.abort_ranks = list(abort_ranks)
        self._wake = wake
        # Messages whose tensors fit go as one frame on smp-comm's small-message fast path
        # (see smp_pipeline.frames); its size limit is the communicator's, if it says.
        settings = getattr(comm, "settings", None)
        self.frame_limit: int = getattr(settings, "small_message_bytes", DEFAULT_LIMIT)
        self.spin_s = _SPIN_S
        self.on_arrival = on_arrival
        self.inbox: collections.deque[Message] = collections.deque()
        self._recv: Any = None  # the posted receive for the next message
        self._sends: list[Any] = []
        self.abort_msg: Abort | None = None
        # Requests this rank sent and still waits for: key -> (time sent, pp rank, module
        # path, microbatch); worded only when one times out.
        self.outstanding: dict[Any, tuple[float, int, str, int]] = {}
        # Stall diagnosis (set by the server, see smp_pipeline.diagnosis): takes a stall query
        # or report as it arrives; words a timeout with the chain of waits behind it.
        self.on_stall_message: Callable[[Message], None] | None = None
        self.explain_stall: Callable[[str, Any], tuple[str, int | None]] | None = None

    # ------------------------------------------------------------------ receiving
    def _arrived(self, handle: Any) -> None:
        self._wake()
        if self.on_arrival is not None:
            self.on_arrival(handle)

    @staticmethod
    def arrived_code(handle: Any) -> int | None:
        """The wire code (:func:`~smp_pipeline.protocol.to_wire`) of a completed receive's
        message, without taking it (None if it failed: the main loop reports that when it
        takes it)."""
        try:
            return wire_code(handle.wait(0)[0])  # done: returns at once
        except Exception:  # noqa: BLE001
            return None

    def _posted_receive(self) -> Any:
        """The receive for the next message, posted if need be; its arrival wakes the loop."""
        if self._recv is None:
            self._recv = self.comm.irecv(source=ANY_SOURCE, tag=self.tag)
            self._recv.add_done_callback(self._arrived)
        return self._recv

    def _take(
        self, handle: Any, timeout: float | None = None, spin: float | None = None
    ) -> Message | None:
        """The message of a completed (or, with ``timeout``, awaited) receive; None for a
        stall query or report, taken here (:attr:`on_stall_message`)."""
        try:
            if timeout is None:
                obj, _, _ = handle.wait()
            else:
                obj, _, _ = handle.wait(timeout=timeout, spin=spin)
        except CommTimeoutError:
            raise
        except Exception as exc:  # the communicator broke: fail every rank we can reach
            self._recv = None
            self.abort("error", f"pp rank {self.pp_rank}: receiving failed: {exc!r}")
            raise
        self._recv = None
        msg = decode(obj)
        kind = type(msg)
        if self.recorder.enabled:
            self._note(ActionKind.RECV, msg.src, msg)
        if kind is Abort:
            if self.abort_msg is None:
                self.abort_msg = cast(Abort, msg)
        elif kind is StallQuery or kind is StallReport:
            # Answered by this (main) thread wherever it waits, even while a worker is stuck.
            if self.on_stall_message is not None:
                self.on_stall_message(msg)
            return None
        return msg

    def next_message(self, timeout: float, spin: float | None = None) -> Message | None:
        """The next message (waiting up to ``timeout`` seconds), or None."""
        if self.inbox:
            return self.inbox.popleft()
        handle = self._posted_receive()
        try:
            if timeout <= 0:
                if not handle.test():
                    return None
                obj = self._take(handle)
            else:
                obj = self._take(handle, timeout, spin)
        except CommTimeoutError:
            return None
        # The next receive goes up at once: the task this message starts can then be
        # preempted by what arrives while it runs (the receive's callback flags it).
        self._posted_receive()
        return obj  # (None for a stall query or report: taken already)

    def wait_message(self) -> Message | None:
        """Idle, no device work under way: one blocking receive of up to 50 ms. This thread
        drives the communicator's progress for a short spin (none where the node's ranks
        outnumber its cores: smp-comm's ``poll_spin``), then sleeps until the arrival wakes
        it (see docs/perf-notes.md, "Idle wait")."""
        return self.next_message(0.05, spin=self.spin_s)

    def poll(self) -> None:
        """Move every arrived message into the inbox, noting an abort."""
        while True:
            handle = self._posted_receive()
            if not handle.test():
                return
            msg = self._take(handle)
            if msg is not None:
                self.inbox.append(msg)

    def pick(self, only: tuple[type, ...] | None = None) -> Message | None:
        """The arrived message to serve first (see :func:`~smp_pipeline.protocol.priority`),
        or None. With ``only``: among messages of those types and control messages only."""
        self.poll()
        if not self.inbox:
            return None
        candidates: Sequence[int] = range(len(self.inbox))
        if only is not None:
            candidates = [
                i for i, m in enumerate(self.inbox) if isinstance(m, only) or m.PRIORITY == 0
            ]
            if not candidates:
                return None
        best = min(candidates, key=lambda i: priority(self.inbox[i]))
        msg = self.inbox[best]
        del self.inbox[best]
        return msg

    # ------------------------------------------------------------------ sending
    def send(self, pp_dest: int, msg: Message, wake: bool = True) -> None:
        """Send ``msg`` to pipeline rank ``pp_dest``. ``wake=False`` for a note nobody waits
        on (see smp-comm's ``isend``): it does not interrupt the receiver's compute."""
        self._post(pp_dest, msg, encode(msg, self.frame_limit), wake)

    def _post(self, pp_dest: int, msg: Message, wire: Any, wake: bool) -> None:
        """Hand ``msg``, encoded as ``wire``, to the communicator for ``pp_dest``."""
        dest = self.comm_ranks[pp_dest]
        if self.recorder.enabled:
            self._note(ActionKind.SEND, pp_dest, msg)
        if wake:  # (the keyword only when needed: any communicator with isend() works)
            handle = self.comm.isend(wire, dest=dest, tag=self.tag)
        else:
            handle = self.comm.isend(wire, dest=dest, tag=self.tag, wake=False)
        self._sends.append(handle)
        if len(self._sends) > 512:  # long steps: forget completed sends as we go
            self._sends = [h for h in self._sends if not h.test()]

    def _note(self, kind: ActionKind, peer: int, msg: Message) -> None:
        """Record a sent or received message in the program, if it carries tensors (one
        branch per kind: this runs for every message)."""
        tp = type(msg)
        if tp is FwdReq:
            req = cast(FwdReq, msg)
            # A request names its module as the task serving it will (a run: first..last).
            module = span_label(req.path, req.modules()) if req.span or req.chain else req.path
            self.recorder.message(req.step, kind, peer, "fq", req.mb, module, req.inputs.tensors)
        elif tp is FwdResp:
            resp = cast(FwdResp, msg)
            self.recorder.message(resp.step, kind, peer, "fr", resp.mb, "", resp.outputs.tensors)
        elif tp is BwdReq:
            breq = cast(BwdReq, msg)
            self.recorder.message(breq.step, kind, peer, "bq", breq.mb, breq.path, breq.grads.tensors)
        elif tp is BwdResp:
            bresp = cast(BwdResp, msg)
            self.recorder.message(bresp.step, kind, peer, "br", bresp.mb, "", bresp.grads.tensors)

    def send_note(self, pp_dest: int, msg: Message) -> Any:
        """Send ``msg`` to pipeline rank ``pp_dest`` from any thread, outside :meth:`flush`'s
        bookkeeping (a stall query or report: best effort); returns the send's handle."""
        wire = encode(msg, self.frame_limit)
        return self.comm.isend(wire, dest=self.comm_ranks[pp_dest], tag=self.tag)

    def send_all(self, msg: Message, wake: bool = True) -> None:
        """Send ``msg`` to every other pipeline rank, encoded once (a frame is only read by
        the sends; the driver sends one ``MbDone`` per microbatch to every rank)."""
        wire = encode(msg, self.frame_limit)
        for r in range(self.pp_size):
            if r != self.pp_rank:
                self._post(r, msg, wire, wake)

    def flush(self) -> None:
        """Wait until every message sent so far has left (raising meanwhile if the step is
        aborted or interrupted: a send to a rank that died never completes)."""
        handles, self._sends = self._sends, []
        deadline = time.monotonic() + self.timeout_s
        for h in handles:
            while True:
                try:
                    h.wait(timeout=_FLUSH_SLICE_S)
                    break
                except CommTimeoutError:
                    self.raise_if_aborted()
                    if time.monotonic() > deadline:
                        raise

    # ------------------------------------------------------------------ requests and timeouts
    def expect(self, key: Any, dest: int, path: str, mb: int) -> None:
        """A request was sent to pp rank ``dest`` for module ``path`` (microbatch ``mb``)
        whose answer arrives under ``key``."""
        self.outstanding[key] = (time.monotonic(), dest, path, mb)

    def answered(self, key: Any) -> None:
        self.outstanding.pop(key, None)

    def check_timeouts(self, last_progress: float, step: int) -> None:
        """Abort if a request waited longer than ``timeout_s``, or nothing progressed."""
        now = time.monotonic()
        for key, (t0, dest, path, mb) in self.outstanding.items():
            if now - t0 > self.timeout_s:
                what = request_text(key, dest, path, mb)
                self.stalled(
                    f"pp rank {self.pp_rank} waited more than {self.timeout_s:g}s for {what}", key
                )
        if now - last_progress > self.timeout_s:
            waits = ", ".join(request_text(k, *r[1:]) for k, r in self.outstanding.items())
            self.stalled(
                f"pp rank {self.pp_rank} made no progress for {self.timeout_s:g}s in step "
                f"{step}; it waits for {waits or 'a request from another rank'}",
                None,
            )

    def stalled(self, reason: str, key: Any) -> NoReturn:
        """Abort with a timeout: ``reason``, and the chain of waits behind the request
        ``key`` (None: no request of this rank timed out) when :attr:`explain_stall` can
        tell it."""
        culprit = None
        if self.explain_stall is not None and self.abort_msg is None:
            reason, culprit = self.explain_stall(reason, key)
        self.abort("timeout", reason, None if culprit is None else self.comm_ranks[culprit])
        raise AssertionError("abort() always raises")  # pragma: no cover

    # ------------------------------------------------------------------ aborts
    def abort_message(self, error: str, text: str, culprit: int | None = None) -> Abort:
        return Abort(self.pp_rank, self.comm_rank, error, text, culprit)

    def raise_if_aborted(self) -> None:
        """Raise the error an abort message (received, sent from here, or an interrupt)
        reports; its ``origin`` is the reporting communicator rank."""
        msg = self.abort_msg
        if msg is None:
            return
        note_failed_step()  # exit waits for collectives this step left (smp_comm.shutdown)
        if msg.error == "interrupt":
            raise PipelineInterruptedError(msg.text)
        text = msg.text
        if msg.comm_rank != self.comm_rank:
            # On the first line: a one-line summary of the error (smp-torch's) keeps it.
            first, nl, rest = text.partition("\n")
            text = (
                f"{first} [reported by pp rank {msg.src} (communicator rank "
                f"{msg.comm_rank}), raised on pp rank {self.pp_rank}]{nl}{rest}"
            )
        error: PipelineError = (
            PipelineTimeoutError(text) if msg.error == "timeout" else PipelineRemoteError(text)
        )
        # The rank the failure is attributed to: a stall's culprit, else the reporter.
        error.origin = msg.comm_rank if msg.culprit is None else msg.culprit
        raise error

    def interrupt(self, reason: str) -> None:
        """From any thread: make this rank raise :class:`PipelineInterruptedError` with
        ``reason`` at its next wait (the main loop, a task switch, a flush), unless an abort
        came first. Nothing is sent: the other ranks learn of the reason on their own."""
        if self.abort_msg is None:
            # One reference assignment (atomic); the loop reads it at every turn.
            self.abort_msg = Abort(self.pp_rank, self.comm_rank, "interrupt", reason)
        self._wake()

    def poll_abort(self) -> None:
        """Take arrived messages; raise if one of them is an abort."""
        self.poll()
        if self.abort_msg is not None:
            self.raise_if_aborted()

    def abort(self, error: str, text: str, culprit: int | None = None) -> None:
        """Tell every pipeline rank (and ``abort_ranks``) to raise, then raise here.
        ``culprit``: the communicator rank the failure is attributed to (a stall's), if not
        this one."""
        if self.abort_msg is None:
            msg = self.abort_message(error, text, culprit)
            self.abort_msg = msg
            targets = [self.comm_ranks[r] for r in range(self.pp_size) if r != self.pp_rank]
            targets += [r for r in self.abort_ranks if r not in targets and r != self.comm_rank]
            handles = []
            wire = encode(msg, self.frame_limit)
            for dest in targets:
                try:
                    handles.append(self.comm.isend(wire, dest=dest, tag=self.tag))
                except Exception:  # noqa: BLE001 - best effort: the transport may be broken
                    pass
            for h in handles:  # make sure the news leaves before this rank raises (and exits)
                try:
                    h.wait(timeout=5.0)
                except Exception:  # noqa: BLE001
                    pass
        self.raise_if_aborted()

    def fail(self, exc: BaseException, during: str, tb: str) -> NoReturn:
        """A task failed with ``exc`` (``during``: what it ran, ``tb``: its traceback): abort
        every rank, raising here with ``exc`` as the cause. An error a remote abort caused
        (the task was resumed to raise it) re-raises that abort instead."""
        if isinstance(exc, PipelineError) and self.abort_msg is not None:
            self.raise_if_aborted()
        text = f"pp rank {self.pp_rank}: {type(exc).__name__}: {exc} during {during}\n{tb}"
        try:
            self.abort("error", text)
        except PipelineRemoteError as err:
            raise err from exc
        raise AssertionError("abort() always raises")  # pragma: no cover

    def close(self) -> None:
        """Cancel the posted receive (idempotent)."""
        if self._recv is not None:
            try:
                self._recv.cancel()
            except Exception:  # noqa: BLE001 - closing anyway
                pass
            self._recv = None
