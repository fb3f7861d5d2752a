"""FSDP2 (``fully_shard``) and plain DDP train a small transformer on backend ``smp`` to the
same weights as on gloo (float32 sums in another order: compared within a rounding bound)."""

from __future__ import annotations

import copy
import os
from datetime import timedelta

import smp_comm.torch_backend  # noqa: F401
import torch
import torch.distributed as dist
from mpi4py import MPI
from payloads import case_ok, main_guard
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

STEPS = 3


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(50, 32),
        torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True),
        torch.nn.Linear(32, 50),
    )


def train(net: torch.nn.Module, rank: int) -> None:
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * rank + step)
        x = torch.randint(0, 50, (4, 9), generator=g)
        loss = torch.nn.functional.cross_entropy(net(x).flatten(0, 1), x.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()


def local_state(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    # Each rank's shards (the same sharding in both runs). Not full_tensor(): DTensor
    # redistributes through functional collectives, which this backend does not serve.
    return {k: v.to_local().detach().clone() for k, v in net.state_dict().items()}


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    for k in a:
        # a few float32 steps: gradients agree to n*eps*sum|g|, weights to a small multiple
        assert torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-5), (what, k, (a[k] - b[k]).abs().max())


def main() -> None:
    world = MPI.COMM_WORLD
    rank, size = world.rank, world.size
    port = world.bcast(29400 + os.getpid() % 1000 if rank == 0 else None)
    store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timedelta(seconds=60))
    dist.init_process_group("smp", store=store, rank=rank, world_size=size,
                            timeout=timedelta(seconds=120))
    gloo = dist.new_group(backend="gloo")
    smp = dist.group.WORLD
    results = {}
    for name, group in (("smp", smp), ("gloo", gloo)):
        net = model()
        mesh = DeviceMesh.from_group(group, "cpu")
        for layer in net:
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
        train(net, rank)
        results[name] = local_state(net)
    close(results["smp"], results["gloo"], "fsdp2")
    case_ok("fsdp2")
    base = model()
    ddp = {}
    for name, group in (("smp", smp), ("gloo", gloo)):
        net = DistributedDataParallel(copy.deepcopy(base), process_group=group)
        train(net, rank)
        ddp[name] = {k: v.detach().clone() for k, v in net.module.state_dict().items()}
    close(ddp["smp"], ddp["gloo"], "ddp")
    case_ok("ddp")
    dist.destroy_process_group()


if __name__ == "__main__":
    main_guard(main)
