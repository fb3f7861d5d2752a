"""The groups/context object: everything one ``smp.init`` established, handed to internals.

:class:`SMPContext` holds the configuration, this rank's place in the topology, the rank
lists, ``torch.distributed`` groups and MPI communicators of every group kind, and the
failure channel. :mod:`smp_torch.state` keeps the current one for the public helpers
(``smp.pp_rank()``, ...); the model, its engine, the gradient reducer and the optimizer
receive it explicitly.

:meth:`SMPContext.agree` is the one way ranks agree on how a step ended: called at the end
of every step, at every pipeline degree; it also compares the data-parallel ranks' batch
sizes (:mod:`smp_torch.consistency`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from mpi4py import MPI
from smp_comm.shutdown import note_failed_step
from smp_pipeline.errors import PipelineError

from smp_torch import group_cache
from smp_torch.config import SMPConfig
from smp_torch.consistency import StepInputs, agreement_values, batch_error, batch_mismatch
from smp_torch.errors import PeerFailedError
from smp_torch.topology import Coord, Topology
from smp_torch.watch import Failure, FailureWatch, first_line

__all__ = [
    "CONTEXT_GROUP_KINDS", "EXPERT_GROUP_KINDS", "GROUP_KINDS", "SMPContext", "StepOutcome",
    "create_context",
]

GROUP_KINDS = ("pp", "tp", "dp", "rdp", "mp")
# Made only with expert_parallel_degree > 1 (see smp_torch.topology).
EXPERT_GROUP_KINDS = ("ep", "edp")
# Made only with context_parallel_degree > 1; with cp 1, "rdp_cp" and "dp_cp" are "rdp" and
# "dp", and "cp" is this rank alone (no process group).
CONTEXT_GROUP_KINDS = ("cp", "rdp_cp", "dp_cp")


@dataclass(frozen=True)
class StepOutcome:
    """How one step ended on this rank.

    Attributes:
        error: the exception the step raised here, or None.
        backward_calls: how many ``model.backward`` calls ran here.
        watched: the step ran on a helper thread (pp = 1 with tensor parallelism): peers may
            be blocked inside one of its collectives, so a failure is announced, not agreed.
        label: what the step did, for messages (``"in step 3, running the step function"``).
        inputs: what this rank's step arguments must agree on with the other ranks' (None
            where the step function does not run: pipeline stages > 0).
    """

    error: BaseException | None
    backward_calls: int
    watched: bool = False
    label: str = ""
    inputs: StepInputs | None = None


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
    watch: FailureWatch
    # The new_group backend of every group smp makes (collective_backend resolved: "smp" on
    # CPU by default, None = the default group's, NCCL, on CUDA).
    group_backend: str | None = None
    # Objects to close on re-init (pipeline runtimes, communicators).
    closers: list[Any] = field(default_factory=list)
    # The keys of the process groups this context used (smp_torch.group_cache: reused by the
    # next init with the same members, unless a failure happened anywhere under this context).
    used_groups: list[group_cache.GroupKey] = field(default_factory=list)
    # Whether a step failed under this context: its groups may then still be inside a
    # collective a failed peer never joined.
    step_failed: bool = False

    def index(self, kind: str) -> int:
        """This rank's index in its group of ``kind`` (``"pp"``, ``"tp"``, ...)."""
        return self.groups[kind].index(self.rank)

    def agree(self, outcome: StepOutcome) -> bool:
        """Collective over the job: agree on how the step ended.

        Returns whether any rank ran a backward. Raises on every rank when the step failed
        anywhere: this rank's own exception where it happened, :class:`PeerFailedError`
        naming the failed rank elsewhere. A failure the failure channel already reported
        (:mod:`smp_torch.watch`), or a watched step's failure (announced on it), raises at
        once: the failed rank may never join the agreement.
        """
        try:
            return self._agree(outcome)
        except BaseException:
            self.step_failed = True
            raise

    def _agree(self, outcome: StepOutcome) -> bool:
        error = outcome.error
        watch = self.watch
        if error is not None:
            note_failed_step()  # exit waits for collectives this step left (smp_comm.shutdown)
            peer = watch.explain(error, outcome.label or None)
            if peer is not None:
                if peer is error:  # this rank's error already names the failed peer
                    raise peer
                raise peer from error
            if outcome.watched or watch.failure is not None:
                watch.announce(error, where=outcome.label or None)
                raise error
        if self.size == 1:
            if error is not None:
                raise error
            return outcome.backward_calls > 0
        label = f"in step {watch.step}, waiting for the step's agreement"
        with watch.waiting(label):
            # The batch sizes ride along (no message of their own): see smp_torch.consistency.
            values = [int(error is not None), outcome.backward_calls]
            failed, calls, *batch = watch.allreduce_max(values + agreement_values(outcome.inputs))
            if not failed:
                if calls > 0 and batch_mismatch(batch):  # (without a backward, no harm done)
                    note_failed_step()
                    my_batch = None if outcome.inputs is None else outcome.inputs.batch
                    raise batch_error(watch.step, watch.comm.allgather(my_batch))
                return calls > 0
            note_failed_step()
            # Only on failure: the reports, so every rank can name the rank it started on (a
            # pipeline abort raises on every pipeline rank; its origin is the failed one).
            own = error is not None and not _caused_elsewhere(error, self.rank)
            mine = None if error is None else (self.rank, own, first_line(error), outcome.label)
            reports = [r for r in watch.comm.allgather(mine) if r]
            rank, _, text, where = next((r for r in reports if r[1]), reports[0])
            failure = Failure(rank, text, where)
            watch.record(failure)  # the job failed: exit deadlines apply (smp_torch.watch)
            if error is not None and own:
                raise error
            peer = watch.error(failure)
        if error is not None:
            raise peer from error
        raise peer

    def close(self) -> None:
        """Close what this context opened (runtimes first, then its communicators)."""
        for closer in reversed(self.closers):
            try:
                closer()
            except Exception:  # noqa: BLE001 - closing must not mask the next init
                pass
        freed: set[int] = set()
        for name, comm in self.mpi_comms.items():
            # (with cp 1 the *_cp kinds share the plain kinds' communicators)
            if name != "world_raw" and id(comm) not in freed:
                freed.add(id(comm))
                comm.Free()
        self.watch.close()

    def failed(self) -> bool:
        """Whether a step failed here, or a failure was learnt from another rank."""
        return self.step_failed or self.watch.failure is not None

    def release(self, failed_anywhere: bool) -> None:
        """After :meth:`close`, on every rank alike: after a failure anywhere, never reuse
        this context's groups (:func:`smp_torch.group_cache.forget`)."""
        if failed_anywhere:
            group_cache.forget(self.used_groups)
        self.used_groups.clear()


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

    topo = Topology(cfg.pp, cfg.tp, cfg.rdp, cfg.placement, cfg.ep, cfg.cp)
    backend = _group_backend(cfg.collective_backend)
    groups: dict[str, list[int]] = {"world": list(range(size))}
    pgs: dict[str, Any] = {"world": dist.group.WORLD}
    comms: dict[str, Any] = {"world_raw": world, "world": world.Dup()}
    used: list[group_cache.GroupKey] = []
    kinds = GROUP_KINDS + (EXPERT_GROUP_KINDS if cfg.ep > 1 else ())
    for kind in kinds + (CONTEXT_GROUP_KINDS if cfg.cp > 1 else ()):
        mine = getattr(topo, f"{kind}_group")(rank)
        groups[kind] = mine
        # new_group must be called by every rank for every group, in the same order.
        for members in topo.all_groups(kind):
            pg = group_cache.process_group(members, backend)
            used.append(group_cache.group_key(members, backend))
            if members == mine:
                pgs[kind] = pg
        color = topo.all_groups(kind).index(mine)
        comms[kind] = world.Split(color, key=rank)
    if cfg.cp == 1:
        for kind, same in (("rdp_cp", "rdp"), ("dp_cp", "dp")):
            groups[kind], pgs[kind], comms[kind] = groups[same], pgs[same], comms[same]
        groups["cp"], pgs["cp"], comms["cp"] = [rank], None, MPI.COMM_SELF.Dup()
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
        used_groups=used,
        group_backend=backend,
        # SMP_FAILURE_PROC_CHECK=0: heartbeats watch every peer (tests of the heartbeat ring).
        watch=FailureWatch(
            world, cfg.timeout_s, pid_check=os.environ.get("SMP_FAILURE_PROC_CHECK", "1") != "0"
        ),
    )


def _group_backend(choice: str) -> str | None:
    """The ``new_group`` backend for ``collective_backend`` (None: the default group's).

    ``"auto"``: smp-comm's backend on CPU, where it measured faster side by side (a tp=2 step
    1.23-1.34x, an FSDP2 step 1.4-1.9x, a dp=2 step 0.95-1.14x: a wash); on CUDA the
    default group's (NCCL).
    """
    if choice == "auto":
        if torch.cuda.is_available():
            return None
        choice = "smp"
    if choice == "smp":
        # Imported only when chosen: importing it registers the "smp" backend with
        # torch.distributed (process-wide) and binds torch's private c10d classes, which a
        # CUDA job (NCCL) never needs.
        import smp_comm.torch_backend  # noqa: F401 - registers the "smp" backend

        return "smp"
    return choice


def _caused_elsewhere(error: BaseException, rank: int) -> bool:
    """Whether ``error`` reports another rank's failure (not one that happened here)."""
    if isinstance(error, PeerFailedError):
        return True
    return isinstance(error, PipelineError) and error.origin is not None and error.origin != rank
