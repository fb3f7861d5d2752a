"""Entering and leaving the tensor-parallel region of the transformer modules.

Inside a transformer region activations cover the whole TP group's batch and are either

* ``optimize="speed"``: replicated on every TP rank (all channels), or
* ``optimize="memory"``: split over channels (rank i holds channels ``i*h/T:(i+1)*h/T``), or
* ``optimize="speed", sequence_parallel=True``: this rank's own samples (between the column →
  row pairs; see :mod:`smp_tp.layers.sequence`).

Entering from per-rank samples (scaled batch) is an all-gather over samples (speed) or an
all-to-all from samples to channels (memory); with a prescaled (already replicated) input
it is nothing (speed) or taking the own channel slice (memory). Leaving is the reverse.
A stack of layers enters and leaves once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from smp_tp.layers.layernorm import sharded_layer_norm
from smp_tp.mappings import (
    allgather_no_grad,
    gather_replicated_for_tp,
    scatter_and_merge_for_tp,
    split_for_tp,
)
from smp_tp.module import DistributedModule
from smp_tp.params import ParamSpec, set_param_spec


def enter(x: torch.Tensor, m: DistributedModule) -> torch.Tensor:
    """Per-rank (or prescaled) activations → region layout."""
    g = m.tp_group
    if getattr(m, "sequence_parallel", False):  # own samples are the layout already
        return x
    if m.optimize == "speed":
        return gather_replicated_for_tp(x, 0, g) if m.scaled_batch else x
    return scatter_and_merge_for_tp(x, -1, 0, g) if m.scaled_batch else split_for_tp(x, -1, g)


def leave(x: torch.Tensor, m: DistributedModule) -> torch.Tensor:
    """Region layout → per-rank (or prescaled) activations."""
    g = m.tp_group
    if getattr(m, "sequence_parallel", False):
        return x
    if m.optimize == "speed":
        return split_for_tp(x, 0, g) if m.scaled_batch else x
    return scatter_and_merge_for_tp(x, 0, -1, g) if m.scaled_batch else gather_replicated_for_tp(x, -1, g)


def canonical_mask(mask: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """Bring an attention mask to 4-D ``(batch, 1 or heads, q, k)``.

    Boolean masks: True = attend. Floating masks of 4 or 3 dimensions are additive (as the
    Hugging Face "extended" masks). A 2-D ``(batch, k)`` mask is a padding mask, 1/True =
    attend, of any dtype.
    """
    if mask is None:
        return None
    if mask.dim() == 2:
        mask = mask.bool() if mask.dtype != torch.bool else mask
        mask = mask[:, None, None, :]
    elif mask.dim() == 3:
        mask = mask[:, None]
    elif mask.dim() != 4:
        raise ValueError(f"attention mask must have 2, 3 or 4 dimensions, got shape {tuple(mask.shape)}")
    if mask.shape[0] == 1 and batch != 1:
        mask = mask.expand(batch, *mask.shape[1:])
    return mask


def enter_mask(mask: torch.Tensor | None, batch: int, m: DistributedModule) -> torch.Tensor | None:
    """Masks are per sample: in scaled-batch mode gather every rank's masks."""
    mask = canonical_mask(mask, batch)
    if mask is None or not m.scaled_batch or m.tp_size == 1:
        return mask
    if mask.dtype == torch.bool:  # gloo cannot all-gather bool tensors
        return allgather_no_grad(mask.to(torch.uint8).contiguous(), 0, m.tp_group).bool()
    return allgather_no_grad(mask.contiguous(), 0, m.tp_group)


def affine(weight: torch.Tensor | None, bias: torch.Tensor | None) -> nn.Module:
    """A parameter container with ``weight``/``bias`` (gives state-dict keys like ``dense.weight``)."""
    c = nn.Module()
    c.register_parameter("weight", nn.Parameter(weight) if weight is not None else None)
    c.register_parameter("bias", nn.Parameter(bias) if bias is not None else None)
    return c


def region_layer_norm(x: torch.Tensor, ln: Any, eps: float, hidden: int, m: DistributedModule) -> torch.Tensor:
    """Layer norm inside the region: plain (speed) or from all-reduced moments (memory)."""
    if m.optimize == "memory":
        return sharded_layer_norm(x, ln.weight, ln.bias, eps, hidden, m.tp_group)
    return F.layer_norm(x, (hidden,), ln.weight, ln.bias, eps)


def mark(p: torch.Tensor, kind: str, dim: int | None, m: DistributedModule) -> None:
    """Explicitly classify a parameter (used where a partition context does not fit)."""
    scale = (1.0 / m.tp_size) if m.scaled_batch and kind != "dp_replicated" else 1.0
    set_param_spec(p, ParamSpec(kind, dim, scale, m.tp_group))


ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class RegionModule(DistributedModule):
    """A transformer module that can run alone (enter → body → leave) or inside a stack."""

    def forward_region(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        cross: torch.Tensor | None = None,
        cross_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cross_states: torch.Tensor | None = None,
        cross_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``hidden_states`` is ``(batch, seq, hidden)``: this rank's own samples (scaled
        batch) or the shared batch (prescaled). Masks: see :func:`canonical_mask`."""
        batch = hidden_states.shape[0]
        x = enter(hidden_states, self)
        mask = enter_mask(attention_mask, batch, self)
        cross = enter(cross_states, self) if cross_states is not None else None
        cmask = enter_mask(cross_mask, batch, self) if cross_states is not None else None
        return leave(self.forward_region(x, mask, cross, cmask), self)
