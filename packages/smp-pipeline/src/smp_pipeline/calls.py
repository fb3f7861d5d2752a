"""Cross-rank module calls and backward segments (the caller and owner sides).

These are methods of :class:`smp_pipeline.server.ExecutionServer` (bound there), kept in
their own module: :func:`call_remote` turns a call of a module owned elsewhere into a
forward request and attaches the received outputs to the local graph through a
:class:`~smp_pipeline.boundary.RemoteBoundary`; :func:`run_forward_request` serves such a
request on the owner; the backward functions implement the non-blocking cross-rank autograd
described in :mod:`smp_pipeline.boundary`. All run while holding the execution token.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from smp_pipeline import messages as M
from smp_pipeline.boundary import (
    CallKey,
    Context,
    IncomingCall,
    OutgoingCall,
    RootContext,
    attach_boundary,
)
from smp_pipeline.errors import PipelineError
from smp_pipeline.execution_state import capture, execution_state
from smp_pipeline.messages import flatten, pack, unflatten, unpack_leaves
from smp_pipeline.worker import Task

if TYPE_CHECKING:  # pragma: no cover
    from smp_pipeline.server import ExecutionServer


def call_remote(
    self: ExecutionServer,
    path: str,
    dest: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    checkpoint: bool,
    span: tuple[int, int] | None = None,
) -> Any:
    """Run module ``path`` on pp rank ``dest`` for the current task (caller side).

    ``span=(i, j)``: run children ``i..j-1`` of the ``nn.Sequential`` at ``path`` in one
    request (they all live on ``dest``).
    """
    task = self.current
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
    msg = {
        "kind": M.FWD_REQ,
        "key": key,
        "path": path,
        "step": ctx.step,
        "mb": ctx.mb,
        "phase": "forward",
        "grad": st["grad"],
        "autocast": st["autocast"],
        "checkpoint": checkpoint,
        "span": span,
        "inputs": {"skeleton": skeleton, "tensors": [t.detach() for t in tensors], "flags": flags},
    }
    self.outstanding[("fwd", key)] = (
        time.monotonic(),
        f"the forward of module '{path}' (microbatch {ctx.mb}) on pp rank {dest}",
    )
    self.send(dest, msg)
    assert task.worker is not None
    resp = task.worker.wait(("fwd", key))
    out = resp["outputs"]
    outs = [t.detach() for t in out["tensors"]]
    oflags = out["flags"]
    if any(oflags):
        inputs = [t for t, f in zip(tensors, flags) if f]
        label = path if span is None else f"{path or '<root>'}[{span[0]}:{span[1]}]"
        call = OutgoingCall(self, key, dest, label, ctx, inputs)
        self.outgoing[key] = call
        idx = [i for i, f in enumerate(oflags) if f]
        # Joined backward where the boundary's gradients are CPU tensors (boundary.py).
        call.joined = self.backward_mode == "joined" or (
            self.backward_mode == "auto" and all(outs[i].device.type == "cpu" for i in idx)
        )
        if not call.joined:
            ctx.segment_calls = True
        attached = attach_boundary(call, [outs[i] for i in idx])
        for i, t in zip(idx, attached):
            outs[i] = t
    return unflatten(out["skeleton"], outs)

def run_forward_request(self: ExecutionServer, task: Task) -> None:
    """Callee side of :meth:`call_remote`."""
    msg = task.payload  # type: ignore[attr-defined]
    (args, kwargs), leaves = unpack_leaves(msg["inputs"])
    key: CallKey = tuple(msg["key"])  # type: ignore[assignment]
    rec = IncomingCall(msg["step"], msg["mb"], key, task.module, leaves)
    task.context = rec
    with execution_state(msg["grad"], msg["autocast"]):
        out = self.execute(
            msg["path"], tuple(args), dict(kwargs), bool(msg["checkpoint"]), msg.get("span")
        )
    skeleton, tensors = flatten(out)
    flags = [bool(msg["grad"] and t.requires_grad) for t in tensors]
    if any(flags):
        rec.outputs = [t for t, f in zip(tensors, flags) if f]
        self.incoming[key] = rec
    resp = {
        "kind": M.FWD_RESP,
        "key": key,
        "step": msg["step"],
        "mb": msg["mb"],
        "outputs": {"skeleton": skeleton, "tensors": [t.detach() for t in tensors], "flags": flags},
    }
    self.send(msg["src"], resp)

def backward_through(
    self: ExecutionServer, call: OutgoingCall, grads: list[torch.Tensor | None]
) -> list[torch.Tensor | None]:
    """Joined mode, from :class:`RemoteBoundary.backward`: send the output gradients, wait
    (token given back) for the owner's input gradients and return them."""
    task = _backward_task(self, call)
    if all(g is None for g in grads):
        return [None] * len(call.inputs)
    assert task.worker is not None
    msg = task.worker.wait(_post_backward_request(self, call, grads, joined=True))
    return list(unflatten(msg["grads"]["skeleton"], msg["grads"]["tensors"]))


def send_backward_request(self: ExecutionServer, call: OutgoingCall, grads: list[torch.Tensor | None]) -> None:
    """Segment mode, from :class:`RemoteBoundary.backward`: send, count, never wait."""
    _backward_task(self, call)
    if all(g is None for g in grads):
        return
    call.parent.pending += 1
    _post_backward_request(self, call, grads, joined=False)


def _backward_task(self: ExecutionServer, call: OutgoingCall) -> Task:
    """The task running the current backward segment (a boundary fired outside one is an error)."""
    task = self.current
    if task is None or not task.in_segment or task.worker is None:
        raise PipelineError(
            f"the gradient of remote module '{call.path}' was requested outside the "
            "pipeline's backward: call runtime.backward(loss) in the step function, "
            "not loss.backward()"
        )
    return task


def _post_backward_request(
    self: ExecutionServer, call: OutgoingCall, grads: list[torch.Tensor | None], joined: bool
) -> tuple[str, CallKey, int]:
    """Send a backward request for ``call``; returns the key its response is awaited under."""
    req = next(self._bwd_reqs)
    key = ("bwd", call.key, req)
    self.outstanding[key] = (
        time.monotonic(),
        f"the backward of module '{call.path}' (microbatch {call.mb}) on pp rank {call.dest}",
    )
    self.send(
        call.dest,
        {
            "kind": M.BWD_REQ,
            "key": call.key,
            "req": req,
            "path": call.path,
            "step": call.step,
            "mb": call.mb,
            "joined": joined,  # joined: answered once, so the owner may free its graph
            "grads": pack(grads, False),
        },
    )
    return key


def segment(
    self: ExecutionServer, tensors: list[torch.Tensor], grads: list[torch.Tensor], retain: bool = True
) -> None:
    """One engine run of backward (a segment; in joined mode the context's only one).

    ``retain=False`` frees the graph as the engine goes (joined mode, no segment-mode call
    in the context: nothing will run through it again).
    """
    if not tensors:
        return
    task = self.current
    assert task is not None
    task.in_segment = True
    try:
        torch.autograd.backward(tensors, grads, retain_graph=retain)
    finally:
        task.in_segment = False

def run_callee_segment(self: ExecutionServer, task: Task) -> None:
    msg = task.payload  # type: ignore[attr-defined]
    rec = task.context
    assert isinstance(rec, IncomingCall)
    grads = unflatten(msg["grads"]["skeleton"], msg["grads"]["tensors"])
    pairs = [(o, g) for o, g in zip(rec.outputs, grads) if g is not None]
    retain = rec.segment_calls or not msg.get("joined", False)
    self.segment([o for o, _ in pairs], [g for _, g in pairs], retain)
    self.maybe_complete(rec)

def run_caller_segment(self: ExecutionServer, task: Task) -> None:
    call, msg = task.payload  # type: ignore[attr-defined]
    grads = unflatten(msg["grads"]["skeleton"], msg["grads"]["tensors"])
    pairs = [(t, g) for t, g in zip(call.inputs, grads) if g is not None]
    self.segment([t for t, _ in pairs], [g for _, g in pairs])
    call.parent.pending -= 1
    self.maybe_complete(call.parent)

def maybe_complete(self: ExecutionServer, ctx: Context) -> None:
    """If ``ctx`` has no outstanding nested request, its input gradients are complete."""
    if ctx.pending:
        return
    if isinstance(ctx, IncomingCall):
        if not ctx.open:
            return
        grads: list[torch.Tensor | None] = []
        for leaf in ctx.inputs:
            grads.append(leaf.grad)
            leaf.grad = None  # the next response carries only later contributions
        for i, req in enumerate(ctx.open):
            self.send(
                ctx.key[0],
                {
                    "kind": M.BWD_RESP,
                    "key": ctx.key,
                    "req": req,
                    "step": ctx.step,
                    "mb": ctx.mb,
                    "grads": pack(grads if i == 0 else [None] * len(grads), False),
                },
            )
        ctx.open.clear()
    elif isinstance(ctx, RootContext):
        key = ("bwd_done", ctx.step, ctx.mb)
        if key in self.waiting:
            self._wake(key, None)
