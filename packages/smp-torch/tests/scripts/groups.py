"""Check ranks, groups and the object-communication API for several layouts (4 ranks)."""

from __future__ import annotations

import os

import smp_torch as smp
import torch
import torch.distributed as dist

LAYOUTS = [
    {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "placement_strategy": "cluster"},
    {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "placement_strategy": "spread"},
    {"partitions": 2, "placement_strategy": "PDT"},
    {"tensor_parallel_degree": 2, "placement_strategy": "TDP"},
    {},
]


KINDS = ("pp", "tp", "dp", "rdp", "mp")


def threads() -> int:
    """Native threads of this process (torch's gloo threads included)."""
    return len(os.listdir("/proc/self/task"))


def check(config: dict) -> None:
    cfg = smp.init(config)
    r = smp.rank()
    assert smp.size() == 4 and smp.pp_size() * smp.tp_size() * smp.rdp_size() == smp.size()
    assert set(smp.get_tp_group()) <= set(smp.get_dp_group())
    assert smp.dp_size() == smp.tp_size() * smp.rdp_size() == len(smp.get_dp_group())
    for kind in KINDS:
        members = getattr(smp, f"get_{kind}_group")()
        assert r in members
        assert getattr(smp, f"{kind}_rank")() == members.index(r)
        assert getattr(smp, f"{kind}_size")() == len(members)
        # Each torch.distributed group really spans exactly those ranks.
        t = torch.tensor([float(r)])
        dist.all_reduce(t, group=getattr(smp, f"get_{kind}_process_group")())
        assert t.item() == float(sum(members)), (kind, t.item(), members)
        # Object collectives agree with the rank lists.
        group = getattr(smp, f"{kind.upper()}_GROUP")
        assert smp.allgather(r, group) == members, (kind, members)
    # An smp.nn layer built directly, outside smp.tensor_parallelism(), splits over this
    # job's tensor-parallel group, not the world (it took the world group before).
    linear = smp.nn.DistributedLinear(8, 12)
    assert dist.get_process_group_ranks(linear.tp_group) == smp.get_tp_group(), (
        config, dist.get_process_group_ranks(linear.tp_group), smp.get_tp_group())
    assert linear.weight.numel() * smp.tp_size() == 8 * 12, (config, tuple(linear.weight.shape))
    # Every rank's coordinate is unique: (pp_rank, tp_rank, rdp_rank) identifies the rank.
    coords = smp.allgather((smp.pp_rank(), smp.tp_rank(), smp.rdp_rank()))
    assert len(set(coords)) == 4
    # Layout documented in the topology module: cluster = TP peers are neighbours.
    if cfg.placement_strategy == "cluster" and cfg.tp == 2:
        assert smp.get_tp_group() == [r - r % 2, r - r % 2 + 1]
    if cfg.placement_strategy == "spread" and cfg.tp == 2:
        assert smp.get_tp_group() == [r % 2, r % 2 + 2]
    # Point to point, one-sided broadcast, barrier.
    if r == 0:
        smp.send({"x": torch.arange(3)}, 1)
        smp.broadcast("hello", smp.WORLD)
    else:
        if r == 1:
            got = smp.recv_from(0)
            assert torch.equal(got["x"], torch.arange(3))
        assert smp.recv_from(0) == "hello"
    smp.barrier()
    if r == 0:
        print(f"LAYOUT-OK {config}", flush=True)


def main() -> None:
    first = {}
    for layout in LAYOUTS:
        check(layout)
        first[str(layout)] = [getattr(smp, f"get_{k}_process_group")() for k in KINDS]
    after_first = threads()
    # Again: smp.init finds the groups it made for the same members (smp_torch.group_cache);
    # before, every init made new ones and the threads of the old ones piled up (15 per
    # init and rank here).
    for layout in LAYOUTS:
        check(layout)
        again = [getattr(smp, f"get_{k}_process_group")() for k in KINDS]
        assert all(a is b for a, b in zip(again, first[str(layout)])), f"new groups for {layout}"
    grown = threads() - after_first
    assert grown <= 2, f"{grown} more threads after re-initialising {len(LAYOUTS)} layouts"
    smp.barrier()
    if smp.rank() == 0:
        print(f"REINIT-OK threads {after_first} -> {after_first + grown}", flush=True)
    reinit_after_failure()


def reinit_after_failure() -> None:
    """A step that fails on one rank: the next init makes new groups on every rank (a
    collective the failed rank never joined may still be pending on the old ones), and they
    work."""
    smp.init({})
    before = smp.get_dp_process_group()
    model = smp.DistributedModel(torch.nn.Linear(4, 1))

    @smp.step
    def train_step(x: torch.Tensor) -> torch.Tensor:
        if smp.rank() == 1:
            raise ValueError("injected")
        loss = model(x).sum()
        model.backward(loss)
        return loss

    try:
        train_step(torch.ones(2, 4))
    except Exception as exc:  # noqa: BLE001 - every rank raises: ValueError or PeerFailedError
        caught = type(exc).__name__
    else:
        raise AssertionError("the failed step raised nothing")
    smp.init({})
    after = smp.get_dp_process_group()
    assert after is not before, "the groups of the failed configuration were reused"
    t = torch.tensor([1.0])
    dist.all_reduce(t, group=after)
    assert t.item() == smp.dp_size(), t
    print(f"REINIT-AFTER-FAILURE-OK rank {smp.rank()} ({caught})", flush=True)


if __name__ == "__main__":
    main()
