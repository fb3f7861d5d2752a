"""Collectives over the tensor-parallel group as autograd functions (paper Appendix I.6).

Each function is a forward/backward pair. Two conventions are used, and each function says
which one it follows:

* **exact adjoint** — the backward is the transpose of the forward across ranks, for an
  objective that is the *sum* of every rank's loss. All-gather pairs with reduce-scatter,
  all-to-all with the reverse all-to-all, all-reduce with all-reduce.
* **replicated** (Megatron) — a tensor that is identical on every rank is one logical
  tensor whose gradient is also identical on every rank. ``fwd_allreduce_for_tp``
  (all-reduce forward, identity backward), ``bwd_allreduce_for_tp`` (identity forward,
  all-reduce backward), ``gather_replicated_for_tp`` (all-gather forward, take own slice
  backward) and ``split_for_tp`` (take own slice forward, all-gather backward).

Every collective that really runs is counted (see :func:`collective_counts`) so tests can
check the communication pattern of a layer against the paper's Appendix F.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from smp_tp.group import ProcessGroup, tp_rank, tp_size

# ----------------------------------------------------------------------------- counting


@dataclass
class CollectiveCounts:
    """Number of collectives run, by phase (``forward``/``backward``) and kind."""

    forward: Counter[str] = field(default_factory=Counter)
    backward: Counter[str] = field(default_factory=Counter)

    def total(self) -> dict[str, dict[str, int]]:
        """Plain-dict snapshot, convenient for printing and comparing."""
        return {"forward": dict(self.forward), "backward": dict(self.backward)}


_active: list[CollectiveCounts] = []
_lock = threading.Lock()


@contextmanager
def collective_counts() -> Iterator[CollectiveCounts]:
    """Count every tensor-parallel collective run (by any thread) inside the block."""
    counts = CollectiveCounts()
    with _lock:
        _active.append(counts)
    try:
        yield counts
    finally:
        with _lock:
            _active.remove(counts)


def _count(kind: str, phase: str) -> None:
    if not _active:
        return
    with _lock:
        for c in _active:
            getattr(c, phase)[kind] += 1


# ------------------------------------------------------------------- raw collectives
# torch 2.13 renamed the flat-tensor collectives (the old names warn); older torch has only
# the old names.
_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# These take a phase label only for counting. With one rank they are the identity.


_check_shapes = os.environ.get("SMP_TP_CHECK_SHAPES", "") not in ("", "0")


def set_shape_checks(enabled: bool) -> None:
    """Verify before every collective that all TP ranks pass the same shape and dtype.

    Costs one small all-gather per collective; turns a mismatch (e.g. different batch sizes
    on TP ranks in scaled-batch mode), which would otherwise abort or hang inside the
    backend, into a ``ValueError`` on every rank naming the ranks and shapes. Also enabled
    by the environment variable ``SMP_TP_CHECK_SHAPES=1``.
    """
    global _check_shapes
    _check_shapes = bool(enabled)


def _verify_same_shape(x: torch.Tensor, group: ProcessGroup, what: str) -> None:
    if not _check_shapes:
        return
    size = tp_size(group)
    code = [x.dim(), *x.shape, *([0] * (8 - x.dim())), _DTYPES.index(x.dtype) if x.dtype in _DTYPES else -1]
    mine = torch.tensor(code[:10], dtype=torch.int64, device=x.device)
    every = torch.empty(size * mine.numel(), dtype=torch.int64, device=x.device)
    _gather_flat(every, mine, group=group)
    rows = every.view(size, -1).tolist()
    if any(r != rows[0] for r in rows):
        desc = ", ".join(f"rank {i}: {tuple(r[1:1 + r[0]])}" for i, r in enumerate(rows))
        raise ValueError(
            f"smp_tp {what}: tensor-parallel ranks passed different shapes or dtypes ({desc}); "
            f"in scaled-batch mode every TP rank must feed the same number of samples"
        )


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8]


def _all_reduce(
    x: torch.Tensor, group: ProcessGroup, phase: str, op: Any = dist.ReduceOp.SUM
) -> torch.Tensor:
    if tp_size(group) == 1:
        return x
    _verify_same_shape(x, group, "all_reduce")
    out = x.contiguous().clone()
    _count("all_reduce", phase)
    dist.all_reduce(out, op=op, group=group)
    return out


def _all_gather(x: torch.Tensor, dim: int, group: ProcessGroup, phase: str) -> torch.Tensor:
    size = tp_size(group)
    if size == 1:
        return x
    dim = dim % x.dim()
    _verify_same_shape(x, group, "all_gather")
    src = x.movedim(dim, 0).contiguous()
    out = torch.empty((size * src.shape[0], *src.shape[1:]), dtype=x.dtype, device=x.device)
    _count("all_gather", phase)
    _gather_flat(out, src, group=group)
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group: ProcessGroup, phase: str) -> torch.Tensor:
    size = tp_size(group)
    if size == 1:
        return x
    dim = dim % x.dim()
    if x.shape[dim] % size:
        raise ValueError(
            f"reduce_scatter_for_tp: dimension {dim} of size {x.shape[dim]} is not divisible "
            f"by the tensor-parallel degree {size}"
        )
    _verify_same_shape(x, group, "reduce_scatter")
    src = x.movedim(dim, 0).contiguous()
    out = torch.empty((src.shape[0] // size, *src.shape[1:]), dtype=x.dtype, device=x.device)
    _count("reduce_scatter", phase)
    _reduce_scatter_flat(out, src, group=group)
    return out.movedim(0, dim)


def _all_to_all(
    x: torch.Tensor, split_dim: int, merge_dim: int, group: ProcessGroup, phase: str
) -> torch.Tensor:
    size = tp_size(group)
    if size == 1:
        return x
    split_dim, merge_dim = split_dim % x.dim(), merge_dim % x.dim()
    if x.shape[split_dim] % size:
        raise ValueError(
            f"scatter_and_merge_for_tp: dimension {split_dim} of size {x.shape[split_dim]} is "
            f"not divisible by the tensor-parallel degree {size}"
        )
    _verify_same_shape(x, group, "all_to_all")
    src = x.movedim(split_dim, 0).contiguous()  # chunk j of dim 0 goes to rank j
    out = torch.empty_like(src)
    _count("all_to_all", phase)
    dist.all_to_all_single(out, src, group=group)
    # Block i of ``out`` came from rank i; put each back in the original layout, then
    # concatenate the blocks along merge_dim in sender order.
    blocks = [b.movedim(0, split_dim) for b in out.chunk(size, 0)]
    return torch.cat(blocks, dim=merge_dim)


def _own_slice(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    size = tp_size(group)
    if size == 1:
        return x
    if x.shape[dim] % size:
        raise ValueError(
            f"split_for_tp: dimension {dim} of size {x.shape[dim]} is not divisible by the "
            f"tensor-parallel degree {size}"
        )
    return x.chunk(size, dim)[tp_rank(group)].contiguous()


# ------------------------------------------------------------------- autograd pairs


class _FwdAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        return _all_reduce(x, group, "forward")

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return g, None


class _BwdAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return _all_reduce(g, ctx.group, "backward"), None


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _all_reduce(x, group, "forward")

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return _all_reduce(g, ctx.group, "backward"), None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group, "forward")

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return _reduce_scatter(g, ctx.dim, ctx.group, "backward"), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group, "forward")

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return _all_gather(g, ctx.dim, ctx.group, "backward"), None, None


class _ScatterAndMerge(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, split_dim: int, merge_dim: int, group: ProcessGroup
    ) -> torch.Tensor:
        ctx.dims, ctx.group = (split_dim, merge_dim), group
        return _all_to_all(x, split_dim, merge_dim, group, "forward")

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        split_dim, merge_dim = ctx.dims
        return _all_to_all(g, merge_dim, split_dim, ctx.group, "backward"), None, None, None


class _GatherReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group, "forward")

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return _own_slice(g, ctx.dim, ctx.group), None, None


class _SplitReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _own_slice(x, dim, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return _all_gather(g, ctx.dim, ctx.group, "backward"), None, None


# ------------------------------------------------------------------- public API


def fwd_allreduce_for_tp(tensor: torch.Tensor, tp_group: ProcessGroup = None) -> torch.Tensor:
    """All-reduce (sum) in forward; identity in backward (replicated convention, Megatron's g)."""
    return _FwdAllReduce.apply(tensor, tp_group)


def bwd_allreduce_for_tp(tensor: torch.Tensor, tp_group: ProcessGroup = None) -> torch.Tensor:
    """Identity in forward; all-reduce of the gradient in backward (Megatron's f)."""
    return _BwdAllReduce.apply(tensor, tp_group)


def allreduce_for_tp(tensor: torch.Tensor, tp_group: ProcessGroup = None) -> torch.Tensor:
    """All-reduce in forward and backward (exact adjoint: every rank uses the sum)."""
    return _AllReduceSum.apply(tensor, tp_group)


def fused_allgather_for_tp(
    tensor: torch.Tensor, dim: int, tp_group: ProcessGroup = None
) -> torch.Tensor:
    """All-gather across the group, concatenated along ``dim``; backward reduce-scatters."""
    return _AllGather.apply(tensor, dim, tp_group)


def reduce_scatter_for_tp(
    tensor: torch.Tensor, dim: int, tp_group: ProcessGroup = None
) -> torch.Tensor:
    """Sum across the group, rank i keeps slice i along ``dim``; backward all-gathers."""
    return _ReduceScatter.apply(tensor, dim, tp_group)


def scatter_and_merge_for_tp(
    tensor: torch.Tensor, split_dim: int, merge_dim: int, tp_group: ProcessGroup = None
) -> torch.Tensor:
    """Split along ``split_dim``, all-to-all (slice j to rank j), concatenate along ``merge_dim``.

    The received slices are concatenated in sender-rank order. Backward is the reverse
    all-to-all. ``split_dim=-1, merge_dim=0`` turns "own samples, all channels" into "all
    samples, own channels"; ``split_dim=0, merge_dim=-1`` turns it back.
    """
    return _ScatterAndMerge.apply(tensor, split_dim, merge_dim, tp_group)


all_to_all_for_tp = scatter_and_merge_for_tp


def gather_replicated_for_tp(
    tensor: torch.Tensor, dim: int, tp_group: ProcessGroup = None
) -> torch.Tensor:
    """All-gather along ``dim`` into a replicated tensor; backward keeps this rank's slice."""
    return _GatherReplicated.apply(tensor, dim, tp_group)


def split_for_tp(tensor: torch.Tensor, dim: int, tp_group: ProcessGroup = None) -> torch.Tensor:
    """Keep this rank's slice of a replicated tensor along ``dim``; backward all-gathers."""
    return _SplitReplicated.apply(tensor, dim, tp_group)


def allgather_no_grad(tensor: torch.Tensor, dim: int, tp_group: ProcessGroup = None) -> torch.Tensor:
    """All-gather of a tensor that needs no gradient (indices, masks)."""
    return _all_gather(tensor, dim, tp_group, "forward")
