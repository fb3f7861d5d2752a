"""The groups/context object: everything one ``smp.init`` established, handed to internals.

:class:`SMPContext` holds the configuration, this rank's place in the topology, the rank
lists, ``torch.distributed`` groups and MPI communicators of every group kind, and the
failure channel. :mod:`smp_torch.state` keeps the current one for the public helpers
(``smp.pp_rank()``, ...); the model, its engine, the gradient reducer and the optimizer
receive it explicitly.

:meth:`SMPContext.agree` is the one way ranks agree on how a step ended: called at the end
of every step, at every pipeline degree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from mpi4py import MPI
from smp_comm.shutdown import note_failed_step

from smp_torch.config import SMPConfig
from smp_torch.errors import SMPError
from smp_torch.topology import Coord, Topology
from smp_torch.watch import StepFailedElsewhere, StepWatch

__all__ = ["GROUP_KINDS", "SMPContext", "StepOutcome", "create_context"]

GROUP_KINDS = ("pp", "tp", "dp", "rdp", "mp")


@dataclass(frozen=True)
class StepOutcome:
    """How one step ended on this rank.

    Attributes:
        error: the exception the step raised here, or None.
        backward_calls: how many ``model.backward`` calls ran here.
        watched: the step ran on a helper thread (pp = 1 with tensor parallelism): peers may
            be blocked inside one of its collectives, so a failure is announced, not agreed.
    """

    error: BaseException | None
    backward_calls: int
    watched: bool = False


@dataclass
class SMPContext:
    """One ``smp.init``'s configuration, topology and groups (see the module docstring)."""

    config: SMPConfig
    topology: Topology
    rank: int
    size: int
    coord: Coord
    local_rank: int
    local_size: int
    device: torch.device
    groups: dict[str, list[int]]
    process_groups: dict[str, Any]
    mpi_comms: dict[str, Any]
    watch: StepWatch
    # Objects to close on re-init (pipeline runtimes, communicators).
    closers: list[Any] = field(default_factory=list)

    def index(self, kind: str) -> int:
        """This rank's index in its group of ``kind`` (``"pp"``, ``"tp"``, ...)."""
        return self.groups[kind].index(self.rank)

    def agree(self, outcome: StepOutcome) -> bool:
        """Collective over the job: agree on how the step ended.

        Returns whether any rank ran a backward. Raises on every rank when the step failed
        anywhere: this rank's own exception, or :class:`SMPError` naming the failed rank.
        A watched failure is announced to every rank instead (see :mod:`smp_torch.watch`);
        the others raise from their own ``agree`` (or while blocked in the step).
        """
        error = outcome.error
        if error is not None:
            note_failed_step()  # exit waits for collectives this step left (smp_comm.shutdown)
        if error is not None and outcome.watched:
            # A failure learnt from another rank's notice is not announced again.
            if not isinstance(error, StepFailedElsewhere):
                self.watch.notify(error)
            raise error
        if self.size == 1:
            if error is not None:
                raise error
            return outcome.backward_calls > 0
        failed, calls = self.watch.allreduce_max([int(error is not None), outcome.backward_calls])
        if failed:
            note_failed_step()
            # Only on failure: the reports themselves, so every rank can name the culprit.
            report = None if error is None else f"rank {self.rank}: {type(error).__name__}: {error}"
            failures = [r for r in self.watch.comm.allgather(report) if r]
            if error is not None:
                raise error
            raise SMPError(f"the step failed on another rank: {failures[0]}")
        return calls > 0

    def close(self) -> None:
        """Close what this context opened (runtimes first, then its communicators)."""
        for closer in reversed(self.closers):
            try:
                closer()
            except Exception:  # noqa: BLE001 - closing must not mask the next init
                pass
        for name, comm in self.mpi_comms.items():
            if name != "world_raw":
                comm.Free()


def create_context(cfg: SMPConfig) -> SMPContext:
    """Collective over ``MPI.COMM_WORLD``: build every group of ``cfg``'s topology.

    ``torch.distributed`` must already be initialised over the same ranks.
    """
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank, local_size = node.Get_rank(), node.Get_size()
    node.Free()
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    topo = Topology(cfg.pp, cfg.tp, cfg.rdp, cfg.placement)
    groups: dict[str, list[int]] = {"world": list(range(size))}
    pgs: dict[str, Any] = {"world": dist.group.WORLD}
    comms: dict[str, Any] = {"world_raw": world, "world": world.Dup()}
    for kind in GROUP_KINDS:
        mine = getattr(topo, f"{kind}_group")(rank)
        groups[kind] = mine
        # new_group must be called by every rank for every group, in the same order.
        for members in topo.all_groups(kind):
            pg = dist.new_group(ranks=members)
            if members == mine:
                pgs[kind] = pg
        color = topo.all_groups(kind).index(mine)
        comms[kind] = world.Split(color, key=rank)
    return SMPContext(
        config=cfg,
        topology=topo,
        rank=rank,
        size=size,
        coord=topo.coord(rank),
        local_rank=local_rank,
        local_size=local_size,
        device=device,
        groups=groups,
        process_groups=pgs,
        mpi_comms=comms,
        watch=StepWatch(world),
    )
