"""Start ``torch.distributed`` from an MPI job, with no environment variables to set.

Rank 0 opens a ``TCPStore`` on a free port (the OS picks it), the address and port travel to
every rank over MPI, and every rank joins the default process group through that store:
gloo on CPU, NCCL when CUDA is available. A job that already initialised
``torch.distributed`` (for instance under ``torchrun``) keeps its process group.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["init_torch_distributed", "default_backend"]


def default_backend() -> str:
    """``"nccl"`` when this process drives a GPU, ``"gloo"`` otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def _host_address(all_hosts: list[str], rank0_host: str) -> str:
    # Every rank on one machine: loopback avoids firewall and name-resolution surprises.
    if len(set(all_hosts)) == 1:
        return "127.0.0.1"
    try:
        return socket.gethostbyname(rank0_host)
    except OSError:
        return rank0_host


def init_torch_distributed(mpi_comm: Any, timeout_s: float) -> bool:
    """Initialise the default ``torch.distributed`` group over the ranks of ``mpi_comm``.

    Returns whether this call created it (False when it was already initialised)."""
    rank, size = mpi_comm.Get_rank(), mpi_comm.Get_size()
    if dist.is_initialized():
        if dist.get_world_size() != size or dist.get_rank() != rank:
            raise RuntimeError(
                f"torch.distributed is already initialised with rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but MPI says rank {rank} of {size}"
            )
        return False
    timeout = timedelta(seconds=max(timeout_s, 30.0))
    hosts = mpi_comm.allgather(socket.gethostname())
    store = None
    if rank == 0:
        addr = _host_address(hosts, hosts[0])
        bind = "0.0.0.0" if addr != "127.0.0.1" else addr
        store = dist.TCPStore(bind, 0, size, True, timeout=timeout, wait_for_workers=False)
        endpoint: tuple[str, int] | None = (addr, int(store.port))
    else:
        endpoint = None
    addr, port = mpi_comm.bcast(endpoint, root=0)
    if store is None:
        store = dist.TCPStore(addr, port, size, False, timeout=timeout)
    dist.init_process_group(
        backend=default_backend(), store=store, rank=rank, world_size=size, timeout=timeout
    )
    return True
