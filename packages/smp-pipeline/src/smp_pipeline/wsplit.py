"""Operator-level split of a backward into input-grad (now) and weight-grad (deferred W tasks).

Zero-bubble pipelining runs the part of a stage's backward that the previous stage waits for
(the gradient with respect to the stage's inputs, "I") at once, and the part nobody waits for
(the weight gradients, "W") later, in the pipeline's idle time. Under
:func:`deferred_weight_grads` a backward pass does the I part for the layers it knows, and
queues, per layer application, a small W task that holds only what that weight gradient needs:

==================  ===============================================  =========================
layer               the W task holds                                 weight gradient
==================  ===============================================  =========================
``nn.Linear``       the input and grad_output                        ``g^T x``, ``sum g``
``nn.Embedding``    the indices and grad_output                      aten's embedding backward
``nn.LayerNorm``    the finished weight/bias gradients (vectors);    aten's layer-norm backward
                    ``defer_norms``: input, mean, rstd, grad_output
``nn.RMSNorm``      the finished weight gradient (a vector);         ``sum g * x_hat``
                    ``defer_norms``: normalised input, grad_output
==================  ===============================================  =========================

A norm's weight gradient is memory-bound and costs nearly as much as its input gradient when
computed apart (a second pass over the same rows), so by default the I pass computes it with
the input gradient (one kernel, as a plain backward does) and the W task only folds the
vector into ``.grad`` at its turn: less to hold, and I + W costs a plain backward.

The autograd graph is not kept alive from I to W: the I pass is an ordinary backward (its
graph freed as it goes), and each W task owns its few tensors until it runs. Every other
parameter (a convolution, ``x * self.scale``, a custom module's ``F.linear``, a linear layer on
a non-contiguous input) keeps torch's own backward, so its gradient is accumulated in the I
pass: named in :attr:`WeightGradQueue.immediate_params` (and a known layer that could not be
split counted in :attr:`WeightGradQueue.not_deferred_ops`).

Interception: for the context's duration the known layers' ``forward`` is replaced by a split
one. Activation checkpointing's recomputation (``torch.utils.checkpoint``, non-reentrant) calls
the same forwards inside the backward, so it goes through the split too, and each split layer
saves its tensors with ``save_for_backward``: checkpointing discards and recomputes them like
any other saved tensor.

See :mod:`smp_pipeline.wqueue` for the queue, its groups and its bitwise accumulation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from smp_pipeline.wqueue import GradPairs, WeightGradQueue, WTask

__all__ = [
    "WTask", "WeightGradQueue", "deferred_weight_grads", "register_linear", "split_modules",
    "splittable",
]  # fmt: skip

# --- the split operators ---------------------------------------------------------------------
#
# Each Function takes its parameters detached (the plain graph gets no edge to them: their
# gradient reaches .grad only through the W task) plus the queue's ``anchor``, an empty tensor
# that requires grad, so that the output requires grad even when no input does (a first
# layer's data): the backward must reach the operator to queue its W task.


def _detach(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                anchor: torch.Tensor, queue: WeightGradQueue,
                params: tuple[nn.Parameter, nn.Parameter | None]) -> torch.Tensor:  # fmt: skip
        ctx.save_for_backward(x, w)
        ctx.queue, (ctx.w_param, ctx.b_param) = queue, params
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w = ctx.saved_tensors
        g = g.contiguous()
        out_f, in_f = w.shape
        g2 = g.reshape(-1, out_f)
        gx = None
        if ctx.needs_input_grad[0]:
            # autograd's mm_mat1_backward for a row-major input: grad.mm(weight)
            gx = g2.mm(w).view(x.shape)
        x2 = x.reshape(-1, in_f)
        wp, bp = ctx.w_param, ctx.b_param
        queue: WeightGradQueue = ctx.queue

        def compute() -> GradPairs:
            # mm_mat2_backward for the transposed weight: (grad^T mm input), transposed twice
            # (into a recycled gradient where the queue has one: the same kernel, the same
            # bits, no fresh pages to fault in: WeightGradQueue.recycle)
            spare = queue.spare(wp, g2)
            gw = g2.t().mm(x2) if spare is None else torch.mm(g2.t(), x2, out=spare)
            out: GradPairs = [(wp, gw)]
            if bp is not None:
                # the broadcast bias: autograd reduces the output gradient with sum_to
                out.append((bp, g2.sum_to_size(bp.shape)))
            return out

        params = (wp,) if bp is None else (wp, bp)
        queue._enqueue(WTask("linear", queue._group_for_current_backward(), params,
                             (x2, g2), compute))  # fmt: skip
        return gx, None, None, None, None, None, None


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                shape: list[int], eps: float, anchor: torch.Tensor, queue: WeightGradQueue,
                params: tuple[nn.Parameter, nn.Parameter | None]) -> torch.Tensor:  # fmt: skip
        out, mean, rstd = torch.ops.aten.native_layer_norm(x, shape, w, b, eps)
        ctx.save_for_backward(x, w, b, mean, rstd)
        ctx.shape, ctx.queue, (ctx.w_param, ctx.b_param) = shape, queue, params
        return out  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w, b, mean, rstd = ctx.saved_tensors
        shape, wp, bp = ctx.shape, ctx.w_param, ctx.b_param
        queue: WeightGradQueue = ctx.queue
        need_x, has_b = bool(ctx.needs_input_grad[0]), bp is not None
        params = (wp,) if bp is None else (wp, bp)

        def pairs(gw: torch.Tensor, gb: torch.Tensor | None) -> GradPairs:
            return [(wp, gw)] if gb is None else [(wp, gw), (bp, gb)]

        if not queue.defer_norms:
            # One kernel for all three (plain backward's cost); W only folds the two vectors.
            gx, gw, gb = torch.ops.aten.native_layer_norm_backward(
                g, x, shape, mean, rstd, w, b, [need_x, True, has_b]
            )
            done = pairs(gw, gb)
            queue._enqueue(WTask("layer_norm", queue._group_for_current_backward(), params,
                                 tuple(t for _, t in done), lambda: done))  # fmt: skip
            return gx, None, None, None, None, None, None, None, None
        gx = None
        if need_x:
            gx = torch.ops.aten.native_layer_norm_backward(
                g, x, shape, mean, rstd, w, b, [True, False, False]
            )[0]

        def compute() -> GradPairs:
            _, gw, gb = torch.ops.aten.native_layer_norm_backward(
                g, x, shape, mean, rstd, w, b, [False, True, has_b]
            )
            return pairs(gw, gb)

        queue._enqueue(WTask("layer_norm", queue._group_for_current_backward(), params,
                             (x, mean, rstd, g), compute))  # fmt: skip
        return gx, None, None, None, None, None, None, None, None


class _Scale(torch.autograd.Function):
    """``x_hat * weight`` (RMSNorm's last step): grad-input now, ``sum g * x_hat`` later."""

    @staticmethod
    def forward(ctx: Any, x_hat: torch.Tensor, w: torch.Tensor, anchor: torch.Tensor,
                queue: WeightGradQueue, params: tuple[nn.Parameter]) -> torch.Tensor:  # fmt: skip
        ctx.save_for_backward(x_hat, w)
        ctx.queue, (ctx.w_param,) = queue, params
        return x_hat.mul(w)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_hat, w = ctx.saved_tensors
        wp = ctx.w_param
        gx = g * w if ctx.needs_input_grad[0] else None  # mul's backward for self
        queue: WeightGradQueue = ctx.queue

        def compute() -> GradPairs:
            return [(wp, (g * x_hat).sum_to_size(wp.shape))]

        if not queue.defer_norms:
            done = compute()  # a vector: hold it instead of the normalised input and g
            queue._enqueue(WTask("rms_norm", queue._group_for_current_backward(), (wp,),
                                 (done[0][1],), lambda: done))  # fmt: skip
        else:
            queue._enqueue(WTask("rms_norm", queue._group_for_current_backward(), (wp,),
                                 (x_hat, g), compute))  # fmt: skip
        return gx, None, None, None, None


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, idx: torch.Tensor, w: torch.Tensor, padding_idx: int,
                scale_grad_by_freq: bool, anchor: torch.Tensor, queue: WeightGradQueue,
                params: tuple[nn.Parameter]) -> torch.Tensor:  # fmt: skip
        ctx.save_for_backward(idx)
        ctx.num, ctx.pad, ctx.freq = w.shape[0], padding_idx, scale_grad_by_freq
        ctx.queue, (ctx.w_param,) = queue, params
        return torch.embedding(w, idx, padding_idx, scale_grad_by_freq, False)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (idx,) = ctx.saved_tensors
        num, pad, freq, wp = ctx.num, ctx.pad, ctx.freq, ctx.w_param
        queue: WeightGradQueue = ctx.queue

        def compute() -> GradPairs:
            return [(wp, torch.ops.aten.embedding_backward(g, idx, num, pad, freq, False))]

        queue._enqueue(WTask("embedding", queue._group_for_current_backward(), (wp,),
                             (idx, g), compute))  # fmt: skip
        return None, None, None, None, None, None, None


# --- interception ----------------------------------------------------------------------------
#
# The split replaces, for the context's duration, the ``forward`` of each ``nn.Linear``,
# ``nn.LayerNorm``, ``nn.RMSNorm`` and ``nn.Embedding`` (with their own forward, not a
# subclass's) by an instance attribute. A module's forward is what checkpointing recomputes
# inside the backward, so the recomputation goes through the split as long as the context
# encloses the backward. (A TorchFunctionMode would also see functional calls, but a mode is
# off while it handles a call, and ``Tensor.backward`` is such a call: the recomputation inside
# it would escape the mode.)


def _tracked(t: object) -> bool:
    return isinstance(t, nn.Parameter) and t.requires_grad and t.is_leaf


def _optional(t: object) -> bool:
    return t is None or _tracked(t)


def _linear_forward(
    m: nn.Linear, q: WeightGradQueue, bias: bool = True
) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        w, b = m.weight, (m.bias if bias else None)
        if (torch.is_grad_enabled() and x.dim() in (2, 3) and x.is_contiguous()
                and _tracked(w) and _optional(b)):  # fmt: skip
            return _Linear.apply(x, w.detach(), _detach(b), q.anchor, q, (w, b))  # type: ignore[no-any-return]
        q._count_not_deferred("linear")
        return F.linear(x, w, b)

    return forward


def _layer_norm_forward(m: nn.LayerNorm, q: WeightGradQueue) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        w, b = m.weight, m.bias
        if torch.is_grad_enabled() and _tracked(w) and _optional(b) and x.is_contiguous():
            return _LayerNorm.apply(x, w.detach(), _detach(b), list(m.normalized_shape), m.eps,
                                    q.anchor, q, (w, b))  # type: ignore[no-any-return]  # fmt: skip
        q._count_not_deferred("layer_norm")
        return F.layer_norm(x, m.normalized_shape, w, b, m.eps)

    return forward


def _rms_norm_forward(m: nn.RMSNorm, q: WeightGradQueue) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        w = m.weight
        if torch.is_grad_enabled() and _tracked(w):
            # torch's rms_norm multiplies the normalised input by the weight last: the same
            # normalisation without the weight, then the split multiply, gives the same bits.
            x_hat = F.rms_norm(x, m.normalized_shape, None, m.eps)
            return _Scale.apply(x_hat, w.detach(), q.anchor, q, (w,))  # type: ignore[no-any-return]
        q._count_not_deferred("rms_norm")
        return F.rms_norm(x, m.normalized_shape, w, m.eps)

    return forward


def _embedding_forward(m: nn.Embedding, q: WeightGradQueue) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(idx: torch.Tensor) -> torch.Tensor:
        w = m.weight
        if torch.is_grad_enabled() and _tracked(w) and m.max_norm is None and not m.sparse:
            pad = -1 if m.padding_idx is None else m.padding_idx
            return _Embedding.apply(idx, w.detach(), pad, m.scale_grad_by_freq, q.anchor,
                                    q, (w,))  # type: ignore[no-any-return]  # fmt: skip
        q._count_not_deferred("embedding")
        return F.embedding(idx, w, m.padding_idx, m.max_norm, m.norm_type,
                           m.scale_grad_by_freq, m.sparse)  # fmt: skip

    return forward


_SPLITS: dict[type[nn.Module], Callable[[Any, WeightGradQueue], Callable[..., torch.Tensor]]] = {
    nn.Linear: _linear_forward,
    nn.LayerNorm: _layer_norm_forward,
    nn.RMSNorm: _rms_norm_forward,
    nn.Embedding: _embedding_forward,
}


def register_linear(cls: type[nn.Module], *, bias: bool) -> None:
    """Split ``cls`` as a linear layer from now on: its ``forward(x)`` must compute exactly
    ``F.linear(x, self.weight, self.bias if bias else None)`` and nothing else, as a
    tensor-parallel shard of ``nn.Linear`` does (its collectives are outside it, and its
    weight gradient, ``g^T x`` on this rank's shard, needs none). ``bias=False`` for a layer
    whose ``bias`` is added elsewhere (after a reduction): that bias keeps torch's backward."""
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"register_linear: {cls!r} is not an nn.Module class")
    if cls is nn.Linear:
        raise ValueError("register_linear: nn.Linear is split already")
    _SPLITS[cls] = lambda m, q: _linear_forward(m, q, bias)


def splittable(m: nn.Module) -> bool:
    """Whether the split knows ``m``: a stock ``nn.Linear``/``LayerNorm``/``RMSNorm``/
    ``Embedding`` (or a class given to :func:`register_linear`) whose ``forward`` is not
    replaced on the instance."""
    return type(m) in _SPLITS and "forward" not in m.__dict__


@contextlib.contextmanager
def split_modules(
    modules: Iterable[tuple[str, nn.Module]], queue: WeightGradQueue
) -> Iterator[WeightGradQueue]:
    """Split exactly these ``(path, module)``s' backwards (the :func:`splittable` ones;
    others are skipped) into ``queue`` while the context is open. Their parameters that
    still get a gradient in the I pass are named (``path.name``) in
    ``queue.immediate_params`` and, if they also get W tasks, in ``queue.mixed_params``."""
    split = [(path, m) for path, m in modules if splittable(m)]
    watched = [
        (f"{path}.{n}" if path else n, p)
        for path, m in split
        for n, p in m.named_parameters(recurse=False)
        if p.requires_grad
    ]
    with _patched([m for _, m in split], watched, queue):
        yield queue


@contextlib.contextmanager
def deferred_weight_grads(
    module: nn.Module, queue: WeightGradQueue | None = None, defer_norms: bool = False
) -> Iterator[WeightGradQueue]:
    """Split the backwards run inside this context into input-grad now and queued W tasks.

    Applies to ``module``'s ``nn.Linear``, ``nn.LayerNorm``, ``nn.RMSNorm`` and ``nn.Embedding``
    submodules; every other parameter keeps torch's backward (its name is recorded in
    ``queue.immediate_params`` when it receives a gradient in the I pass). The context must
    enclose the forward and the backward (checkpointing recomputes inside the backward). W
    tasks stay queued when the context ends; run them with the queue's ``run*`` methods. Pass
    ``queue`` to keep queuing into an existing one. ``defer_norms``: see
    :attr:`WeightGradQueue.defer_norms`.
    """
    q = WeightGradQueue() if queue is None else queue
    q.defer_norms = defer_norms
    watched = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    with _patched([m for m in module.modules() if splittable(m)], watched, q):
        yield q


@contextlib.contextmanager
def _patched(
    modules: list[nn.Module], watched: list[tuple[str, nn.Parameter]], queue: WeightGradQueue
) -> Iterator[None]:
    """``modules``' forwards replaced by their split ones, and each ``watched`` parameter's
    I-pass gradient noted by name, while the context is open."""
    patched: list[nn.Module] = []
    hooks = []
    try:
        for m in modules:
            m.forward = _SPLITS[type(m)](m, queue)  # type: ignore[method-assign]
            patched.append(m)
        for name, p in watched:
            hooks.append(p.register_post_accumulate_grad_hook(
                lambda p, name=name: queue._note_immediate(p, name)))  # fmt: skip
        yield
    finally:
        for h in hooks:
            h.remove()
        for m in patched:
            del m.forward
