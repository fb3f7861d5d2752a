"""One engine run of backward with the gradients given, without ``torch.autograd.backward``'s
Python checks when they cannot fail.

Every backward segment of a pipeline request runs ``backward(tensors, grads)`` with one
gradient per tensor, received from the next stage. ``torch.autograd.backward`` first
normalises its arguments and checks each gradient against its tensor in Python
(``_make_grads``: a symbolic-shape comparison per tensor, imports inside the loop), then calls
the engine. For plain tensors and gradients of the same shape that is some 20-40 µs of CPU
per segment at zero compute (docs/performance.md, "Static mode against dynamic smp and torch
1F1B"), on every rank and microbatch. Where the checks cannot fail and change nothing (they
hand the same gradient objects on), :func:`run_backward` calls the engine the way
``torch.autograd.backward`` does; anything else (``None`` gradients, tensor subclasses or
``__torch_function__`` modes, nested tensors, functorch transforms, a mismatch to report) goes
through ``torch.autograd.backward`` itself, so errors and special cases stay torch's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.overrides import has_torch_function

__all__ = ["run_backward"]

_TENSOR = torch.Tensor
# (Private in torch: without it, every call takes the public path.)
_ENGINE_RUN: Callable[..., Any] | None = getattr(torch.autograd.graph, "_engine_run_backward", None)
_FUNCTORCH_ACTIVE = getattr(torch._C, "_are_functorch_transforms_active", None)


def _direct(tensors: Sequence[Any], grads: Sequence[Any]) -> bool:
    """Whether ``torch.autograd.backward`` would pass ``grads`` to the engine unchanged."""
    if _ENGINE_RUN is None or _FUNCTORCH_ACTIVE is None or _FUNCTORCH_ACTIVE():
        return False
    if len(tensors) != len(grads):
        return False
    for t, g in zip(tensors, grads):
        if type(t) is not _TENSOR or type(g) is not _TENSOR or t.is_nested:
            return False
        if t.shape != g.shape or t.dtype.is_complex != g.dtype.is_complex:
            return False  # (torch's own error names the mismatch)
    return not has_torch_function((*tensors, *grads))


def run_backward(tensors: Sequence[Any], grads: Sequence[Any], retain_graph: bool) -> None:
    """``torch.autograd.backward(tensors, grads, retain_graph=retain_graph)``, calling the
    engine directly where that call's checks would pass the gradients through unchanged."""
    if _direct(tensors, grads):
        assert _ENGINE_RUN is not None
        _ENGINE_RUN(
            tuple(tensors), tuple(grads), retain_graph, False, (),
            allow_unreachable=True, accumulate_grad=True,
        )  # fmt: skip
        return
    torch.autograd.backward(list(tensors), list(grads), retain_graph=retain_graph)
