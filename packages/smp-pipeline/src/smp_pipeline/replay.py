"""Static mode's replay on a serving rank: later steps follow the recorded one on one thread.

A serving (non-driver) rank in ``static_mode`` records, during a step run in dynamic mode,
the *signature* of every request it was sent: per sender and microbatch, the n-th forward
or backward request's module (path, ``fast_mode`` span, relay and chain), grad and autocast
modes, checkpointing, the structure of its arguments with every non-tensor value, and each
tensor's shape, dtype, device and ``requires_grad`` flag. Keyed by (sender, microbatch, kind,
n), the signature does not depend on how the microbatches of a step interleave.

The next step is *replayed*: one loop on the rank's main thread takes each arrived message
and, if its signature is the recorded one and every module it runs lives here, runs it at
once on that thread (forward, or backward through the call's saved graph) and sends the
answer: no worker thread, no token hand-off, no serve-order decision beyond taking
backward work before new forward work. A forward run this way still yields to backward
work: at each of its yield points (before each block of an owned sequential container) the
backward requests of the step that arrived meanwhile are checked and served nested on the
same thread, as dynamic mode's main loop serves them while the forward's worker waits at
that point. The same code runs as in dynamic mode, and the order of independent
microbatches' work does not change results, so they are bit for bit the same (gradients
still fold in microbatch order).

Anything else — a request whose signature differs from the recording (another module,
another shape or dtype, another branch of a data-dependent model), one that would call a
module of another rank, a response (this rank waiting on another), a worker left waiting —
a request whose kind ran device work the last time (on a worker it overlaps the device
work with other requests' CPU work; inline it would run synchronously) —
is met *before* it is served: the message goes back to the front of the inbox, the step
goes on in dynamic mode from there (what was replayed is exactly what dynamic mode would
have done, so nothing is lost or done twice), the fallback is counted with its reason
(:class:`ReplayStats`, and a zero-length ``replay fallback`` span in the timeline) and that
step becomes the new recording. A rank whose last step could not be recorded whole (a
request ran modules of other ranks, or device work ran) runs dynamically, records again,
and counts nothing.

The driver (pp rank 0) runs the step function, whose microbatches overlap by the schedule:
it stays in dynamic mode (its step tasks are worker threads).

Under tensor-parallel ordering (:mod:`smp_pipeline.order`) only a stage's leader has a
replay: each request it serves inline is announced as an ``"inline"`` task, and its followers
(which have none) run that request inline too, so every peer takes the same grants in the
same order and their collectives meet. Preemption is off there, so nothing is nested.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from smp_pipeline.actions import BACKWARD, FORWARD
from smp_pipeline.execution_state import autocast_state
from smp_pipeline.messages import Packed
from smp_pipeline.protocol import Abort, BwdReq, FwdReq, MbDone, Message, StepEnd
from smp_pipeline.seqruns import span_label
from smp_pipeline.serving import ServingLoop
from smp_pipeline.worker import Task, set_inline_task

__all__ = ["ReplayStats", "StepReplay", "request_signature"]

# (sender pp rank, microbatch, "fq" / "bq", n-th of those): the signature of that request.
SignatureKey = tuple[int, int, str, int]

# What a replayed forward serves nested at its yield points (control messages come too).
_NESTED: tuple[type, ...] = (BwdReq,)


def _tensor_signature(packed: Packed) -> tuple[Any, ...]:
    return (
        packed.skeleton,
        tuple((t.shape, t.dtype, t.device) for t in packed.tensors),
        tuple(packed.flags),
    )


def request_signature(msg: FwdReq | BwdReq) -> tuple[Any, ...]:
    """What a replayed request must repeat of the recorded one (everything but the step, the
    call's key and the sender's request number)."""
    if type(msg) is FwdReq:
        return (
            "fq", msg.path, msg.grad, tuple(map(tuple, msg.autocast)), msg.checkpoint,
            msg.span, msg.then, msg.chain, _tensor_signature(msg.inputs),
        )  # fmt: skip
    assert type(msg) is BwdReq
    return ("bq", msg.path, msg.joined, msg.once, _tensor_signature(msg.grads))


def _same(a: Any, b: Any) -> bool:
    """Signature equality; a non-tensor argument that cannot be compared counts as different."""
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - e.g. an array's ambiguous truth value
        return False


@dataclass
class ReplayStats:
    """How a serving rank ran its steps in static mode.

    Attributes:
        replayed: steps run entirely by the replay.
        fallbacks: replays that met something other than the recording and finished the
            step in dynamic mode.
        recorded: steps run (entirely or from a fallback on) in dynamic mode and recorded.
        requests: requests served by the replay.
        reasons: the reason of each fallback, in order (the last 16 kept).
        not_replayable: why the last recorded step cannot be replayed ("" if it can).
        nested: of ``requests``, the backward requests served at a yield point of a replayed
            forward (nested in it, as dynamic mode lets a forward yield to them).
    """

    replayed: int = 0
    fallbacks: int = 0
    recorded: int = 0
    requests: int = 0
    reasons: list[str] = field(default_factory=list)
    not_replayable: str = ""
    nested: int = 0


class StepReplay:
    """Records and replays one serving rank's steps (see the module doc).

    Args:
        loop: the rank's main loop (and through it its transport, handlers and executor).
        runs_locally: ``(path, span) -> bool``: whether a request runs only modules owned
            here (what the runtime's placement says).
    """

    def __init__(self, loop: ServingLoop, runs_locally: Callable[..., bool]) -> None:
        self.loop = loop
        self.runs_locally = runs_locally
        self.stats = ReplayStats()
        # Replay requests that run device work too (synchronously on the main thread, as a
        # torch schedule runs its stage), instead of leaving them to dynamic mode, whose
        # workers overlap one request's device work with another's CPU work. Off by default;
        # bench_pipeline measures both.
        self.device_work_inline = False
        # The recording: the signatures of the last step run whole (replayed or recorded).
        self._recording: dict[SignatureKey, tuple[Any, ...]] | None = None
        # Per step: the signatures of the requests taken so far (a request of the next step
        # may arrive, and be served, before this rank saw the current step end).
        self._seen: dict[int, dict[SignatureKey, tuple[Any, ...]]] = {}
        self._counts: dict[int, dict[tuple[int, int, str], int]] = {}
        # Why the step being recorded cannot be replayed next time (None: it can so far).
        self._unreplayable: dict[int, str] = {}
        # The step being replayed (None: none; a yield point inline serves nothing nested).
        self._step: int | None = None
        loop.executor.inline_yield = self._serve_nested

    # ------------------------------------------------------------------ signatures
    def _note(self, msg: FwdReq | BwdReq) -> tuple[SignatureKey, tuple[Any, ...]]:
        """File ``msg``'s signature under its step; returns its key and signature."""
        kind = "fq" if type(msg) is FwdReq else "bq"
        counts = self._counts.setdefault(msg.step, {})
        base = (msg.src, msg.mb, kind)
        n = counts.get(base, 0)
        counts[base] = n + 1
        key = (msg.src, msg.mb, kind, n)
        sig = request_signature(msg)
        self._seen.setdefault(msg.step, {})[key] = sig
        return key, sig

    def recording_handler(self, handle: Callable[[Message], None]) -> Callable[[Message], None]:
        """``handle`` (the dynamic main loop's), noting each request's signature first."""

        def note_and_handle(msg: Message) -> None:
            tp = type(msg)
            if tp is FwdReq or tp is BwdReq:
                req: Any = msg
                self._note(req)
                if tp is FwdReq and not self.runs_locally(req.path, req.modules()):
                    label = span_label(req.path, req.modules())
                    self._unreplayable.setdefault(
                        req.step, f"'{label}' calls modules of other ranks"
                    )
            handle(msg)

        return note_and_handle

    # ------------------------------------------------------------------ one request
    def _refusal(self, req: FwdReq | BwdReq) -> str | None:
        """Note ``req`` (a request of the step being replayed) and say why the replay may not
        serve it inline (None: it may)."""
        recording = self._recording
        assert recording is not None
        key, sig = self._note(req)
        if not _same(recording.get(key), sig):
            return _difference(key, recording.get(key), sig)
        if type(req) is FwdReq:
            kind = (FORWARD, span_label(req.path, req.modules()))
            if not self.runs_locally(req.path, req.modules()):
                return f"'{kind[1]}' calls modules of other ranks"
        else:
            if not self.loop.handlers.can_inline_backward(req):  # type: ignore[arg-type]
                return f"no local record of the call {req.key}"
            kind = (BACKWARD, req.path)
        if not self.device_work_inline and kind in self.loop.executor.device_kinds:
            return f"the {kind[0]} of '{kind[1]}' ran device work"
        return None

    def _put_back(self, msg: Message) -> None:
        """``msg`` back to the front of the inbox, unserved (a request: noted again when it
        is taken next)."""
        self.loop.transport.inbox.appendleft(msg)
        if type(msg) is FwdReq or type(msg) is BwdReq:
            req: Any = msg
            kind = "fq" if type(msg) is FwdReq else "bq"
            base = (req.src, req.mb, kind)
            counts = self._counts[req.step]
            counts[base] -= 1
            del self._seen[req.step][(*base, counts[base])]

    def _serve_nested(self, task: Task[Any]) -> None:
        """At a yield point of the forward ``task`` the replay runs inline: serve the arrived
        backward requests of this step (and control messages) nested on this thread, then let
        the forward go on. Dynamic mode does the same from its main loop while the forward's
        worker waits at that point (a forward yields to backward work, which another rank
        waits for): the same work in the same order, so the results are the same. A request
        the replay may not serve goes back to the inbox for the replay loop, which falls back
        when it takes it, after this forward."""
        step = self._step
        if step is None or autocast_state():  # (a nested backward would inherit autocast)
            return
        loop = self.loop
        transport, executor, handlers = loop.transport, loop.executor, loop.handlers
        since = executor.current_since
        try:
            while True:
                msg = transport.pick(only=_NESTED)
                if msg is None:
                    return
                tp = type(msg)
                req: Any = msg
                if tp is BwdReq and req.step == step:
                    if self._refusal(req) is not None:
                        self._put_back(msg)
                        return
                    self.stats.requests += 1
                    self.stats.nested += 1
                    with torch.enable_grad():  # what a worker's backward runs under
                        handlers.serve_request(req, inline=True)
                elif tp is MbDone or tp is Abort:
                    handlers.handle(msg)
                else:  # a response, the step's end, another step's request: the loop's
                    transport.inbox.appendleft(msg)
                    return
        finally:
            # The nested tasks took the token and gave it back: the forward holds it again.
            executor.current, executor.current_since = task, since
            set_inline_task(task)

    # ------------------------------------------------------------------ a step
    def follow(self, step: int, until: Callable[[], bool]) -> None:
        """Serve ``step`` on this rank: replay it if the last step was recorded whole, and
        finish it in dynamic mode (recording it) if the replay cannot or meets a difference."""
        loop = self.loop
        replayed = False
        if self._recording is not None:
            replayed = loop.guarded(lambda: self._replay(step, until))
        if not replayed:
            loop.handle = self.recording_handler(loop.handlers.handle)
            try:
                loop.serve(until)
            finally:
                loop.handle = loop.handlers.handle
        self._end(step, replayed)

    def _end(self, step: int, replayed: bool) -> None:
        seen = self._seen.pop(step, {})
        self._counts.pop(step, None)
        reason = self._unreplayable.pop(step, None)
        if not self.device_work_inline and self.loop.executor.device_kinds:
            kinds = sorted(self.loop.executor.device_kinds)
            reason = f"device work in {', '.join(f'the {p} of {m!r}' for p, m in kinds)}"
        if replayed:
            self.stats.replayed += 1
        else:
            self.stats.recorded += 1
            self._recording = seen if reason is None else None
            self.stats.not_replayable = reason or ""
        for old in [s for s in self._seen if s < step]:  # (an aborted step's leftovers)
            del self._seen[old]
            self._counts.pop(old, None)

    def _fallback(self, step: int, reason: str, msg: Message | None = None) -> bool:
        """Hand the rest of ``step`` to dynamic mode (``msg``, not served, goes first)."""
        loop = self.loop
        if msg is not None:
            self._put_back(msg)
        stats = self.stats
        stats.fallbacks += 1
        stats.reasons = [*stats.reasons[-15:], reason]
        ex = loop.executor
        if ex.record_timeline:
            now = time.time()
            mb = getattr(msg, "mb", 0)
            ex.events.append((loop.pp_rank, mb, f"replay fallback: {reason}", FORWARD, now, now))
        self._recording = None
        return False

    def _replay(self, step: int, until: Callable[[], bool]) -> bool:
        """The replay loop of ``step``; True if it ran the whole step, False after handing
        the rest to dynamic mode."""
        self._step = step
        try:
            return self._replay_loop(step, until)
        finally:
            self._step = None

    def _replay_loop(self, step: int, until: Callable[[], bool]) -> bool:
        loop, recording = self.loop, self._recording
        assert recording is not None
        transport, executor, handlers = loop.transport, loop.executor, loop.handlers
        # Requests of this step taken (and served dynamically) while the last one ended.
        for key, sig in self._seen.get(step, {}).items():
            if not _same(recording.get(key), sig):
                return self._fallback(step, f"request {key} differs from the recording")
        loop.start()
        while not until():
            loop.housekeeping()
            if executor.ready or executor.yielded:
                return self._fallback(step, "a worker waits (a request served dynamically)")
            msg = transport.pick()
            if msg is None:
                msg = loop.wait_message()
                if msg is None:
                    continue
            tp = type(msg)
            if tp is FwdReq or tp is BwdReq:
                req: Any = msg
                if req.step != step:  # the next step's, early: as dynamic mode would
                    self._note(req)
                    handlers.handle(req)
                    continue
                reason = self._refusal(req)
                if reason is not None:
                    return self._fallback(step, reason, msg)
                self.stats.requests += 1
                handlers.serve_request(req, inline=True)
            elif tp is MbDone or tp is StepEnd or tp is Abort:
                handlers.handle(msg)
            else:  # a response: this rank waits on another one (not recorded as replayable)
                return self._fallback(step, f"a {tp.__name__} arrived", msg)
        return True


_FIELDS = {
    "fq": ("kind", "module", "grad mode", "autocast", "checkpointing", "run", "relay", "chain",
           "arguments"),
    "bq": ("kind", "module", "joined", "last request", "gradients"),
}  # fmt: skip


def _difference(key: SignatureKey, recorded: tuple[Any, ...] | None, got: tuple[Any, ...]) -> str:
    """Why a request is not the recorded one, worded (the first field that differs)."""
    src, mb, kind, n = key
    what = f"{'forward' if kind == 'fq' else 'backward'} request {n} of microbatch {mb} from pp rank {src}"
    if recorded is None:
        return f"{what} was not recorded"
    for name, a, b in zip(_FIELDS[kind], recorded, got):
        if not _same(a, b):
            if name in ("arguments", "gradients"):
                a, b = _shapes(a), _shapes(b)
            return f"{what}: {name} {b!r}, recorded {a!r}"
    return f"{what} differs from the recording"


def _shapes(sig: tuple[Any, ...]) -> str:
    return ", ".join(f"{'x'.join(map(str, s)) or '()'} {str(d).replace('torch.', '')}" for s, d, _ in sig[1])
