"""Gradient synchronisation inside one tensor-parallel group."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from smp_tp.group import ProcessGroup, tp_size
from smp_tp.params import param_spec


def sync_gradients(model: nn.Module, tp_group: ProcessGroup = None) -> None:
    """Make every gradient equal the unwrapped model's gradient on the TP group's batch.

    Call after ``loss.backward()`` where ``loss`` is the mean over this rank's samples
    (equal local batch sizes). Distributed shards and parameters replicated inside a TP
    region are scaled (by ``1/tp_size`` in scaled-batch mode; unchanged in prescaled mode,
    where every rank holds the same batch). Ordinary parameters are averaged over
    ``tp_group`` with one all-reduce per dtype; a parameter with no gradient on this rank
    counts as zero, and stays ``None`` only when it has none on every rank.
    """
    average: list[nn.Parameter] = []
    for p in model.parameters():
        spec = param_spec(p)
        if spec is not None and spec.kind != "dp_replicated":
            if p.grad is not None and spec.grad_scale != 1.0:
                p.grad.mul_(spec.grad_scale)
        elif p.requires_grad:
            average.append(p)
    size = tp_size(tp_group)
    if size == 1 or not average:
        return
    has = torch.tensor(
        [p.grad is not None for p in average], dtype=torch.float32, device=average[0].device
    )
    dist.all_reduce(has, group=tp_group)
    average = [p for p, h in zip(average, has.tolist()) if h > 0]
    by_dtype: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
    for p in average:
        by_dtype.setdefault((p.dtype, p.device), []).append(p)
    for params in by_dtype.values():
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        if any(g.is_sparse for g in grads):
            raise ValueError("sync_gradients: sparse gradients of replicated parameters are not supported")
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=tp_group)
        flat.div_(size)
        offset = 0
        for p in params:
            n = p.numel()
            view = flat[offset:offset + n].view_as(p)
            if p.grad is None:
                p.grad = view.clone()
            else:
                p.grad.copy_(view)
            offset += n
