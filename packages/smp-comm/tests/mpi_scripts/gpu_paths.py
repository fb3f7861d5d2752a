"""GPU tensors between two ranks of one node: cuda_ipc, host staging over shm and mpi.

Run only where CUDA is available (test_cuda.py skips otherwise). Both ranks may share one
GPU: CUDA IPC works between processes on the same device too.
"""

from __future__ import annotations

import torch
from mpi4py import MPI
from payloads import main_guard
from smp_comm import Communicator


def main() -> None:
    world = MPI.COMM_WORLD
    rank, peer = world.rank, 1 - world.rank
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device="cpu").manual_seed(5)
    big = torch.randn(1 << 20, generator=g).to(dev)  # 4 MiB
    bf16 = torch.randn(333, 7, generator=g).to(torch.bfloat16).to(dev).t()  # non-contiguous
    cpu = torch.arange(100_000, dtype=torch.int64)
    for kwargs, path in (
        ({}, "cuda_ipc"),
        ({"disable": "cuda_ipc"}, "shm"),
        ({"disable": "cuda_ipc,shm"}, "mpi"),
    ):
        comm = Communicator(world, **kwargs)
        assert comm.path_to(peer, "cuda") == path, (comm.path_to(peer, "cuda"), path)
        h = comm.isend({"big": big * (rank + 1), "bf16": bf16.requires_grad_()}, dest=peer, tag=1)
        obj, src, tag = comm.irecv(peer, 1).wait(timeout=60)
        h.wait(timeout=60)
        assert obj["big"].is_cuda and obj["bf16"].is_cuda and obj["bf16"].requires_grad
        assert torch.equal(obj["big"], big * (peer + 1))
        assert torch.equal(obj["bf16"].detach(), bf16.detach())
        assert comm.stats()[path]["messages_received"] == 1, comm.stats()
        # A message mixing CPU and GPU tensors is staged through host memory.
        h = comm.isend([cpu, big], dest=peer, tag=2)
        (c, b), _, _ = comm.irecv(peer, 2).wait(timeout=60)
        h.wait(timeout=60)
        assert not c.is_cuda and torch.equal(c, cpu) and b.is_cuda and torch.equal(b, big)
        comm.close()
    print(f"rank {rank} OK cuda")


main_guard(main)
