"""Expert parallelism for the routed experts of a Hugging Face (transformers 5) MoE block.

transformers 5 keeps the routed experts of Mixtral, Qwen2/3-MoE, DeepSeek-V3 and their
relatives in one module whose parameters are fused over experts: ``gate_up_proj`` of shape
``[E, 2 * I, H]`` (gate rows first, then up rows) and ``down_proj`` of shape ``[E, H, I]``.
The block calls it as ``experts(hidden_states [N, H], top_k_index [N, k], top_k_weights
[N, k])`` after its own router. :func:`distribute_experts` replaces only that module, so the
router (softmax, top-k, normalisation, DeepSeek's grouped routing and scaling) stays the
block's own code and stays replicated.

With an expert-parallel group of ``ep`` ranks, rank ``r`` keeps the ``E / ep`` consecutive
experts ``r * E/ep : (r + 1) * E/ep`` as slices of the fused tensors, under the original
parameter names. Every rank routes its *own* tokens; a forward is

1. one ``all_to_all_single`` of the per-expert token counts (so each rank knows what it
   will receive, and from whom),
2. one ``all_to_all_single`` of the token rows to the ranks owning their experts,
3. the local experts over the received rows (a loop over experts, or one grouped matmul),
4. one ``all_to_all_single`` of the results back to the tokens' ranks,
5. the routing weights applied and the ``k`` results per token summed on the token's rank,
   in the order and arithmetic of the original module's implementation (see ``combine``).

Backward runs the two data all-to-alls in reverse (:class:`_AllToAllV`). The routing
weights never leave their rank, so the router's gradient is the original's.

Gradients: an expert parameter on rank ``r`` receives the gradient of every token routed to
it from *any* rank of the group, i.e. the sum over the group's samples of the loss each rank
computes — what the unsplit model would get on the concatenated batch (per-rank losses
summed). Nothing is averaged here. When ranks outside the ep group hold the same experts
(data parallelism over ep groups), the caller (the umbrella's ``expert_parallel_degree``)
has to average the expert gradients over those ranks, and average the replicated parameters
(router, attention, shared experts) over every rank that holds them, as for any
data-parallel replica. This module does neither.

Capacity (``capacity_factor``, off by default): with ``capacity_factor=None`` no token is
ever dropped and the layer is exact. A float ``cf > 0`` bounds the rows any expert can get
from one rank, so a skewed router cannot make one expert's rank the straggler (or run out
of memory): each rank lets at most ``cap = ceil(cf * n_tok * k / E)`` of its own slots
(token, choice pairs) go to each expert and drops the rest *before* the all-to-all, so they
are never sent. Which slots stay is deterministic: the first ``cap`` in token order (lowest
token index first; a token's choices in top-k order). A dropped slot adds nothing to its
token's output, exactly as if its routing weight were 0: its expert gets no gradient from
it and its weight a zero gradient; the token's other choices still count and the block's
residual connection carries it on. This *changes results* (it is not the original model);
``dropped_slots`` holds how many slots this rank dropped in the last forward.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from smp_tp.group import ProcessGroup, tp_rank, tp_size
from smp_tp.mappings import _all_gather, _count

Combine = Literal["auto", "expert_order", "slot_sum"]


# ----------------------------------------------------------------------------- all-to-all


def _exchange(
    x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: ProcessGroup, phase: str
) -> torch.Tensor:
    """Rows ``x[sum(send_splits[:j]) : ...]`` go to rank j; rows from rank i arrive in order."""
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    _count("all_to_all", phase)
    dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
    return out


class _AllToAllV(torch.autograd.Function):
    """Uneven all-to-all of rows; the backward is the same exchange with the splits swapped
    (exact adjoint: each row's gradient goes back to the rank that sent the row)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: ProcessGroup
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        return _exchange(x, send_splits, recv_splits, group, "forward")

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        send_splits, recv_splits = ctx.splits
        return _exchange(g, recv_splits, send_splits, ctx.group, "backward"), None, None, None


def all_to_all_rows(
    x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: ProcessGroup = None
) -> torch.Tensor:
    """Send ``send_splits[j]`` consecutive rows of ``x`` to rank ``j``; return the rows received
    (``recv_splits[i]`` from rank ``i``, in rank order). Differentiable: backward sends each
    row's gradient back to its sender."""
    return _AllToAllV.apply(x, list(send_splits), list(recv_splits), group)


def _grouped_mm_fn() -> Any:
    # torch 2.10+ has the public name; 2.9 only the private one. Both run on CPU in 2.13.
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


# ----------------------------------------------------------------------------- the module


class ExpertParallelExperts(nn.Module):
    """This rank's ``E / ep`` experts of a fused-experts module; call it as the original.

    Attributes keep the original's names (``gate_up_proj``, ``down_proj``, ``act_fn``,
    ``num_experts`` = all experts, ``hidden_dim``, ``intermediate_dim``) plus
    ``num_local_experts``, ``first_expert`` and ``ep_group``.

    ``combine`` decides how the ``k`` weighted expert outputs of a token are added, to
    reproduce the original bit for bit: ``"expert_order"`` is transformers' eager loop
    (a zero tensor, then one ``index_add_`` per expert in ascending expert id, in the hidden
    dtype); ``"slot_sum"`` is its ``grouped_mm``/``batched_mm`` implementation (weighted
    outputs in top-k slot order, ``.sum(dim=1)``, then cast). ``"auto"`` reads the original
    model config's ``_experts_implementation`` at every call (``None``/``"eager"`` →
    expert order, anything else → slot sum), so it follows ``set_experts_implementation``.

    ``grouped_mm=True`` computes the local experts with one ``torch.nn.functional.grouped_mm``
    per projection instead of a Python loop over experts.

    ``per_sender_gemm=True`` multiplies the rows each rank sent to an expert separately (ep
    GEMMs per expert instead of one), in the original's row order. A CPU GEMM's row result
    depends on how many rows it is given (MKL/oneDNN pick kernels and blockings by shape;
    one row takes a GEMV), so only this reproduces the original forward bit for bit;
    batching every sender's rows into one GEMM, the default, agrees to float32 rounding.

    ``capacity_factor`` (``None``: nothing dropped, exact) caps the slots this rank sends to
    each expert at ``ceil(capacity_factor * n_tok * k / num_experts)``, keeping the first in
    token order (see the module docstring); ``dropped_slots`` counts the rest, last forward.
    """

    def __init__(
        self,
        gate_up_proj: torch.Tensor,
        down_proj: torch.Tensor,
        act_fn: nn.Module,
        num_experts: int,
        first_expert: int,
        ep_group: ProcessGroup = None,
        combine: Combine = "auto",
        grouped_mm: bool = False,
        per_sender_gemm: bool = False,
        config: Any = None,
        capacity_factor: float | None = None,
    ) -> None:
        super().__init__()
        _check_capacity_factor(capacity_factor)
        if combine not in ("auto", "expert_order", "slot_sum"):
            raise ValueError(f"combine must be 'auto', 'expert_order' or 'slot_sum', not {combine!r}")
        if grouped_mm and _grouped_mm_fn() is None:
            raise RuntimeError(f"grouped_mm=True needs torch.nn.functional.grouped_mm (torch {torch.__version__})")
        self.gate_up_proj = nn.Parameter(gate_up_proj)
        self.down_proj = nn.Parameter(down_proj)
        self.act_fn = act_fn
        self.num_experts = num_experts
        self.num_local_experts = gate_up_proj.shape[0]
        self.first_expert = first_expert
        self.hidden_dim = gate_up_proj.shape[2]
        self.intermediate_dim = down_proj.shape[2]
        self.ep_group = ep_group
        self.combine = combine
        self.grouped_mm = grouped_mm
        self.per_sender_gemm = per_sender_gemm
        self.capacity_factor = capacity_factor
        self.dropped_slots = 0  # this rank's slots over capacity in the last forward
        # Not a submodule: only read for "auto" (the model's config object, shared).
        self._config = config

    def extra_repr(self) -> str:
        return (
            f"experts {self.first_expert}..{self.first_expert + self.num_local_experts - 1} of "
            f"{self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}, "
            f"combine={self.combine}, grouped_mm={self.grouped_mm}, per_sender_gemm={self.per_sender_gemm}"
            + (f", capacity_factor={self.capacity_factor}" if self.capacity_factor is not None else "")
        )

    def _combine_mode(self) -> str:
        if self.combine != "auto":
            return self.combine
        impl = getattr(self._config, "_experts_implementation", None)
        return "expert_order" if impl in (None, "eager") else "slot_sum"

    # -- the local experts -------------------------------------------------------------

    def _run_experts(self, x: torch.Tensor, lens: list[int], expert_of: list[int]) -> torch.Tensor:
        """Consecutive row groups of ``x``: ``lens[g]`` rows for local expert ``expert_of[g]``."""
        if self.grouped_mm:
            gmm = _grouped_mm_fn()
            offs = torch.tensor(lens, device=x.device).cumsum(0).to(torch.int32)
            gate_up: torch.Tensor = self.gate_up_proj
            down: torch.Tensor = self.down_proj
            if expert_of != list(range(self.num_local_experts)):  # per-sender groups
                pick = torch.tensor(expert_of, device=x.device)
                gate_up, down = gate_up[pick], down[pick]
            gate, up = gmm(x, gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
            return gmm(self.act_fn(gate) * up, down.transpose(-2, -1), offs=offs)
        outs: list[torch.Tensor] = []
        for g, rows in enumerate(x.split(lens)):
            if rows.shape[0] == 0 and (outs or g < len(lens) - 1):
                continue  # as the original, an expert without tokens costs nothing ...
            # ... except when no group has rows: the (empty) output must still depend on the
            # parameters, or this rank's backward would skip the return all-to-all that the
            # other ranks' backward runs, and the group would hang.
            j = expert_of[g]
            gate, up = F.linear(rows, self.gate_up_proj[j]).chunk(2, dim=-1)
            outs.append(F.linear(self.act_fn(gate) * up, self.down_proj[j]))
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    # -- capacity ----------------------------------------------------------------------

    def _within_capacity(
        self, experts: torch.Tensor, counts: torch.Tensor, n_tok: int, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keep, kept counts)`` for the token-major slots ``experts`` (``counts`` their
        per-expert counts): a slot is kept when fewer than ``cap`` earlier slots (in token
        order) chose the same expert. Vectorised: a stable sort groups the slots by expert
        without changing their token order, and a slot's rank within its group is its
        position in the sorted list minus the group's start."""
        assert self.capacity_factor is not None
        cap = math.ceil(self.capacity_factor * n_tok * k / self.num_experts)
        by_expert = torch.argsort(experts, stable=True)
        group_start = counts.cumsum(0) - counts
        position = torch.empty_like(experts)
        position[by_expert] = torch.arange(experts.numel(), device=experts.device) - group_start[experts[by_expert]]
        keep = position < cap
        kept = counts.clamp(max=cap)
        self.dropped_slots = int((counts - kept).sum())
        return keep, kept

    # -- forward -----------------------------------------------------------------------

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        n_tok, k = top_k_index.shape
        ep, n_loc = tp_size(self.ep_group), self.num_local_experts
        experts = top_k_index.reshape(-1)  # slot s = token s // k, choice s % k
        mode = self._combine_mode()
        with torch.no_grad():
            # Slots sorted by expert, so the rows for rank j are one consecutive block, grouped
            # by j's local experts. Within an expert the rows keep the original's order, since
            # with several threads a GEMM row's result can depend on its position: the eager
            # loop takes them choice-major (torch.where over its [k, N] mask), grouped_mm in
            # the order of its own (unstable, but deterministic) torch.sort of the same ids.
            if mode == "expert_order":
                slots = torch.arange(experts.numel(), device=experts.device).view(n_tok, k).t().reshape(-1)
                order = slots[torch.argsort(experts[slots], stable=True)]
            else:
                order = torch.sort(experts)[1]
            counts = torch.bincount(experts, minlength=self.num_experts)
            if counts.numel() != self.num_experts:
                raise ValueError(f"expert index out of range: {int(experts.max())} >= {self.num_experts}")
            keep: torch.Tensor | None = None
            if self.capacity_factor is not None:
                keep, counts = self._within_capacity(experts, counts, n_tok, k)
                order = order[keep[order]]  # the kept slots, in the same order as above
            if ep > 1:
                # recv[i, j]: tokens rank i sends to my local expert j.
                recv = torch.empty_like(counts)
                _count("all_to_all", "forward")
                dist.all_to_all_single(recv, counts, group=self.ep_group)
            else:
                recv = counts
            recv = recv.view(ep, n_loc)
            send_splits = counts.view(ep, n_loc).sum(1).tolist()
            recv_splits = recv.sum(1).tolist()
            dev = experts.device
            if not self.per_sender_gemm:
                # Received rows are sender-major (rank 0's rows for experts 0..n_loc-1, then
                # rank 1's, ...); one GEMM per expert wants them expert-major. `perm` lists,
                # expert by expert and sender by sender, the received segments' rows.
                flat = recv.reshape(-1)
                seg_start = (flat.cumsum(0) - flat).view(ep, n_loc).t().reshape(-1)
                seg_len = recv.t().reshape(-1)
                out_start = seg_len.cumsum(0) - seg_len
                total = int(flat.sum())
                perm = torch.repeat_interleave(seg_start - out_start, seg_len) + torch.arange(total, device=dev)
                inv_perm = torch.empty_like(perm)
                inv_perm[perm] = torch.arange(total, device=dev)
            if keep is None:
                inv_order = torch.empty_like(order)
                inv_order[order] = torch.arange(order.numel(), device=dev)

        rows = hidden_states[order // k]
        if ep > 1:
            rows = all_to_all_rows(rows, send_splits, recv_splits, self.ep_group)
        if self.per_sender_gemm:  # received layout: sender-major groups, expert inner
            y = self._run_experts(rows, recv.reshape(-1).tolist(), list(range(n_loc)) * ep)
        else:
            y = self._run_experts(rows[perm], recv.sum(0).tolist(), list(range(n_loc)))[inv_perm]
        if ep > 1:
            y = all_to_all_rows(y, recv_splits, send_splits, self.ep_group)
        # Back in slot order; weights applied on the token's own rank (the same elementwise
        # product as the original, which dtype promotion included: fp32 weights stay fp32).
        if keep is None:
            y = y[inv_order]
        else:  # dropped slots: a zero row, so a zero contribution and a zero weight gradient
            y = y.new_zeros((experts.numel(), y.shape[-1])).index_copy(0, order, y)
        weighted = y * top_k_weights.reshape(-1, 1)
        if mode == "slot_sum":
            return weighted.view(n_tok, k, -1).sum(dim=1).to(hidden_states.dtype)
        # Eager original: out = 0, then out[t] += contribution of each expert, ascending id.
        by_expert = top_k_index.argsort(dim=1, stable=True)
        parts = weighted.view(n_tok, k, -1).gather(1, by_expert.unsqueeze(-1).expand(-1, -1, weighted.shape[-1]))
        out = torch.zeros_like(hidden_states)
        for j in range(k):
            out = out + parts[:, j].to(out.dtype)
        return out


# ----------------------------------------------------------------------------- conversion


def _check_capacity_factor(capacity_factor: float | None) -> None:
    # `not > 0` also refuses NaN.
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be None or > 0, not {capacity_factor!r}")


def _is_fused_experts(module: nn.Module) -> bool:
    gu, dn = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (
        isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor) and gu.dim() == 3 and dn.dim() == 3
        and isinstance(getattr(module, "num_experts", None), int) and hasattr(module, "act_fn")
    )


def distribute_experts(
    experts: nn.Module,
    ep_group: ProcessGroup = None,
    *,
    combine: Combine = "auto",
    grouped_mm: bool = False,
    per_sender_gemm: bool = False,
    capacity_factor: float | None = None,
) -> ExpertParallelExperts:
    """Build this rank's :class:`ExpertParallelExperts` from a transformers-5 fused experts
    module (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``), copying its slice of the
    weights. Every rank of ``ep_group`` must call it with the same module (same weights).

    ``capacity_factor`` (default ``None``: exact, nothing dropped) changes results: see
    :class:`ExpertParallelExperts` and the module docstring.

    Raises ``ValueError`` when the group's size does not divide the number of experts, for a
    ``capacity_factor`` that is not positive, and
    for layouts it does not reproduce (biases, transposed or interleaved weights, no gate,
    a post-expert norm, a custom gate function).
    """
    _check_capacity_factor(capacity_factor)
    if not _is_fused_experts(experts):
        raise ValueError(
            f"distribute_experts: {type(experts).__name__} is not a fused experts module "
            f"(3-D gate_up_proj and down_proj, num_experts, act_fn)"
        )
    unsupported = [
        a for a in ("has_bias", "is_transposed", "has_post_expert_norm") if getattr(experts, a, False)
    ] + [a for a in ("has_gate", "is_concatenated") if not getattr(experts, a, True)]
    gate_fn = getattr(type(experts), "_apply_gate", None)
    if gate_fn is not None and getattr(gate_fn, "__name__", "") != "_default_apply_gate":
        unsupported.append("_apply_gate")
    if unsupported:
        raise ValueError(f"distribute_experts: {type(experts).__name__} has unsupported {unsupported}")
    fused: Any = experts  # (its attributes are checked above: tensors and ints, not modules)
    num_experts, ep = int(fused.num_experts), tp_size(ep_group)
    if num_experts % ep:
        raise ValueError(
            f"distribute_experts: the expert-parallel degree {ep} does not divide the number "
            f"of experts {num_experts}"
        )
    n_loc = num_experts // ep
    first = tp_rank(ep_group) * n_loc
    with torch.no_grad():
        gate_up = fused.gate_up_proj[first:first + n_loc].clone()
        down = fused.down_proj[first:first + n_loc].clone()
    gate_up.requires_grad_(bool(fused.gate_up_proj.requires_grad))
    down.requires_grad_(bool(fused.down_proj.requires_grad))
    return ExpertParallelExperts(
        gate_up, down, fused.act_fn, num_experts, first, ep_group,
        combine=combine, grouped_mm=grouped_mm, per_sender_gemm=per_sender_gemm,
        config=getattr(experts, "config", None), capacity_factor=capacity_factor,
    )


def expert_parallelize(model: nn.Module, ep_group: ProcessGroup = None, **options: Any) -> int:
    """Replace, in place, every fused experts module inside ``model`` (not ``model`` itself)
    with :func:`distribute_experts` (``options``: its keyword arguments, ``capacity_factor``
    included); return how many were replaced."""
    targets = [
        (name, m) for name, m in model.named_modules()
        if name and _is_fused_experts(m) and not isinstance(m, ExpertParallelExperts)
    ]
    for name, m in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, distribute_experts(m, ep_group, **options))
    return len(targets)


def _gather_experts(module: nn.Module, grads: bool) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, m in module.named_modules():
        if not isinstance(m, ExpertParallelExperts):
            continue
        for pname in ("gate_up_proj", "down_proj"):
            p = getattr(m, pname)
            t = p.detach() if not grads else (p.grad if p.grad is not None else torch.zeros_like(p))
            # Ranks hold consecutive expert blocks in rank order: gathering along dim 0 in
            # group-rank order rebuilds [E, ...].
            out[f"{name}.{pname}" if name else pname] = _all_gather(t, 0, m.ep_group, "forward")
    return out


def full_expert_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The full ``[E, ...]`` expert tensors of every :class:`ExpertParallelExperts` in
    ``module`` (itself included), under the keys the original model's ``state_dict()``
    uses for them (``"gate_up_proj"``/``"down_proj"`` for an experts module itself). A
    collective: every rank of each ep group must call it."""
    return _gather_experts(module, grads=False)


def full_expert_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    """As :func:`full_expert_state` for the gradients (zeros for an expert without one)."""
    return _gather_experts(module, grads=True)


__all__ = [
    "ExpertParallelExperts", "distribute_experts", "expert_parallelize",
    "full_expert_state", "full_expert_grads", "all_to_all_rows",
]
