"""A rank of an ``smp`` group dies between collectives: the others' next collective raises
(within seconds, not the group timeout) instead of hanging."""

from __future__ import annotations

import os

import smp_comm.torch_backend  # noqa: F401
import torch
import torch.distributed as dist
from mpi4py import MPI
from payloads import case_ok, init_smp_world, main_guard
from smp_comm.collectives.shm import PeerFailedError
from smp_comm.shutdown import unlink_mpi_shared_memory


def main() -> None:
    world = MPI.COMM_WORLD
    rank, size = world.rank, world.size
    # A long group timeout: only the dead-peer check can end the wait in time.
    init_smp_world(600)
    t = torch.ones(10)
    dist.all_reduce(t)
    # Every rank leaves with os._exit, so MPI_Finalize never removes MPICH's shared-memory
    # file: remove its name now (every rank has mapped it), as smp's own exits do.
    unlink_mpi_shared_memory()
    if rank == size - 1:
        case_ok("dead-peer")
        os._exit(0)  # dies without a word to anyone
    try:
        dist.all_reduce(t)
    except PeerFailedError as exc:
        assert "died" in str(exc) or "failed" in str(exc), exc
    else:
        raise AssertionError("a collective with a dead peer returned")
    case_ok("dead-peer")
    os._exit(0)


if __name__ == "__main__":
    main_guard(main)
