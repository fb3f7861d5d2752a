"""Selective activation recomputation for ``optimize="memory"`` (Korthikanti et al. 2022).

The memory layout already holds every activation once across the TP group; these autograd
functions go further by keeping, for backward, only tensors that are cheap to turn back into
what backward needs:

* :func:`recomputed_linear` computes ``F.linear(fn(*inputs), weight)`` keeping only the
  inputs, the weight and ``fn``'s dropout masks as bits (:class:`~smp_tp.random.MaskTape`).
  For the attention block ``fn`` is the attention core (scores, softmax, dropout,
  probabilities times values), so neither the ``(batch, heads, seq, seq)`` float tensors
  nor the context fed to the output projection are stored, only one bit per score; backward
  replays ``fn`` with the very same masks (unpacked, not redrawn: redrawing was the dearest
  step of the replay on CPU), so the gradients equal those of the plain computation.
* :func:`activation_linear` (``fn`` = the MLP activation) saves the pre-activation only.
* :func:`regenerated_dropout` saves the generator state instead of the mask.

None of them runs a collective, so the per-layer communication is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from smp_tp.random import MaskTape, dropout_mask, get_generator, tp_dropout

Generator = torch.Generator | None


def _replay(gen: Generator, state: torch.Tensor | None) -> Generator:
    """A fresh generator in the saved state (the live one has moved on since)."""
    if gen is None or state is None:
        return None
    copy = torch.Generator(device=gen.device)
    copy.set_state(state)
    return copy


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


class _RecomputedLinear(torch.autograd.Function):
    """``F.linear(fn(tape, *inputs), weight)`` keeping only ``inputs``, ``weight`` and the
    dropout masks ``fn`` drew (bits) for backward; ``fn``'s output and intermediates are
    recomputed.

    The two products of the linear's backward are formed as autograd forms them for
    ``F.linear`` (``dh = g @ W``, ``dW = g.T @ h`` on 2-D views), and ``fn`` is replayed
    under the autocast state and with the masks of the forward, so the gradients equal those
    of the plain computation.
    """

    @staticmethod
    def forward(ctx: Any, fn: Callable[..., torch.Tensor], gen: Generator, weight: torch.Tensor,
                *inputs: Any) -> torch.Tensor:
        ctx.fn, ctx.device_type = fn, weight.device.type
        ctx.autocast = _autocast_state(weight.device.type)
        tape = None if gen is None else MaskTape(gen)
        out = F.linear(fn(tape, *inputs).to(weight.dtype), weight)
        bits = [] if tape is None else tape.bits
        ctx.masks = None if tape is None else len(bits)
        # saved tensors (not ctx attributes), so saved-tensor hooks (offloading) see the bits
        ctx.save_for_backward(weight, *bits, *inputs)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        weight, *rest = ctx.saved_tensors
        masks = ctx.masks or 0
        tape = None if ctx.masks is None else MaskTape(None, rest[:masks])
        inputs = rest[masks:]
        needs = ctx.needs_input_grad[3:]
        leaves = [
            t.detach().requires_grad_(need) if isinstance(t, torch.Tensor) else t
            for t, need in zip(inputs, needs)
        ]
        enabled, dtype = ctx.autocast
        with torch.enable_grad(), torch.autocast(ctx.device_type, dtype=dtype, enabled=enabled):
            h = ctx.fn(tape, *leaves).to(weight.dtype)
        g2, h2 = grad.reshape(-1, grad.shape[-1]), h.detach().reshape(-1, h.shape[-1])
        dweight = _weight_grad(g2, h2, weight) if ctx.needs_input_grad[2] else None
        wanted = [t for t, need in zip(leaves, needs) if need]
        dh = _input_grad(g2, h2, weight).reshape(h.shape)
        grads = iter(torch.autograd.grad(h, wanted, dh) if wanted else ())
        return (None, None, dweight, *(next(grads) if need else None for need in needs))


# ``F.linear(h, W)`` on a 3-D ``h`` is ``h2 @ W.t()`` on a 2-D view ``h2``; autograd's
# matrix-product backward picks the operand order by the operands' memory layout, and so
# do these two, so that the rounding is the same as on the plain path.


def _column_major(m: torch.Tensor) -> bool:
    return m.stride(0) == 1 and m.stride(1) == m.shape[0]


def _input_grad(g2: torch.Tensor, h2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight.t().mm(g2.t()).t() if _column_major(h2) else g2.mm(weight)


def _weight_grad(g2: torch.Tensor, h2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return g2.t().mm(h2) if _column_major(weight.t()) else h2.t().mm(g2).t()


def recomputed_linear(
    fn: Callable[..., torch.Tensor], gen: Generator, weight: torch.Tensor, *inputs: Any
) -> torch.Tensor:
    """``F.linear(fn(gen, *inputs), weight)``, with ``fn`` recomputed in backward.

    ``fn(tape, *inputs)`` must be local (no collective) and draw all its randomness as
    dropout masks through ``tape`` (passed to :func:`~smp_tp.random.tp_dropout` as its
    ``generator``: a :class:`~smp_tp.random.MaskTape` over ``gen``, or None when ``gen`` is
    None); tensor ``inputs`` and ``weight`` are saved, ``None`` inputs passed through.
    Under autocast the product runs in the autocast dtype, as ``F.linear`` would.
    """
    device_type = weight.device.type
    if torch.is_autocast_enabled(device_type):
        weight = weight.to(torch.get_autocast_dtype(device_type))
    return _RecomputedLinear.apply(fn, gen, weight, *inputs)


def _no_gen(act: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., torch.Tensor]:
    return lambda gen, pre: act(pre)


def activation_linear(pre: torch.Tensor, weight: torch.Tensor, act: Callable) -> torch.Tensor:
    """``F.linear(act(pre), weight)`` storing ``pre`` instead of ``act(pre)`` for backward."""
    return recomputed_linear(_no_gen(act), None, weight, pre)


class _RegeneratedDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, p: float, gen: torch.Generator) -> torch.Tensor:
        ctx.p, ctx.gen, ctx.shape = p, gen, x.shape
        ctx.save_for_backward(gen.get_state())
        return x * dropout_mask(x, p, gen) * (1.0 / (1.0 - p))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        (state,) = ctx.saved_tensors
        keep = dropout_mask(grad.new_empty(ctx.shape), ctx.p, _replay(ctx.gen, state))
        # the same two products, in the order autograd applies them to ``x * keep * scale``
        return grad * (1.0 / (1.0 - ctx.p)) * keep, None, None


def regenerated_dropout(x: torch.Tensor, p: float, gen: torch.Generator) -> torch.Tensor:
    """Inverted dropout whose mask is redrawn in backward from the saved generator state."""
    return _RegeneratedDropout.apply(x, p, gen)


def memory_dropout(
    x: torch.Tensor, p: float, training: bool, regenerate: bool, tp_group: Any = None
) -> torch.Tensor:
    """Dropout of a channel-sharded activation (``"tp_rank"`` stream) in the memory layout;
    with ``regenerate`` and autograd recording, the mask is redrawn in backward, not saved."""
    if regenerate and training and 0.0 < p < 1.0 and torch.is_grad_enabled() and x.requires_grad:
        return regenerated_dropout(x, p, get_generator(x.device, "tp_rank", tp_group))
    return tp_dropout(x, p, training, "tp_rank", tp_group)
