"""Sharded data parallelism (``sharded_data_parallel_degree``) on FSDP2's ``fully_shard``.

Each rank of a *sharding group* (``sharded_data_parallel_degree`` consecutive members of the
data-parallel group) keeps 1/N of every parameter, of its gradient and of its optimizer state.
PyTorch's FSDP2 (:func:`torch.distributed.fsdp.fully_shard`) does the sharding, the
all-gather before a unit runs, the freeing after it and the gradient reduce-scatter; smp adds
what FSDP2 leaves to its user:

- **Shard units from the module tree** (:func:`choose_units`): bottom-up, a module becomes its
  own unit (one all-gather, one reduce-scatter) once the parameters it would hold reach
  ``sdp_param_persistence_threshold``; smaller modules stay with their parent, and whatever is
  left goes to the root's unit. A small child is made a unit of its own anyway when keeping it
  would make its parent's unit larger than ``sdp_reduce_bucket_size`` (the largest gradient
  reduce-scatter smp asks of FSDP2, in elements). A parameter shared by several modules (a
  tied embedding and head) stays in the unit of their common ancestor, as FSDP2 requires.
  A container that is never called itself (``nn.ModuleList``, ``nn.ModuleDict``) is no
  unit: its hooks would never run.
- **A bound on gathered parameters** (:func:`prefetch_plan`): ``sdp_max_live_parameters`` is
  mapped to FSDP2's explicit prefetch lists: a unit prefetches the next units (forward order,
  reversed in backward; at most two) only while the root unit, itself and the prefetched
  units hold at most that many elements. FSDP2 itself always prefetches one unit in backward
  (an empty list means its default), so the bound can be exceeded by that one unit. On CPU
  no explicit prefetch is set: FSDP2's all-gathers block there, so prefetching cannot overlap.
- **With tensor parallelism** the sharding groups are cut from the ranks holding the same
  tensor-parallel slice (the reduced data-parallel group); smp-tp's distributed modules stay
  whole in one unit and their parameters keep smp-tp's spec; the gradient rules FSDP2 does
  not know are in :mod:`smp_torch.sharded_tp`.
- **Data parallelism beyond the sharding group**: when the data-parallel degree is a multiple
  of the sharding degree, the mesh is 2-D (replicate × shard, FSDP2's HSDP): shards are
  reduce-scattered within a sharding group and all-reduced across groups.
- **Hierarchical all-gather** (``sdp_hierarchical_allgather``): non-root units are resharded
  after forward to the sharding-group ranks on this node (FSDP2's integer
  ``reshard_after_forward``), so the backward all-gather stays inside a node. Where the whole
  sharding group is on one node (or its nodes are not contiguous in it) there is no
  cross-node gather to avoid and units reshard fully, as without the key.
- **Data-dependent branches** (:mod:`smp_torch.sharded_agree`): a parameter with a gradient
  on some data-parallel ranks only joins the reduce-scatter with zeros elsewhere (exact); a
  unit that runs on some ranks only raises on every rank, naming it, before FSDP2's
  collectives could mismatch (each unit's all-gathers and reductions are agreed on first).
- **Exact whole-model gradient norm over shards** (:func:`clip_grad_norm`): each rank sums the
  squares of its shards in float64 and the sums are all-reduced over the sharding group.
- **Full state dicts**: :func:`full_state` all-gathers every sharded tensor, :func:`load_full`
  slices a full tensor into this rank's shard (no communication), so checkpoints stay in the
  unwrapped model's layout-free form and resume onto any sharding degree or plain data
  parallelism.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

# FSDP2 and DTensor are imported where sharding starts, not here: ``torch.distributed.tensor``
# takes about 0.6 s to import (half of what smp adds to ``import torch``), which every process
# of a job without sharded data parallelism would pay. No DTensor exists before it is imported,
# so :func:`is_sharded` asks ``sys.modules`` first.

from smp_torch import group_cache
from smp_torch.sharded_agree import UnitAgreement, guard_units, param_groups

__all__ = [
    "ShardPlan",
    "choose_units",
    "prefetch_plan",
    "post_forward_reshard",
    "sharding_mesh",
    "shard_module",
    "is_sharded",
    "local_tensor",
    "full_state",
    "load_full",
    "gathered",
    "shard_like",
    "param_marks",
    "carry_marks",
    "grad_norm",
    "clip_grad_norm",
]


@dataclass
class ShardPlan:
    """How a module was sharded: units (bottom-up, root last) and the groups used."""

    units: list[str]
    sizes: dict[str, int]
    mesh: Any = None
    shard_group: Any = None
    forward_prefetch: dict[str, list[str]] = field(default_factory=dict)
    backward_prefetch: dict[str, list[str]] = field(default_factory=dict)
    reshard_after_forward: bool | int = True
    #: The units' agreement (:mod:`smp_torch.sharded_agree`).
    agreement: UnitAgreement | None = None


# ---------------------------------------------------------------------------- planning


def _tree(
    module: nn.Module, atomic: Callable[[nn.Module], bool] | None = None
) -> tuple[dict[str, list[str]], dict[str, nn.Module]]:
    """Children of every module by name (a reused module under its first parent only); an
    ``atomic`` module is listed without its descendants."""
    modules: dict[str, nn.Module] = {}
    seen: set[int] = set()
    children: dict[str, list[str]] = {}

    def visit(name: str, m: nn.Module) -> None:
        seen.add(id(m))
        modules[name] = m
        children[name] = []
        if atomic is not None and name and atomic(m):
            return
        for child_name, child in m.named_children():
            if id(child) in seen:
                continue
            full = f"{name}.{child_name}" if name else child_name
            children[name].append(full)
            visit(full, child)

    visit("", module)
    return children, modules


def choose_units(
    module: nn.Module,
    threshold: int,
    bucket: int,
    atomic: Callable[[nn.Module], bool] | None = None,
) -> list[tuple[str, int]]:
    """The shard units of ``module`` as ``(name, elements)``, bottom-up, the root (``""``)
    last; see the module docstring for the rule. A module for which ``atomic`` is true keeps
    its whole subtree in one unit (smp-tp's distributed modules use their submodules'
    parameters without calling them, so FSDP2's per-module hooks would not gather those).
    Pure: no communication."""
    children, modules = _tree(module, atomic)
    sharers: dict[int, set[str]] = {}
    for name, m in module.named_modules():
        for p in m._parameters.values():
            if p is not None:
                sharers.setdefault(id(p), set()).add(name)
    numel = {id(p): p.numel() for p in module.parameters()}

    def own(name: str) -> set[int]:
        m = modules[name]
        if atomic is not None and name and atomic(m):
            return {id(p) for p in m.parameters()}
        return {id(p) for p in m._parameters.values() if p is not None}
    units: list[tuple[str, int]] = []

    def inside(name: str, pid: int) -> bool:
        return all(s == name or s.startswith(name + ".") or name == "" for s in sharers[pid])

    def can_unit(name: str, pending: set[int]) -> bool:
        # A ModuleList or ModuleDict is never called itself, so FSDP2's hooks on it would
        # never gather its parameters.
        called = not isinstance(modules[name], (nn.ModuleList, nn.ModuleDict))
        return called and bool(pending) and all(inside(name, pid) for pid in pending)

    def visit(name: str) -> set[int]:
        pending = own(name)
        left: list[tuple[str, set[int]]] = []
        for child in children[name]:
            rest = visit(child)
            if rest:
                left.append((child, rest))
        for _, rest in left:
            pending |= rest
        if name and bucket > 0:
            # Split the largest small children off while this unit would exceed the bucket.
            for child, rest in sorted(left, key=lambda cr: -sum(numel[p] for p in cr[1])):
                if sum(numel[p] for p in pending) <= bucket:
                    break
                if can_unit(child, rest):
                    units.append((child, sum(numel[p] for p in rest)))
                    pending -= rest
        size = sum(numel[p] for p in pending)
        if name and size >= threshold and can_unit(name, pending):
            units.append((name, size))
            return set()
        return pending

    rest = visit("")
    units.append(("", sum(numel[p] for p in rest)))
    return units


def prefetch_plan(
    units: list[tuple[str, int]], order: list[str], max_live: int, depth: int = 2
) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Forward and backward prefetch lists for the non-root units in forward ``order``: a
    unit prefetches the following units (at most ``depth``: FSDP2's "aggressive" setting is
    two) while root + itself + them hold <= ``max_live``."""
    sizes = dict(units)
    root = sizes.get("", 0)
    seq = [n for n in order if n in sizes and n != ""]

    def ahead(items: list[str]) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for i, name in enumerate(items):
            live = root + sizes[name]
            picked: list[str] = []
            for nxt in items[i + 1 : i + 1 + depth]:
                if live + sizes[nxt] > max_live:
                    break
                live += sizes[nxt]
                picked.append(nxt)
            out[name] = picked
        return out

    return ahead(seq), ahead(list(reversed(seq)))


def post_forward_reshard(shard_ranks: list[int], node_of: list[str], hierarchical: bool) -> bool | int:
    """FSDP2's ``reshard_after_forward`` for non-root units: with ``hierarchical``, the number
    of this sharding group's ranks per node when the nodes are contiguous blocks of equal size
    that split the group (else True: reshard fully)."""
    if not hierarchical:
        return True
    nodes = [node_of[r] for r in shard_ranks]
    blocks: list[str] = []
    for n in nodes:
        if not blocks or blocks[-1] != n:
            blocks.append(n)
    if len(blocks) != len(set(blocks)) or len(blocks) == 1:
        return True  # not contiguous, or one node: no cross-node gather to avoid
    per = len(nodes) // len(blocks)
    if per * len(blocks) != len(nodes) or any(nodes.count(b) != per for b in blocks) or per == 1:
        return True
    return per


# ---------------------------------------------------------------------------- applying


def sharding_mesh(ctx: Any) -> tuple[DeviceMesh, Any, list[int]]:
    """Collective over the job: the sharding mesh of this rank, its shard group and ranks.

    Every reduced data-parallel group (the ranks holding the same parameters: the whole
    data-parallel group without tensor parallelism, the ranks of one tensor-parallel slice
    with it, one pipeline stage's) is cut into rows of ``sdp`` consecutive members (the
    sharding groups); columns are the replicate groups. ``new_group`` is called for every row
    and column of every group in the same order on every rank, as torch.distributed requires.
    They use ``collective_backend`` like smp's other groups (FSDP2's functional collectives
    and state dicts work on ``smp`` groups)."""
    sdp = ctx.config.sdp
    device_type = ctx.device.type
    shard_pg = rep_pg = None
    rows_mine: list[list[int]] = []
    shard_ranks: list[int] = []
    for members in ctx.topology.all_groups("rdp"):
        rows = [members[i : i + sdp] for i in range(0, len(members), sdp)]
        for row in rows:
            pg = group_cache.process_group(row, ctx.group_backend)
            ctx.used_groups.append(group_cache.group_key(row, ctx.group_backend))
            if ctx.rank in row:
                shard_pg, shard_ranks = pg, row
        if len(rows) > 1:
            for j in range(sdp):
                col = members[j::sdp]
                pg = group_cache.process_group(col, ctx.group_backend)
                ctx.used_groups.append(group_cache.group_key(col, ctx.group_backend))
                if ctx.rank in col:
                    rep_pg = pg
        if ctx.rank in members:
            rows_mine = rows
    assert shard_pg is not None  # every rank belongs to one row
    if len(rows_mine) == 1:
        return DeviceMesh.from_group(shard_pg, device_type), shard_pg, shard_ranks
    assert rep_pg is not None  # ... and to one column
    mesh = DeviceMesh.from_group(
        [rep_pg, shard_pg],
        device_type,
        mesh=torch.tensor(rows_mine),
        mesh_dim_names=("replicate", "shard"),
    )
    return mesh, shard_pg, shard_ranks


def _node_ids(ctx: Any) -> list[str]:
    # SMP_COMM_NODE_ID: smp-comm's override to pretend ranks are on different nodes (tests).
    mine = os.environ.get("SMP_COMM_NODE_ID") or socket.gethostname()
    return list(ctx.mpi_comms["world"].allgather(mine))


def param_marks(module: nn.Module) -> dict[str, dict[str, Any]]:
    """The ``_smp_*`` attributes (smp-tp's parameter spec) of every parameter, by name."""
    return {
        name: {k: v for k, v in vars(p).items() if k.startswith("_smp_")}
        for name, p in module.named_parameters(remove_duplicate=False)
    }


def carry_marks(module: nn.Module, marks: dict[str, dict[str, Any]]) -> None:
    """Set the marks of :func:`param_marks` on the parameters now registered under the same
    names (``fully_shard`` replaced them)."""
    for name, p in module.named_parameters(remove_duplicate=False):
        for k, v in marks.get(name, {}).items():
            setattr(p, k, v)


def shard_module(
    module: nn.Module, ctx: Any, atomic: Callable[[nn.Module], bool] | None = None
) -> ShardPlan:
    """Collective: apply ``fully_shard`` to ``module``'s units (bottom-up, root last) over
    this rank's sharding mesh, and set the prefetch lists; see the module docstring.
    ``atomic``: modules whose subtree must stay in one unit (see :func:`choose_units`)."""
    from torch.distributed.fsdp import fully_shard

    cfg = ctx.config
    units = choose_units(
        module, cfg.sdp_param_persistence_threshold, cfg.sdp_reduce_bucket_size, atomic
    )
    mesh, shard_pg, shard_ranks = sharding_mesh(ctx)
    raf = post_forward_reshard(shard_ranks, _node_ids(ctx), cfg.sdp_hierarchical_allgather)
    modules = dict(module.named_modules())
    # fully_shard replaces every parameter by a new DTensor parameter: smp-tp's spec (which
    # decides gradient scaling, clipping and checkpoint gathering) moves over to it.
    marks = param_marks(module)
    for name, _ in units:
        if name:
            fully_shard(modules[name], mesh=mesh, reshard_after_forward=raf)
    # The root keeps its parameters gathered from forward to backward (FSDP2's default).
    fully_shard(module, mesh=mesh)
    carry_marks(module, marks)
    # Every unit's all-gathers and reductions are agreed on first (data-dependent branches).
    in_order = [modules[n] for n, _ in units]
    width = max((len(g.fsdp_params) for u in in_order for g in param_groups(u)), default=0)
    agreement = UnitAgreement.over_rdp(ctx, [n for n, _ in units], width)
    guard_units(in_order, agreement)
    order = [n for n, _ in module.named_modules()]  # definition order stands for forward order
    fwd, bwd = prefetch_plan(units, order, cfg.sdp_max_live_parameters)
    # On CPU FSDP2's all-gathers block (no streams: unshard_async_op is False), so a prefetch
    # cannot overlap anything and would only hold gathered parameters earlier: measured in
    # benchmarks/bench_sdp.py, prefetching under the default bound cost time and memory.
    if ctx.device.type != "cpu":
        for name, targets in fwd.items():
            if targets:
                _fsdp(modules[name]).set_modules_to_forward_prefetch([_fsdp(modules[t]) for t in targets])
        for name, targets in bwd.items():
            if targets:
                _fsdp(modules[name]).set_modules_to_backward_prefetch([_fsdp(modules[t]) for t in targets])
    return ShardPlan(
        units=[n for n, _ in units],
        sizes=dict(units),
        mesh=mesh,
        shard_group=shard_pg,
        forward_prefetch=fwd,
        backward_prefetch=bwd,
        reshard_after_forward=raf,
        agreement=agreement,
    )


def _fsdp(m: nn.Module) -> FSDPModule:
    from torch.distributed.fsdp import FSDPModule

    assert isinstance(m, FSDPModule), type(m).__name__
    return m


# ---------------------------------------------------------------------------- tensors


def is_sharded(t: Any) -> TypeGuard[DTensor]:
    """Whether ``t`` is a sharded (DTensor) parameter, gradient or state tensor."""
    module = sys.modules.get("torch.distributed.tensor")
    cls = getattr(module, "DTensor", None)
    return cls is not None and isinstance(t, cls)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view that writes through), else ``t`` itself."""
    return t.to_local() if is_sharded(t) else t


def full_state(module: nn.Module, keep: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """Collective over the sharding mesh: ``module.state_dict()`` with every shard gathered
    (the unwrapped model's keys and shapes), on CPU; only the keys ``keep`` accepts (every
    rank of the mesh must accept the same keys)."""
    out: dict[str, torch.Tensor] = {}
    for k, v in module.state_dict().items():
        if keep is not None and not keep(k):
            continue  # (another stage's entry: an empty or meta stand-in here)
        full = v.full_tensor() if is_sharded(v) else v
        out[k] = full.detach().to("cpu").clone()
    return out


def shard_like(value: torch.Tensor, like: DTensor) -> DTensor:
    """The DTensor laid out like ``like`` holding this rank's slice of the full ``value``
    (every rank passes the same ``value``: sliced locally, no communication)."""
    from torch.distributed.tensor import distribute_tensor

    value = value.to(device=like.device, dtype=like.dtype)
    return distribute_tensor(value, like.device_mesh, like.placements, src_data_rank=None)


@contextmanager
def gathered(module: nn.Module, write_back: bool = False) -> Iterator[None]:
    """Collective over the sharding mesh: inside, every sharded parameter of ``module`` is
    replaced by a plain parameter holding its whole (gathered) value, with the same
    ``_smp_*`` marks, tied parameters still tied; the shards come back on exit.

    So code written for unsharded modules (smp-tp's full state dicts, the optimizer-state
    resharding that swaps ``param.data``) runs unchanged on a sharded one. With
    ``write_back`` the plain values are sliced back into the shards on exit (loading)."""
    slots: list[tuple[nn.Module, str, DTensor]] = []
    plain: dict[int, tuple[DTensor, nn.Parameter]] = {}
    # modules() / _parameters order is the same on every rank: the gathers match.
    for m in module.modules():
        for name, param in list(m._parameters.items()):
            if not is_sharded(param):
                continue
            p = param
            if id(p) not in plain:
                q = nn.Parameter(p.full_tensor().detach().clone(), requires_grad=p.requires_grad)
                for k, v in vars(p).items():
                    if k.startswith("_smp_"):
                        setattr(q, k, v)
                plain[id(p)] = (p, q)
            slots.append((m, name, p))
            m._parameters[name] = plain[id(p)][1]
    try:
        yield
    finally:
        for m, name, p in slots:
            m._parameters[name] = p  # type: ignore[assignment]  # (the DTensor parameter)
        if write_back:
            with torch.no_grad():
                for p, q in plain.values():
                    p.to_local().copy_(shard_like(q.detach(), p).to_local())


def load_full(module: nn.Module, sd: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Load a full (unwrapped-model) state dict into a sharded ``module``; no communication."""
    expected = set(module.state_dict())
    missing = sorted(expected - set(sd))
    unexpected = sorted(set(sd) - expected)
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"Error(s) in loading state_dict: missing keys {missing}, unexpected keys {unexpected}"
        )
    targets: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    targets.update(dict(module.named_buffers(remove_duplicate=False)))
    with torch.no_grad():
        for k, v in sd.items():
            t = targets.get(k)
            if t is None:
                continue
            if tuple(v.shape) != tuple(t.shape):
                raise RuntimeError(f"size mismatch for {k}: {tuple(v.shape)} vs {tuple(t.shape)}")
            if is_sharded(t):
                t.to_local().copy_(shard_like(v, t).to_local())
            else:
                t.copy_(v)


# ---------------------------------------------------------------------------- clipping


def grad_norm(
    params: Iterable[torch.Tensor],
    shard_group: Any,
    norm_type: float = 2.0,
    tp_group: Any = None,
    tp_shard: Callable[[torch.Tensor], bool] | None = None,
    pp_group: Any = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Collective over ``shard_group`` (and ``tp_group``, ``pp_group`` when given): the norm
    of the whole model's gradient from its shards.

    Replicas of a shard (HSDP's replicate dimension) hold the same values, so summing over the
    sharding group alone counts each element once. With tensor parallelism the sums of
    ``tp_shard`` parameters (slices that differ across the tensor-parallel group) are added
    over ``tp_group`` too, while parameters replicated across it are counted once, as the
    non-sharded clipping does; stages add up over ``pp_group``. Sums are float64, on
    ``device``: the device the groups serve (``ctx.device``; NCCL takes no host tensor),
    default the first parameter's (local shard's) device."""
    params = list(params)
    if device is None:
        device = local_tensor(params[0]).device if params else torch.device("cpu")
    # [FSDP shards, FSDP shards of TP slices]
    sharded_sums = torch.zeros(2, dtype=torch.float64, device=device)
    whole = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        g = p.grad
        if g is None:
            continue
        value = local_tensor(g).detach().double().norm(norm_type) ** norm_type
        if not is_sharded(g):
            whole += value  # a plain gradient is whole on every rank: count it once
        elif tp_shard is not None and tp_shard(p):
            sharded_sums[1] += value
        else:
            sharded_sums[0] += value
    dist.all_reduce(sharded_sums, group=shard_group)
    slices = sharded_sums[1:].clone()
    if tp_group is not None:
        dist.all_reduce(slices, group=tp_group)
    total = (sharded_sums[0] + slices[0] + whole).reshape(1)
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    total = total[0]
    return total ** (1.0 / norm_type)


def clip_grad_norm(
    params: list[torch.Tensor],
    max_norm: float,
    shard_group: Any,
    norm_type: float = 2.0,
    tp_group: Any = None,
    tp_shard: Callable[[torch.Tensor], bool] | None = None,
    pp_group: Any = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Scale every gradient shard by ``max_norm / (norm + 1e-6)`` when that is below 1
    (``torch.nn.utils.clip_grad_norm_``'s rule) with the norm of the whole model's gradient
    (:func:`grad_norm`, same arguments). Returns the norm (float32, on ``device``)."""
    norm = grad_norm(params, shard_group, norm_type, tp_group, tp_shard, pp_group, device)
    scale_grads([local_tensor(p.grad) for p in params if p.grad is not None], max_norm, norm)
    return norm.float()


def scale_grads(grads: list[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Multiply ``grads`` by ``min(1, max_norm / (norm + 1e-6))``, computed where ``norm``
    is, as ``torch.nn.utils.clip_grad_norm_`` does: no device-to-host sync to decide. A
    factor of exactly 1 leaves every gradient bit for bit as it was."""
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    with torch.no_grad():
        for g in grads:
            g.mul_(coef.to(g.device))
