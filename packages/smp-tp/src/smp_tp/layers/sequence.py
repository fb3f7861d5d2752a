"""Sequence parallelism for the ``optimize="speed"`` transformer layout (Korthikanti et al.
2022, "Reducing Activation Recomputation in Large Transformer Models").

The speed layout keeps the activations *between* the column → row pairs — layer-norm inputs
and outputs, residuals, hidden-dropout masks — replicated on every TP rank. With
``sequence_parallel=True`` they stay split over rows instead: in scaled-batch mode a rank
keeps its *own samples* there (the layout its input already has, so entering and leaving a
stack costs nothing). Each column linear all-gathers its input over samples and each row
linear reduce-scatters its partial output back by sample — the volume of the all-reduce
they replace. The column linear saves only this rank's rows of its input and gathers them
again in backward for the weight gradient (:func:`gathered_linear`), so no gathered input
is stored either. Layer norms and the row linears' biases then act on this rank's samples:
they are ordinary data-parallel parameters (``dp_replicated``), averaged by
:func:`smp_tp.sync_gradients`.

Prescaled batches (every rank feeding the same samples) would split the sequence instead,
which needs the layer-norm gradients summed over the group; that is not implemented and
``sequence_parallel`` with ``prescaled_batch=True`` raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from smp_tp.group import ProcessGroup
from smp_tp.mappings import _all_gather, _reduce_scatter
from smp_tp.module import DistributedModule


def check_sequence_parallel(m: DistributedModule, sequence_parallel: bool) -> bool:
    """Validate the option for ``m``; whether it is in effect (speed layout only)."""
    if not sequence_parallel:
        return False
    if m.optimize != "speed":
        raise ValueError(f"{type(m).__name__}: sequence_parallel applies to optimize='speed' only "
                         f"(the memory layout already splits every activation)")
    if not m.scaled_batch:
        raise ValueError(f"{type(m).__name__}: sequence_parallel needs the scaled-batch mode "
                         f"(prescaled_batch=False)")
    return True


class _GatheredLinear(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, bias: torch.Tensor | None, group: ProcessGroup, *weights: torch.Tensor,
    ) -> torch.Tensor:
        full = _all_gather(x, 0, group, "forward")
        # the weights, not their concatenation, are saved: no copy of them lives until backward
        ctx.save_for_backward(x, *weights)
        ctx.group, ctx.has_bias = group, bias is not None
        return F.linear(full, _joined(weights), bias)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        x, *weights = ctx.saved_tensors
        weight = _joined(weights)
        # operands in the output's dtype: what autocast used in forward
        full = _all_gather(x, 0, ctx.group, "backward").to(g.dtype)
        g2 = g.reshape(-1, g.shape[-1])
        grad_x = _reduce_scatter(g.matmul(weight.to(g.dtype)), 0, ctx.group, "backward").to(x.dtype)
        grad_w = g2.t().matmul(full.reshape(-1, full.shape[-1])).to(weight.dtype)
        grad_b = g2.sum(0).to(weight.dtype) if ctx.has_bias else None
        grad_ws = grad_w.split([w.shape[0] for w in weights]) if len(weights) > 1 else (grad_w,)
        return (grad_x, grad_b, None, *grad_ws)


def _joined(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    return weights[0] if len(weights) == 1 else torch.cat(list(weights))


def gathered_linear(
    x: torch.Tensor, weight: torch.Tensor | Sequence[torch.Tensor], bias: torch.Tensor | None, group: ProcessGroup,
) -> torch.Tensor:
    """``F.linear(all_gather(x over samples), weight, bias)``, storing only this rank's ``x``.

    ``weight`` may be a sequence of weights stacked by output row (``[W_q; W_k; W_v]``): they
    are concatenated in forward and again in backward, so the concatenation is not kept.
    Backward: all-gather ``x`` again (weight gradient) and reduce-scatter the input gradient
    by sample. Collectives: forward 1 all-gather; backward 1 all-gather + 1 reduce-scatter.
    """
    weights = (weight,) if isinstance(weight, torch.Tensor) else tuple(weight)
    return _GatheredLinear.apply(x, bias, group, *weights)
