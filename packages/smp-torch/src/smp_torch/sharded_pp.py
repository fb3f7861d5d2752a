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
elsewhere (empty stand-ins on this rank) are left to no unit.

``StageShards`` uses FSDP2 internals, as ``torch.distributed.pipelining`` does: the forward
hook handles, ``_lazy_init``, ``_fsdp_param_groups[*].post_backward`` and
``_root_post_backward_final_callback``; the sdp × pp equivalence tests fail if their
behaviour changes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from smp_torch.sharded import ShardPlan, sharding_mesh

__all__ = ["StageShards", "stage_tops"]


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


class StageShards:
    """FSDP2 units over this rank's pipeline stage; see the module docstring.

    Collective over the job at construction (the sharding groups are created on every rank).
    """

    def __init__(
        self, module: nn.Module, owned: list[str], local_params: list[tuple[str, nn.Parameter]], ctx: Any
    ) -> None:
        mesh, shard_group, _ = sharding_mesh(ctx)
        modules = dict(module.named_modules())
        local = {id(p) for _, p in local_params}
        self._module = module
        self._names = [n for n, _ in local_params]
        tops = stage_tops(owned)
        sizes: dict[str, int] = {}
        units: list[str] = []
        # Innermost first: a top nested in another (a non-contiguous placement) becomes its
        # own unit before the enclosing one takes the rest.
        for path in reversed(tops):
            m = modules[path]
            params = list(m.parameters())
            own = [p for p in params if id(p) in local and not isinstance(p, DTensor)]  # (not a nested unit's)
            if not own:
                continue
            ignored = {p for p in params if id(p) not in local}
            fully_shard(m, mesh=mesh, reshard_after_forward=False, ignored_params=ignored or None)
            state = fully_shard.state(m)  # type: ignore[attr-defined]
            state._pre_forward_hook_handle.remove()
            state._post_forward_hook_handle.remove()
            units.append(path)
            sizes[path] = sum(p.numel() for p in own)
        self.units: list[FSDPModule] = [_fsdp(modules[p]) for p in units]
        # Outermost units are FSDP2 roots: initialise them now (in that order), not at a first
        # forward that a checkpointed or remotely called module may never run through hooks.
        inner = set()
        for path in units:
            inner |= {q for q in units if q != path and (path == "" or q.startswith(path + "."))}
        self._roots = [_fsdp(modules[p]) for p in reversed(units) if p not in inner]
        for root in self._roots:
            fully_shard.state(root)._lazy_init()  # type: ignore[attr-defined]
        self.plan = ShardPlan(
            units=units, sizes=sizes, mesh=mesh, shard_group=shard_group, reshard_after_forward=False
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
                if not isinstance(p, DTensor):
                    p.grad = None
        for unit in self.units:
            unit.set_requires_gradient_sync(reduce, recurse=False)
            unit.set_reshard_after_backward(True, recurse=False)
            unit.set_is_last_backward(True)
        for unit in self.units:
            for group in fully_shard.state(unit)._fsdp_param_groups:  # type: ignore[attr-defined]
                if reduce:
                    group.post_backward()  # takes the gathered .grad, reduce-scatters, reshards
                else:
                    group.reshard()
        for root in self._roots:
            fully_shard.state(root)._root_post_backward_final_callback()  # type: ignore[attr-defined]


def _fsdp(m: nn.Module) -> FSDPModule:
    assert isinstance(m, FSDPModule), type(m).__name__
    return m
