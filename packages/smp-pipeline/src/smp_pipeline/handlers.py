"""What each arrived pipeline message does: one handler per kind.

The server's main loops choose *when* a message is served (:mod:`smp_pipeline.server`);
:class:`MessageHandlers` says *what* serving it means. A forward request starts a task that
runs the module; a forward response wakes the caller waiting for it; a backward request
starts the owner's backward segment; a backward response wakes a joined backward or starts
the caller's segment; ``MbDone`` drops a finished microbatch's records and folds its
gradients if this rank's own records have not already (:mod:`smp_pipeline.accumulation`); ``StepEnd`` is kept until the step's serve
loop ends; an ``Abort`` raises. A handler starts tasks and wakes
workers through the executor; it never waits, so the main loop stays free.
"""

from __future__ import annotations

import time

from smp_pipeline.accumulation import GradAccumulator
from smp_pipeline.actions import BACKWARD, FORWARD
from smp_pipeline.autograd import CallRecords, IncomingCall, OutgoingCall
from smp_pipeline.errors import PipelineError
from smp_pipeline.executor import Executor
from smp_pipeline.protocol import Abort, BwdReq, BwdResp, FwdReq, FwdResp, MbDone, Message, StepEnd
from smp_pipeline.remote import RemoteCalls
from smp_pipeline.seqruns import span_label
from smp_pipeline.transport import Transport
from smp_pipeline.worker import Task


class MessageHandlers:
    """Serves one rank's arrived messages (called by the server's main loops).

    Args:
        pp_rank: this rank's pipeline index.
        transport: request bookkeeping (answered requests) and aborts.
        executor: starts tasks and wakes waiting workers.
        records: the cross-rank autograd records backward messages refer to.
        remote: the task functions of cross-rank calls.
        grads: folds a microbatch's gradients at the latest when ``MbDone`` says its backward
            is complete.
    """

    def __init__(
        self,
        pp_rank: int,
        transport: Transport,
        executor: Executor,
        records: CallRecords,
        remote: RemoteCalls,
        grads: GradAccumulator,
    ) -> None:
        self.pp_rank = pp_rank
        self.transport = transport
        self.executor = executor
        self.records = records
        self.remote = remote
        self.grads = grads
        self.step_ends: dict[int, StepEnd] = {}  # the driver's end-of-step notes, by step
        self.requests_served = 0  # forward and backward requests

    def handle(self, msg: Message) -> None:
        """Serve ``msg`` (it counts as progress for the no-progress timeout)."""
        self.executor.last_progress = time.monotonic()
        match msg:
            case FwdReq():
                self._on_forward_request(msg)
            case FwdResp():
                self._on_forward_response(msg)
            case BwdReq():
                self._on_backward_request(msg)
            case BwdResp():
                self._on_backward_response(msg)
            case MbDone():
                self.records.drop_microbatch(msg.step, msg.mb)
                self.grads.complete(msg.step, msg.mb)
            case StepEnd():
                self.step_ends[msg.step] = msg
            case Abort():
                self.transport.raise_if_aborted()
            case _:
                raise PipelineError(f"pp rank {self.pp_rank}: unknown message {msg!r}")

    def starts_task(self, msg: Message) -> bool:
        """Whether handling ``msg`` starts a task (else it only wakes a waiting worker)."""
        if type(msg) is BwdResp:
            return msg.wait_key not in self.executor.waiting
        return isinstance(msg, (FwdReq, BwdReq))

    def serve_request(self, msg: FwdReq | BwdReq, inline: bool = False) -> None:
        """Serve a forward or backward request; ``inline``: on this thread, whatever the last
        run of its kind did (static mode's replay, which checked that it may)."""
        if type(msg) is FwdReq:
            self._on_forward_request(msg, inline)
        else:
            self._on_backward_request(msg, inline)  # type: ignore[arg-type]

    def can_inline_backward(self, msg: BwdReq) -> bool:
        """Whether the call ``msg`` asks the backward of ran only modules owned here."""
        rec = self.records.incoming.get(msg.key)
        return rec is not None and rec.local

    def _on_forward_request(self, msg: FwdReq, inline: bool = False) -> None:
        self.requests_served += 1
        modules = msg.modules()
        label = span_label(msg.path, modules)
        task = Task(self.remote.run_forward_request, msg.mb, label, FORWARD, None, msg.step, msg)
        ex = self.executor
        if inline or (ex.may_inline(FORWARD, label) and self.remote.runs_locally(msg.path, modules)):
            ex.run_inline(task)  # static mode: it cannot wait, and ran straight through before
        else:
            ex.start(task)

    def _on_forward_response(self, msg: FwdResp) -> None:
        key = ("fwd", msg.key)
        self.transport.answered(key)
        self.executor.wake(key, msg)

    def _on_backward_request(self, msg: BwdReq, inline: bool = False) -> None:
        self.requests_served += 1
        rec = self.records.incoming.get(msg.key)
        if rec is None:
            self.transport.abort(
                "error",
                f"pp rank {self.pp_rank}: backward request for call {msg.key} of module "
                f"'{msg.path}' (microbatch {msg.mb}) has no saved forward record",
            )
            return
        rec.open.append(msg.req)
        rec.joined = msg.joined
        if msg.once:
            rec.once = True
        task = Task(self.remote.run_callee_segment, rec.mb, rec.path, BACKWARD, rec, rec.step, msg)
        if rec.local and (inline or self.executor.may_inline(BACKWARD, rec.path)):
            self.executor.run_inline(task)
        else:
            self.executor.start(task)

    def _on_backward_response(self, msg: BwdResp) -> None:
        wait_key = msg.wait_key
        self.transport.answered(wait_key)
        if wait_key in self.executor.waiting:  # joined mode: resume the waiting backward
            self.executor.wake(wait_key, msg)
            return
        call = self.records.outgoing[msg.key]
        label = call.parent.path if isinstance(call.parent, IncomingCall) else "<step>"
        payload: tuple[OutgoingCall, BwdResp] = (call, msg)
        run = self.remote.run_caller_segment
        task = Task(run, call.mb, label, BACKWARD, call.parent, call.step, payload)
        self.executor.start(task)
