"""torch's own distributed APIs on an ``smp`` group, each against the same call on gloo:
functional collectives (eager and under ``torch.compile``), DTensor, FSDP2 (trained, then
its full state dict) and DDP. float32 sums in another order: compared within a rounding
bound."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import smp_comm.torch_backend  # noqa: F401
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from mpi4py import MPI
from payloads import case_ok, init_smp_world, main_guard
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

STEPS = 3
# The older funcol names are tested beside the newer ones on purpose.
warnings.filterwarnings("ignore", ".*_functional_collectives.* is deprecated", FutureWarning)


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), (what, sorted(a), sorted(b))
    for k in a:
        assert a[k].shape == b[k].shape, (what, k, a[k].shape, b[k].shape)
        # a few float32 steps: gradients agree to n*eps*sum|g|, weights to a small multiple
        assert torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-5), (what, k, (a[k] - b[k]).abs().max())


def on_both(smp: dist.ProcessGroup, gloo: dist.ProcessGroup, what: str,
            run: Callable[[dist.ProcessGroup], dict[str, torch.Tensor]]) -> None:
    got = run(smp)
    want = run(gloo)
    close(got, want, what)
    case_ok(what)


def functional(group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    x = torch.arange(6 * size, dtype=torch.float32).reshape(2 * size, 3) * (rank + 1) + 0.25
    splits = [(i + rank) % 3 + 1 for i in range(size)]  # uneven all_to_all blocks
    out_splits = [(rank + i) % 3 + 1 for i in range(size)]
    a2a_in = torch.randn(sum(splits), 2, generator=torch.Generator().manual_seed(rank))
    pieces = funcol.all_gather_single_coalesced([x, x[:1] * 2], group)
    scattered = funcol.reduce_scatter_single_coalesced([x, x * 3], "sum", [0, 0], group)
    return {
        "all_reduce": funcol.all_reduce(x, "sum", group),
        "all_reduce_max": funcol.all_reduce(x, "max", group),
        "all_reduce_avg": funcol.all_reduce(x, "avg", group),
        "all_gather_tensor": funcol.all_gather_tensor(x, 0, group),
        "all_gather_tensor_dim1": funcol.all_gather_tensor(x, 1, group),
        "reduce_scatter_tensor": funcol.reduce_scatter_tensor(x, "sum", 0, group),
        "reduce_scatter_tensor_avg": funcol.reduce_scatter_tensor(x, "avg", 0, group),
        "all_gather_single": funcol.all_gather_single(x, 1, group),
        "reduce_scatter_single": funcol.reduce_scatter_single(x, "avg", 0, group),
        "all_to_all_single": funcol.all_to_all_single(a2a_in, out_splits, splits, group),
        "broadcast": funcol.broadcast(x, 1, group),
        "coalesced_gather_0": pieces[0], "coalesced_gather_1": pieces[1],
        "coalesced_scatter_0": scattered[0], "coalesced_scatter_1": scattered[1],
    }


def compiled(group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    # aot_eager: the graph torch.compile captures, run without inductor's C++ compile.
    @torch.compile(backend="aot_eager", fullgraph=True)
    def step(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = funcol.all_gather_tensor(x * 2, 0, group)
        r = funcol.reduce_scatter_tensor(g + 1, "sum", 0, group)
        return g, funcol.all_reduce(r, "sum", group)

    x = torch.arange(8.0).reshape(4, 2) + dist.get_rank(group)
    g, r = step(x)
    return {"gathered": g, "reduced": r}


def dtensor(group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    mesh = DeviceMesh.from_group(group, "cpu")
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(0)
    t = torch.randn(4 * size, 6)
    d = distribute_tensor(t, mesh, [Shard(0)])
    col = d.redistribute(mesh, [Shard(1)])
    rep = col.redistribute(mesh, [Replicate()])
    local = torch.full((4 * size, 6), float(rank + 1))
    partial = torch.distributed.tensor.DTensor.from_local(local, mesh, [Partial()])
    summed = partial.redistribute(mesh, [Shard(0)])
    assert torch.equal(rep.to_local(), t)  # moved, never reduced: exact
    return {
        "full": d.full_tensor(), "col_local": col.to_local(), "replicated": rep.to_local(),
        "partial_to_shard": summed.to_local(),
        "matmul": (d @ d.T.redistribute(mesh, [Replicate()])).full_tensor(),
    }


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


def fsdp2(group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    net = model()
    mesh = DeviceMesh.from_group(group, "cpu")
    for layer in net:
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    train(net, dist.get_rank(group))
    full = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True))
    gathered = {k: v.full_tensor() for k, v in net.state_dict().items()}
    close(full, gathered, "fsdp2 full state dict vs full_tensor")
    reference = model()
    assert full.keys() == reference.state_dict().keys()
    return full


def ddp(group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    net = DistributedDataParallel(model(), process_group=group)
    train(net, dist.get_rank(group))
    return {k: v.detach().clone() for k, v in net.module.state_dict().items()}


def main() -> None:
    world = MPI.COMM_WORLD
    rank, size = world.rank, world.size
    init_smp_world(120)
    gloo = dist.new_group(backend="gloo")
    smp = dist.group.WORLD
    assert smp is not None
    assert dist.get_backend(smp) == "smp", dist.get_backend(smp)
    # What C++ callers that skip the Python methods ask for: a CPU backend (gloo's).
    assert smp._get_backend(torch.device("cpu")) is not None
    for what, run in (("functional", functional), ("compiled", compiled),
                      ("dtensor", dtensor), ("fsdp2", fsdp2), ("ddp", ddp)):
        on_both(smp, gloo, what, run)
    # A subgroup of smp too: DeviceMesh slices and FSDP2's HSDP meshes make them.
    evens = dist.new_group([r for r in range(size) if r % 2 == 0], backend="smp")
    evens_gloo = dist.new_group([r for r in range(size) if r % 2 == 0], backend="gloo")
    if rank % 2 == 0:
        on_both(evens, evens_gloo, "subgroup-functional", functional)
    else:
        case_ok("subgroup-functional")
    dist.destroy_process_group()


if __name__ == "__main__":
    main_guard(main)
