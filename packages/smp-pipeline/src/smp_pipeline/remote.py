"""Cross-rank module calls and backward segments (the caller and owner sides).

:meth:`RemoteCalls.call_remote` turns a call of a module owned elsewhere into a
:class:`~smp_pipeline.protocol.FwdReq` and attaches the received outputs to the local graph
through a :class:`~smp_pipeline.autograd.RemoteBoundary`; :meth:`RemoteCalls.run_forward_request`
serves such a request on the owner; the backward methods implement the cross-rank autograd
described in :mod:`smp_pipeline.autograd` (this class is the boundary's
:class:`~smp_pipeline.autograd.BoundaryPort`). Everything here runs while holding the
execution token, inside a task.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from smp_pipeline.autograd import (
    CallRecords,
    Context,
    IncomingCall,
    OutgoingCall,
    RootContext,
    attach_boundary,
    joined_mode,
    run_segment,
)
from smp_pipeline.chains import chain_input
from smp_pipeline.errors import PipelineError
from smp_pipeline.execution_state import capture, execution_state
from smp_pipeline.executor import Executor
from smp_pipeline.messages import Packed, flatten, pack, unflatten, unpack_leaves
from smp_pipeline.protocol import BwdReq, BwdResp, CallKey, FwdReq, FwdResp
from smp_pipeline.seqruns import span_label
from smp_pipeline.transport import Transport
from smp_pipeline.worker import Task

# Runs an owned module: (path, args, kwargs, checkpoint, span) -> outputs, where span (module
# paths) asks for a run of an nn.Sequential's children, called in order (Appendix B).
Execute = Callable[[str, tuple[Any, ...], dict[str, Any], bool, "tuple[str, ...] | None"], Any]
# (path, span) -> whether the request runs only modules owned here
RunsLocally = Callable[[str, "tuple[str, ...] | None"], bool]
# (path, span) -> id() of the parameters the request runs
CallParams = Callable[[str, "tuple[str, ...] | None"], frozenset[int]]


def _nothing_local(_path: str, _span: tuple[str, ...] | None) -> bool:
    return False


def _no_params(_path: str, _span: tuple[str, ...] | None) -> frozenset[int]:
    return frozenset()


class RemoteCalls:
    """Both sides of cross-rank calls, forward and backward, for one rank.

    ``runs_locally`` and ``call_params`` answer from the runtime's placement (they see it once
    the model is partitioned; before, no request arrives): whether a request runs only
    modules owned here (static mode serves such requests on the main loop), and which
    parameters it runs (deterministic accumulation streams by it, see
    :meth:`CallRecords.streamable`). Without a placement: nothing local, no parameters.
    """

    def __init__(
        self,
        pp_rank: int,
        transport: Transport,
        executor: Executor,
        records: CallRecords,
        execute: Execute,
        backward_mode: str,
        on_backward_done: Callable[[int, int], None] | None = None,
        runs_locally: RunsLocally | None = None,
        call_params: CallParams | None = None,
    ) -> None:
        self.pp_rank = pp_rank
        self.transport = transport
        self.executor = executor
        self.records = records
        self.execute = execute
        self.backward_mode = backward_mode
        # (step, mb): this rank's backward of the microbatch is complete by its own records.
        self.on_backward_done = on_backward_done
        self._calls = itertools.count()
        self._bwd_reqs = itertools.count()
        self.relayed = 0  # requests sent on to the next owner of a relay (fwd and bwd)
        self.runs_locally: RunsLocally = runs_locally or _nothing_local
        self.call_params: CallParams = call_params or _no_params

    # ------------------------------------------------------------------ forward
    def call_remote(
        self,
        path: str,
        dest: int,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        checkpoint: bool,
        span: tuple[str, ...] | None = None,
        then: tuple[tuple[int, tuple[str, ...]], ...] = (),
        chain: tuple[tuple[str, bool], ...] = (),
    ) -> Any:
        """Run module ``path`` on pp rank ``dest`` for the current task (caller side).

        ``span``: the module paths of a run of children of the ``nn.Sequential`` at ``path``
        (``fast_mode``), called in order in one request (they all live on ``dest``).
        ``then``: further runs of it, ``(owner, span)`` each, the output relayed from owner
        to owner (:class:`~smp_pipeline.seqruns.Relay`); the last owner answers, and is
        where this call's backward request goes.
        ``chain``: blocks ``(path, checkpoint)`` to run after ``path`` on ``dest``, each on
        its predecessor's output (:mod:`smp_pipeline.chains`); the result is then the tuple
        of every block's output.
        """
        task = self.executor.current
        if task is not None and task.worker is None and task.context is not None:
            raise PipelineError(
                f"static mode served '{task.module}' on pp rank {self.pp_rank}'s main loop, "
                f"as every module under it lives there, but it called module '{path}' (pp "
                f"rank {dest}), which is not under it; run without static_mode"
            )
        if task is None or task.worker is None or task.context is None:
            raise PipelineError(
                f"module '{path}' lives on pp rank {dest}: call the model inside the step "
                "function given to run_step()"
            )
        if task.in_segment:
            raise PipelineError(
                f"module '{path}' (pp rank {dest}) was called during a backward segment on pp "
                f"rank {self.pp_rank}: a checkpointed module must not contain remote submodules"
            )
        ctx = task.context
        key: CallKey = (self.pp_rank, next(self._calls))
        st = capture()
        skeleton, tensors = flatten((args, kwargs))
        flags = [bool(st["grad"] and t.requires_grad) for t in tensors]
        msg = FwdReq(
            self.pp_rank,
            key,
            path,
            ctx.step,
            ctx.mb,
            st["grad"],
            st["autocast"],
            checkpoint,
            span,
            then,
            chain,
            Packed(skeleton, [t.detach() for t in tensors], flags),
        )
        label = span_label(path, msg.modules() if not then else (*(span or ()), *then[-1][1]))
        self.transport.expect(("fwd", key), dest, label, ctx.mb)
        self.transport.send(dest, msg)
        resp: FwdResp = task.worker.wait(("fwd", key))
        out = resp.outputs
        outs = [t.detach() for t in out.tensors]
        oflags = out.flags
        if any(oflags):
            inputs = [t for t, f in zip(tensors, flags) if f]
            # (Relayed: the gradients go to the last owner, the first one answers.)
            call = OutgoingCall(self, key, then[-1][0] if then else dest, label, ctx, inputs)
            self.records.outgoing[key] = call
            idx = [i for i, f in enumerate(oflags) if f]
            call.joined = joined_mode(self.backward_mode, [outs[i] for i in idx])
            if not call.joined:
                ctx.segment_calls = True
            attached = attach_boundary(call, [outs[i] for i in idx])
            for i, t in zip(idx, attached):
                outs[i] = t
        return unflatten(out.skeleton, outs)

    def run_forward_request(self, task: Task[FwdReq]) -> None:
        """Callee side of :meth:`call_remote`."""
        msg = task.payload
        (args, kwargs), leaves = unpack_leaves(msg.inputs)
        rec = IncomingCall(msg.step, msg.mb, msg.key, task.module, leaves)
        modules = msg.modules()
        rec.local = self.executor.inline_max_s > 0 and self.runs_locally(msg.path, modules)
        rec.params = self.call_params(msg.path, modules)
        caller = msg.key[0]
        if msg.src != caller:  # relayed from the previous owner: its gradients go back there
            rec.back_to = msg.src
        task.context = rec
        with execution_state(msg.grad, msg.autocast):
            out = self.execute(msg.path, tuple(args), dict(kwargs), msg.checkpoint, msg.span)
            if msg.chain:
                out = self._run_chain(out, msg.chain, tuple(args[1:]), dict(kwargs))
        # Relayed on, the output is the next owner's input, (args, kwargs) = ((out,), {}):
        # the same tensors in the same order, in the skeleton a request carries.
        skeleton, tensors = flatten(((out,), {}) if msg.then else out)
        flags = [bool(msg.grad and t.requires_grad) for t in tensors]
        relay = bool(msg.then) or rec.back_to is not None
        # A relay's backward passes every owner on the way (the caller waits for the first
        # one's answer), so each keeps its record even if its own outputs need no gradient.
        if any(flags) or (relay and msg.grad):
            rec.outputs = [t for t, f in zip(tensors, flags) if f]
            self.records.add_incoming(rec)
        outputs = Packed(skeleton, [t.detach() for t in tensors], flags)
        if msg.then:
            (dest, span), *further = msg.then
            self.relayed += 1
            onward = FwdReq(
                self.pp_rank, msg.key, msg.path, msg.step, msg.mb, msg.grad, msg.autocast,
                False, span, tuple(further), (), outputs,
            )  # fmt: skip
            self.transport.send(dest, onward)
            return
        self.transport.send(caller, FwdResp(self.pp_rank, msg.key, msg.step, msg.mb, outputs))

    def _run_chain(
        self,
        out: Any,
        chain: tuple[tuple[str, bool], ...],
        rest: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[Any, ...]:
        """A chained request's further blocks, each on its predecessor's output (see
        :mod:`smp_pipeline.chains`): every block's output, stopping early at an output
        that does not chain."""
        outs = [out]
        for path, checkpoint in chain:
            x = chain_input(outs[-1])
            if x is None:
                break
            outs.append(self.execute(path, (x, *rest), dict(kwargs), checkpoint, None))
        return tuple(outs)

    # ------------------------------------------------------------------ BoundaryPort
    def backward_through(
        self, call: OutgoingCall, grads: list[torch.Tensor | None]
    ) -> list[torch.Tensor | None]:
        """Joined mode, from :class:`RemoteBoundary.backward`: send the output gradients, wait
        (token given back) for the owner's input gradients and return them."""
        task = self._backward_task(call)
        if all(g is None for g in grads):
            return [None] * len(call.inputs)
        assert task.worker is not None
        msg: BwdResp = task.worker.wait(self._post_backward_request(call, grads, joined=True))
        return list(msg.grads.unpack())

    def send_backward_request(self, call: OutgoingCall, grads: list[torch.Tensor | None]) -> None:
        """Segment mode, from :class:`RemoteBoundary.backward`: send, count, never wait."""
        self._backward_task(call)
        if all(g is None for g in grads):
            return
        call.parent.pending += 1  # answered by run_caller_segment
        self._post_backward_request(call, grads, joined=False)

    def _backward_task(self, call: OutgoingCall) -> Task[Any]:
        """The task running the current backward segment (a boundary fired outside one is an
        error)."""
        task = self.executor.current
        if task is None or not task.in_segment or task.worker is None:
            raise PipelineError(
                f"the gradient of remote module '{call.path}' was requested outside the "
                "pipeline's backward: call runtime.backward(loss) in the step function, "
                "not loss.backward()"
            )
        return task

    def _post_backward_request(
        self, call: OutgoingCall, grads: list[torch.Tensor | None], joined: bool
    ) -> tuple[str, CallKey, int]:
        """Send a backward request for ``call``; returns the key its response is awaited under
        (:attr:`BwdResp.wait_key`)."""
        req = next(self._bwd_reqs)
        key = ("bwd", call.key, req)
        self.transport.expect(key, call.dest, call.path, call.mb)
        self.transport.send(
            call.dest,
            BwdReq(
                self.pp_rank, call.key, req, call.path, call.step, call.mb, joined,
                call.parent.single_run, pack(grads, False),
            ),
        )  # fmt: skip
        return key

    # ------------------------------------------------------------------ backward segments
    def segment(
        self, tensors: list[torch.Tensor], grads: list[torch.Tensor], retain: bool = True
    ) -> None:
        """One engine run of backward in the current task (see
        :func:`~smp_pipeline.autograd.run_segment`); remote calls are refused meanwhile."""
        if not tensors:
            return
        task = self.executor.current
        assert task is not None
        task.in_segment = True
        try:
            run_segment(tensors, grads, retain)
        finally:
            task.in_segment = False

    def run_callee_segment(self, task: Task[BwdReq]) -> None:
        """Owner side: backward through an incoming call's outputs with the sent gradients."""
        msg = task.payload
        rec = task.context
        assert isinstance(rec, IncomingCall)
        grads = msg.grads.unpack()
        pairs = [(o, g) for o, g in zip(rec.outputs, grads) if g is not None]
        retain = rec.segment_calls or not msg.joined
        # A running segment counts as pending: one that gives the token back midway (device
        # work in a backward on CPU) must not let another segment of the same call answer
        # before its contributions reached the input leaves.
        rec.pending += 1
        try:
            self.segment([o for o, _ in pairs], [g for _, g in pairs], retain)
        finally:
            rec.pending -= 1
        self.maybe_complete(rec)

    def run_caller_segment(self, task: Task[tuple[OutgoingCall, BwdResp]]) -> None:
        """Caller side (segment mode): continue backward from a call's input gradients."""
        call, msg = task.payload
        grads = msg.grads.unpack()
        pairs = [(t, g) for t, g in zip(call.inputs, grads) if g is not None]
        self.segment([t for t, _ in pairs], [g for _, g in pairs])
        call.parent.pending -= 1  # counted by send_backward_request
        self.maybe_complete(call.parent)

    def maybe_complete(self, ctx: Context) -> None:
        """If ``ctx`` has no outstanding nested request, its input gradients are complete:
        answer an incoming call's open requests, or let a root's ``backward(loss)`` return."""
        if ctx.pending:
            return
        if isinstance(ctx, IncomingCall):
            back = ctx.back_to
            for resp in self.records.responses(ctx):
                if back is None:
                    self.transport.send(ctx.key[0], resp)
                else:  # a relay: the input gradients are the previous owner's output ones
                    self.relayed += 1
                    self.transport.send(
                        back,
                        BwdReq(
                            self.pp_rank, ctx.key, resp.req, ctx.path, ctx.step, ctx.mb,
                            ctx.joined, ctx.once, resp.grads,
                        ),
                    )  # fmt: skip
            # Answered (the caller first: it waits), its last request: maybe the microbatch's
            # backward is complete here, and its gradients can be folded.
            if ctx.once and not ctx.open and self.records.finish(ctx):
                if self.on_backward_done is not None:
                    self.on_backward_done(ctx.step, ctx.mb)
        elif isinstance(ctx, RootContext):
            key = ("bwd_done", ctx.step, ctx.mb)
            if key in self.executor.waiting:
                self.executor.wake(key, None)
