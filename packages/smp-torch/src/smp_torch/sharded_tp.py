"""Sharded data parallelism with tensor parallelism: the gradient rules FSDP2 does not know.

With ``tensor_parallel_degree`` > 1, each rank's parameters (its tensor-parallel slices and
the parameters every tensor-parallel rank holds alike) are sharded by FSDP2 over the ranks
holding the same parameters, the reduced data-parallel group (:func:`smp_torch.sharded._mesh`).
FSDP2's reduce-scatter averages a gradient over that group. The non-sharded reducer
(:meth:`smp_torch.model.DistributedModel._build_reducer`) averages each parameter over its
own group instead, and :class:`TPShardedGrads` turns the first into the second at the end of
the step, on the local shards:

- a parameter that is *distributed* (a tensor-parallel slice, or a parameter replicated
  inside a tensor-parallel region: its gradient already covers the whole tensor-parallel
  group's batch) is averaged over the reduced data-parallel group and scaled by smp-tp's
  ``grad_scale``: FSDP2's average times ``grad_scale``;
- any other parameter saw only this rank's samples, and is averaged over the whole
  data-parallel group (reduced data-parallel × tensor-parallel): FSDP2's average is summed
  over the tensor-parallel group and divided by its size. Tensor-parallel peers hold the
  same shard of such a parameter (their reduced data-parallel groups are cut alike), so the
  shards add up element by element.

Both steps are linear, so applying them once to the accumulated gradient (after every
microbatch's reduce-scatter) equals applying them per microbatch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from smp_torch import tp_glue
from smp_torch.sharded import local_tensor

__all__ = ["TPShardedGrads"]


class TPShardedGrads:
    """The end-of-step gradient correction for sharded data × tensor parallelism (see the
    module docstring).

    Args:
        params: this rank's trainable parameters (FSDP2's DTensor parameters, carrying
            smp-tp's spec).
        tp_group: the tensor-parallel ``torch.distributed`` group.
        tp_size: its size.
        wait: waits for one launched collective (smp's raises if a peer failed meanwhile).
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        tp_group: Any,
        tp_size: int,
        wait: Callable[[Any], None],
    ) -> None:
        self._scaled = [(p, tp_glue.grad_scale(p)) for p in params if tp_glue.is_distributed(p)]
        self._averaged = [p for p in params if not tp_glue.is_distributed(p)]
        self._group = tp_group
        self._size = tp_size
        self._wait = wait

    def finish(self) -> None:
        """Collective over the tensor-parallel group: correct every local gradient shard."""
        with torch.no_grad():
            for p, scale in self._scaled:
                if p.grad is not None and scale != 1.0:
                    local_tensor(p.grad).mul_(scale)
            by_kind: dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
            for p in self._averaged:
                local = local_tensor(p)
                by_kind.setdefault((local.dtype, local.device), []).append(p)
            # One all-reduce per dtype, in parameter order (the same on every TP rank); a flag
            # per parameter keeps a gradient that is None on every rank None.
            for (dtype, device), ps in sorted(by_kind.items(), key=lambda kv: str(kv[0])):
                parts: list[torch.Tensor] = []
                for p in ps:
                    g = p.grad
                    local = local_tensor(p)
                    parts.append(
                        local_tensor(g).reshape(-1)
                        if g is not None
                        else torch.zeros(local.numel(), dtype=dtype, device=device)
                    )
                # On the group's device (NCCL takes no host tensor), filled there: no copy from
                # the host. The read of ``flat``'s flags below is this step's one sync per dtype.
                flags = torch.ones(len(ps), dtype=dtype, device=device)
                for i, p in enumerate(ps):
                    if p.grad is None:
                        flags[i] = 0.0
                flat = torch.cat([*parts, flags])
                self._wait(dist.all_reduce(flat, group=self._group, async_op=True))
                offset = 0
                for p, has in zip(ps, flat[flat.numel() - len(ps) :].tolist()):
                    n = local_tensor(p).numel()
                    if p.grad is None and has > 0:
                        # Only a peer's data reached it (a data-dependent branch): the sum is
                        # the peers' (this rank sent zeros), as the non-sharded reducer does.
                        p.grad = torch.zeros_like(p.detach())
                    if p.grad is not None:
                        local_tensor(p.grad).copy_(flat[offset : offset + n].view_as(local_tensor(p.grad)))
                        local_tensor(p.grad).div_(self._size)
                    offset += n
