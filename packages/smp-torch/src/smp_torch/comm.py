"""Object communication over smp's groups: ``barrier, broadcast, send, recv_from, allgather``.

These move arbitrary picklable Python objects (tensors included) over MPI on communicators
private to smp, so they never interfere with the pipeline runtime's messages. Ranks passed to
``send``/``recv_from`` are indices *within* the chosen group (``CommGroup.WORLD``: the global
rank).

``broadcast(obj, group)`` is one-sided like SageMaker's: the source calls ``broadcast``, every
other member of the group calls ``recv_from(src, group)``.
"""

from __future__ import annotations

import enum
from typing import Any

from smp_torch.state import state

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


# SageMaker v1 spells the ``recv_from`` argument as a rank type; the same groups.
RankType = CommGroup


def _comm(group: CommGroup) -> Any:
    if not isinstance(group, CommGroup):
        raise TypeError(f"group must be a smp.CommGroup, got {group!r}")
    return state().mpi_comms[group.value]


def barrier(group: CommGroup = CommGroup.WORLD) -> None:
    """Block until every rank of ``group`` reaches the barrier."""
    _comm(group).Barrier()


def allgather(obj: Any, group: CommGroup = CommGroup.WORLD) -> list[Any]:
    """Every member's ``obj``, in group-rank order, on every member."""
    return list(_comm(group).allgather(obj))


def send(obj: Any, dest_rank: int, group: CommGroup = CommGroup.WORLD) -> None:
    """Send ``obj`` to group-rank ``dest_rank``; it must call ``recv_from(my_rank, group)``."""
    comm = _comm(group)
    if not 0 <= dest_rank < comm.Get_size():
        raise ValueError(f"dest_rank {dest_rank} outside {group.name} of size {comm.Get_size()}")
    comm.send(obj, dest=dest_rank, tag=_TAG)


def recv_from(src_rank: int, group: CommGroup = CommGroup.WORLD) -> Any:
    """Receive the object sent (or broadcast) by group-rank ``src_rank``."""
    comm = _comm(group)
    if not 0 <= src_rank < comm.Get_size():
        raise ValueError(f"src_rank {src_rank} outside {group.name} of size {comm.Get_size()}")
    return comm.recv(source=src_rank, tag=_TAG)


def broadcast(obj: Any, group: CommGroup = CommGroup.WORLD) -> None:
    """Send ``obj`` to every other member of ``group`` (each calls ``recv_from``)."""
    comm = _comm(group)
    me = comm.Get_rank()
    requests = [comm.isend(obj, dest=r, tag=_TAG) for r in range(comm.Get_size()) if r != me]
    for req in requests:
        req.wait()
