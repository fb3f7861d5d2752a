"""Sharded data parallelism of a pipeline stage (``sharded_data_parallel_degree`` with
``pipeline_parallel_degree > 1``).

Each stage's parameters are sharded by FSDP2 over the stage's data-parallel group (the same
sharding mesh as without a pipeline, :func:`smp_torch.sharded.sharding_mesh`: the reduced
data-parallel groups are per stage). What differs is *when* FSDP2 gathers and reduces.
smp-pipeline runs a stage's modules per request with microbatches interleaved (1F1B), starts
backward passes from other ranks, and sums each parameter's gradient in microbatch order
itself (:mod:`smp_pipeline.accumulation`). FSDP2's own per-module rhythm — gather before a
call, free after it, reduce-scatter after each backward — would free parameters that a
waiting microbatch still needs and reduce before that ordered sum is complete. So, as
``torch.distributed.pipelining`` drives FSDP2:

- FSDP2's forward hooks are taken off these units: smp drives them. (Left on, they reshard
  a unit when a microbatch's forward, suspended in a remote call, ends after another
  microbatch's backward reset the unit's state; one data-parallel rank then all-gathers in
  backward while its peers do not, and the job hangs.)
- :meth:`StageShards.begin`, before a step's microbatches: every unit is gathered once
  (``unshard()``) and stays so through every microbatch's forward and backward;
- during the step the gathered parameters *are* the modules' parameters, so the pipeline's
  ordered accumulation sums into their ``.grad`` (the runtime tracks them:
  :meth:`StageShards.gathered_parameters`);
- :meth:`StageShards.finish`, after the step: FSDP2's post-backward reduce-scatters those sums
  into the shards' gradients (averaged over the sharding group, all-reduced across groups
  with HSDP) and the units are resharded.

Between steps a rank holds 1/sdp of its stage's parameters, gradients and optimizer state;
during a step it holds its stage's whole parameters and gradients (the ZeRO-2 shape), once
per step rather than per microbatch. Units are the *stage tops*: the owned modules whose
parent is owned by another stage (and the root, where owned); parameters of modules owned
elsewhere (empty stand-ins on this rank) are left to no unit. Tops that hold a common
parameter are one unit (one grouped ``fully_shard`` call, :func:`unit_groups`): a tied
embedding and head placed on a stage without the root are two tops, and sharding them
apart would shard the tied parameter twice, into two parameters that train apart.

Because every unit is gathered and reduced at these fixed points, a module that runs on
some data-parallel ranks only (a data-dependent branch) trains exactly: before the
reduce-scatter the ranks agree on which parameters have a gradient anywhere, and a rank
whose data skipped one adds zeros (:mod:`smp_torch.sharded_agree`). With tensor
parallelism, smp-tp's modules stay whole on one stage (the engine keeps them there), so a
top is never inside one, and the parameters keep smp-tp's spec
(:mod:`smp_torch.sharded_tp` applies it after the reduction).

``StageShards`` uses FSDP2 internals, as ``torch.distributed.pipelining`` does: the forward
hook handles, ``_lazy_init``, ``_fsdp_param_groups[*].post_backward`` (and the parameters'
gathered gradients) and ``_root_post_backward_final_callback``; the sdp × pp equivalence
tests fail if their behaviour changes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from torch import nn

from smp_torch.sharded import ShardPlan, carry_marks, is_sharded, param_marks, sharding_mesh
from smp_torch.sharded_agree import REDUCE, UnitAgreement, fill_missing_grads, param_groups

if TYPE_CHECKING:  # (imported where sharding starts: see smp_torch.sharded)
    from torch.distributed.fsdp import FSDPModule

__all__ = ["StageShards", "stage_tops", "unit_groups"]


def stage_tops(owned: Iterable[str]) -> list[str]:
    """The owned module paths whose parent is not owned (the root ``""`` if owned), outermost
    first. Pure."""
    mine = set(owned)

    def parent(path: str) -> str | None:
        if path == "":
            return None
        return path.rsplit(".", 1)[0] if "." in path else ""

    tops = [p for p in mine if parent(p) is None or parent(p) not in mine]
    return sorted(tops, key=lambda p: (0 if p == "" else p.count(".") + 1, p))


def unit_groups(tops: list[str], modules: dict[str, nn.Module], local: set[int]) -> list[list[str]]:
    """The stage tops that become one FSDP2 unit together, each group outermost first, the
    groups in the order of their first top. Pure.

    Tops whose subtrees hold a common local parameter are one unit: a tied embedding and
    head (both tops of a stage whose root is elsewhere) must stay one parameter, and FSDP2
    replaces a shared parameter on the modules of one ``fully_shard`` call only; two calls
    would shard it twice into two parameters that train apart. A top nested inside another
    (a non-contiguous placement) shares that one's parameters too, and joins it. Members
    nested inside another member are dropped (the outer one covers them)."""
    params = {t: {id(p) for p in modules[t].parameters()} & local for t in tops}
    parent = {t: t for t in tops}

    def find(t: str) -> str:
        while parent[t] != t:
            parent[t] = parent[parent[t]]
            t = parent[t]
        return t

    owner: dict[int, str] = {}
    for t in tops:
        for pid in params[t]:
            if pid in owner:
                parent[find(t)] = find(owner[pid])
            else:
                owner[pid] = t
    groups: dict[str, list[str]] = {}
    for t in tops:
        groups.setdefault(find(t), []).append(t)

    def inside(q: str, p: str) -> bool:
        return q != p and (p == "" or q.startswith(p + "."))

    out = []
    for members in groups.values():
        kept = [q for q in members if not any(inside(q, p) for p in members)]
        if any(params[q] for q in kept):
            out.append(kept)
    return out


class StageShards:
    """FSDP2 units over this rank's pipeline stage; see the module docstring.

    Collective over the job at construction (the sharding groups are created on every rank).
    """

    def __init__(
        self, module: nn.Module, owned: list[str], local_params: list[tuple[str, nn.Parameter]], ctx: Any
    ) -> None:
        mesh, shard_group, _ = sharding_mesh(ctx)
        from torch.distributed.fsdp import fully_shard

        modules = dict(module.named_modules())
        local = {id(p) for _, p in local_params}
        self._module = module
        self._names = [n for n, _ in local_params]
        # fully_shard replaces every parameter: smp-tp's spec moves over (see sharded.py).
        marks = param_marks(module)
        sizes: dict[str, int] = {}
        units: list[str] = []
        self.units: list[FSDPModule] = []
        for paths in unit_groups(stage_tops(owned), modules, local):
            members = [modules[p] for p in paths]
            params = {id(p): p for m in members for p in m.parameters()}
            # Modules owned by other stages hold empty stand-ins: no unit's.
            ignored = {p for pid, p in params.items() if pid not in local}
            fully_shard(
                members if len(members) > 1 else members[0],
                mesh=mesh,
                reshard_after_forward=False,
                ignored_params=ignored or None,
            )
            state = fully_shard.state(members[0])  # type: ignore[attr-defined]
            state._pre_forward_hook_handle.remove()  # (one handle for a group: removing twice is fine)
            state._post_forward_hook_handle.remove()
            name = "+".join(paths)
            units.append(name)
            sizes[name] = sum(p.numel() for pid, p in params.items() if pid in local)
            self.units.append(_fsdp(members[0]))
        carry_marks(module, marks)
        # One FSDP2 root over the stage: the model's root module (a unit of its own where
        # this stage owns it; else a unit without parameters of its own, the stand-ins of
        # other stages ignored). FSDP2 needs one: a grouped unit cannot be a root. Initialise
        # it now, not at a first forward that a remotely called module never runs through.
        if self.units and "" not in units:
            foreign = {p for p in module.parameters() if not is_sharded(p)}
            fully_shard(module, mesh=mesh, reshard_after_forward=False, ignored_params=foreign or None)
            state = fully_shard.state(module)  # type: ignore[attr-defined]
            state._pre_forward_hook_handle.remove()
            state._post_forward_hook_handle.remove()
        self._root = fully_shard.state(module) if self.units else None  # type: ignore[attr-defined]
        if self._root is not None:
            self._root._lazy_init()
        self._groups = [g for unit in self.units for g in param_groups(unit)]  # type: ignore[arg-type]
        # The end-of-step gradient flags (a branch this rank's data skipped: sharded_agree).
        self._agreement = UnitAgreement.over_rdp(
            ctx, units, sum(len(g.fsdp_params) for g in self._groups)
        )
        self.plan = ShardPlan(
            units=units,
            sizes=sizes,
            mesh=mesh,
            shard_group=shard_group,
            reshard_after_forward=False,
            agreement=self._agreement,
        )

    def begin(self) -> None:
        """Collective over the sharding mesh: gather every unit for the whole step."""
        for unit in self.units:
            unit.unshard()

    def gathered_parameters(self) -> list[nn.Parameter]:
        """This stage's parameters as the modules hold them now (gathered, between
        :meth:`begin` and :meth:`finish`): what autograd accumulates into during a step."""
        return [self._module.get_parameter(n) for n in self._names]

    def finish(self, reduce: bool = True) -> None:
        """Collective over the sharding mesh: reduce-scatter the step's gradient sums into the
        shards' gradients (``reduce``; without it, after a step whose backward did not run,
        the sums are dropped) and free the gathered parameters."""
        if not reduce:
            for p in self.gathered_parameters():
                if not is_sharded(p):
                    p.grad = None
        for unit in self.units:
            unit.set_requires_gradient_sync(reduce, recurse=False)
            unit.set_reshard_after_backward(True, recurse=False)
            unit.set_is_last_backward(True)
        if reduce:
            # A parameter this rank's data did not reach (a branch) but a peer's did joins the
            # reduce-scatter with zeros; one no rank's data reached keeps None everywhere.
            fill_missing_grads(self._groups, self._agreement, REDUCE, 0)
        for group in self._groups:
            if reduce:
                group.post_backward()  # takes the gathered .grad, reduce-scatters, reshards
            else:
                group.reshard()
        if self._root is not None:
            self._root._root_post_backward_final_callback()


def _fsdp(m: nn.Module) -> FSDPModule:
    from torch.distributed.fsdp import FSDPModule

    assert isinstance(m, FSDPModule), type(m).__name__
    return m
