"""Autograd across pipeline ranks without ever blocking inside an autograd function.

The graph is *cut* at every remote call:

- On the owner (callee) the call's inputs arrive as fresh leaves (``requires_grad`` as sent);
  the call's input leaves and its outputs that require grad are kept in an
  :class:`IncomingCall` record.
- On the caller, the received outputs enter the local graph through :class:`RemoteBoundary`,
  whose backward only *sends* a backward request (call id + output gradients) to the owner and
  returns. It never waits.
- The owner runs ``torch.autograd.backward(outputs, grads)`` as a *backward segment* in a
  worker; that may send further backward requests for nested remote calls. A response carries
  the gradients of the call's inputs; the caller then runs another segment
  ``torch.autograd.backward(saved_inputs, input_grads)``.
- Each :class:`Context` (an incoming call, or a microbatch's root on the driver) counts its
  outstanding nested backward requests. When the count is zero after a segment, every
  contribution has reached the context's input leaves, so the response is sent (or the
  microbatch's ``backward(loss)`` returns).

Gradient contributions are linear, so several partial segments over a shared upstream graph
sum to the full gradient, provided the graph is retained (``retain_graph=True``) until the
microbatch's backward completes; then every record of the microbatch is dropped, freeing the
graph. A boundary may fire more than once (two segments reaching it through different paths);
each firing is its own request, and each response carries only the gradient accumulated since
the previous response (input leaves' ``.grad`` is reset after being sent).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pragma: no cover
    from smp_pipeline.server import ExecutionServer

CallKey = tuple[int, int]  # (pp rank of the caller, per-rank call counter)


class Context:
    """Something whose backward waits for nested backward requests to complete."""

    def __init__(self, step: int, mb: int) -> None:
        self.step = step
        self.mb = mb
        self.pending = 0  # nested backward requests sent and not yet answered


class RootContext(Context):
    """A microbatch's step function on the driver rank."""

    def __init__(self, step: int, mb: int) -> None:
        super().__init__(step, mb)
        self.waiter: Any = None  # the worker blocked in backward(loss) until pending == 0
        self.admitted = False  # the schedule let this microbatch's backward start


class IncomingCall(Context):
    """The owner's record of one execution it performed for a remote caller."""

    def __init__(self, step: int, mb: int, key: CallKey, path: str, inputs: list[torch.Tensor]):
        super().__init__(step, mb)
        self.key = key
        self.path = path
        self.inputs = inputs  # leaves that require grad, in flat order
        self.outputs: list[torch.Tensor] = []  # outputs that require grad, in flat order
        self.open: list[int] = []  # backward request numbers awaiting a response


class OutgoingCall:
    """The caller's record of a remote call whose outputs entered the local graph."""

    def __init__(
        self,
        server: ExecutionServer,
        key: CallKey,
        dest: int,
        path: str,
        parent: Context,
        inputs: list[torch.Tensor],
    ) -> None:
        self.server = server
        self.key = key
        self.dest = dest
        self.path = path
        self.parent = parent  # the context that made the call: its backward awaits ours
        self.inputs = inputs  # the tensors sent that require grad, in flat order
        self.step = parent.step
        self.mb = parent.mb


class RemoteBoundary(torch.autograd.Function):
    """Identity on a remote call's outputs; its backward sends a backward request and returns.

    ``dummy`` is an empty tensor that requires grad, so the outputs require grad even though
    the received tensors are plain leaves.
    """

    @staticmethod
    def forward(ctx: Any, call: OutgoingCall, dummy: torch.Tensor, *tensors: torch.Tensor) -> Any:
        ctx.call = call
        ctx.set_materialize_grads(False)  # unused outputs give None, not zeros
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        call: OutgoingCall = ctx.call
        call.server.send_backward_request(call, list(grads))
        return (None, None) + (None,) * len(grads)


def attach_boundary(call: OutgoingCall, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Pass ``tensors`` (the received outputs that require grad) through the boundary."""
    dummy = torch.empty(0, requires_grad=True)
    out = RemoteBoundary.apply(call, dummy, *tensors)
    return list(out)
