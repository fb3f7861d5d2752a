"""Object communication over smp's groups: ``barrier, broadcast, send, recv_from, allgather``.

These move arbitrary picklable Python objects (tensors included) over MPI on communicators
private to smp, so they never interfere with the pipeline runtime's messages. Ranks passed to
``send``/``recv_from`` are indices *within* the chosen group (``CommGroup.WORLD``: the global
rank).

``broadcast(obj, group)`` is one-sided like SageMaker's: the source calls ``broadcast``, every
other member of the group calls ``recv_from(src, group)``.

Each waits without blocking in MPI, so that another rank's failure raises
:class:`~smp_torch.errors.PeerFailedError` here instead of waiting for it forever
(:mod:`smp_torch.watch`).
"""

from __future__ import annotations

import enum
import pickle
import time
from typing import Any

from mpi4py import MPI

from smp_torch.state import state
from smp_torch.watch import FailureWatch

__all__ = ["CommGroup", "RankType", "barrier", "broadcast", "send", "recv_from", "allgather"]

_TAG = 0x5A9


class CommGroup(enum.Enum):
    """The groups a collective can run over (see :mod:`smp_torch.topology`)."""

    WORLD = "world"
    PP_GROUP = "pp"
    TP_GROUP = "tp"
    DP_GROUP = "dp"
    RDP_GROUP = "rdp"
    MP_GROUP = "mp"
    CP_GROUP = "cp"


# SageMaker v1 spells the ``recv_from`` argument as a rank type; the same groups.
RankType = CommGroup


def _comm(group: CommGroup) -> tuple[Any, FailureWatch]:
    if not isinstance(group, CommGroup):
        raise TypeError(f"group must be a smp.CommGroup, got {group!r}")
    ctx = state()
    ctx.watch.check()
    return ctx.mpi_comms[group.value], ctx.watch


def barrier(group: CommGroup = CommGroup.WORLD) -> None:
    """Block until every rank of ``group`` reaches the barrier."""
    comm, watch = _comm(group)
    with watch.waiting(f"in smp.barrier({group.name})"):
        watch.wait_request(comm.Ibarrier())


def allgather(obj: Any, group: CommGroup = CommGroup.WORLD) -> list[Any]:
    """Every member's ``obj``, in group-rank order, on every member."""
    comm, watch = _comm(group)
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    n = comm.Get_size()
    with watch.waiting(f"in smp.allgather({group.name})"):
        mine = bytearray(len(data).to_bytes(8, "little"))
        counts = bytearray(8 * n)
        watch.wait_request(comm.Iallgather([mine, MPI.BYTE], [counts, MPI.BYTE]))
        sizes = [int.from_bytes(counts[8 * i : 8 * i + 8], "little") for i in range(n)]
        offsets = [sum(sizes[:i]) for i in range(n)]
        out = bytearray(sum(sizes))
        watch.wait_request(
            comm.Iallgatherv([data, MPI.BYTE], [out, (sizes, offsets), MPI.BYTE])
        )
    view = memoryview(out)
    return [pickle.loads(view[o : o + k]) for o, k in zip(offsets, sizes)]


def send(obj: Any, dest_rank: int, group: CommGroup = CommGroup.WORLD) -> None:
    """Send ``obj`` to group-rank ``dest_rank``; it must call ``recv_from(my_rank, group)``."""
    comm, watch = _comm(group)
    if not 0 <= dest_rank < comm.Get_size():
        raise ValueError(f"dest_rank {dest_rank} outside {group.name} of size {comm.Get_size()}")
    with watch.waiting(f"in smp.send to {group.name} rank {dest_rank}"):
        watch.wait_request(comm.isend(obj, dest=dest_rank, tag=_TAG))


def recv_from(src_rank: int, group: CommGroup = CommGroup.WORLD) -> Any:
    """Receive the object sent (or broadcast) by group-rank ``src_rank``."""
    comm, watch = _comm(group)
    if not 0 <= src_rank < comm.Get_size():
        raise ValueError(f"src_rank {src_rank} outside {group.name} of size {comm.Get_size()}")
    with watch.waiting(f"in smp.recv_from({group.name} rank {src_rank})"):
        pause = 5e-5
        while not comm.Iprobe(source=src_rank, tag=_TAG):
            watch.check()
            time.sleep(pause)
            pause = min(2e-3, pause * 2)
        return comm.recv(source=src_rank, tag=_TAG)


def broadcast(obj: Any, group: CommGroup = CommGroup.WORLD) -> None:
    """Send ``obj`` to every other member of ``group`` (each calls ``recv_from``)."""
    comm, watch = _comm(group)
    me = comm.Get_rank()
    requests = [comm.isend(obj, dest=r, tag=_TAG) for r in range(comm.Get_size()) if r != me]
    with watch.waiting(f"in smp.broadcast({group.name})"):
        for req in requests:
            watch.wait_request(req)
