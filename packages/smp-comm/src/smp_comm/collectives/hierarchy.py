"""Group set-up, and collectives across hosts: within each host by its segment, between hosts
by one leader per host (the host's lowest group rank) over a gloo group of the leaders.

Floating-point all-reduces stay in a fixed order across hosts too: each host reduces its
ranks in rank order, then every leader gathers the hosts' partial results and adds them in
host order, so every rank gets the same bits. All-gather, broadcast and integer reductions
are exact. The shared-memory and the inter-host stages run one after the other (not
overlapped).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroupGloo

from smp_comm.collectives.local import LocalCollectives, reduce_into
from smp_comm.collectives.shm import Segment

__all__ = ["HierarchicalCollectives", "build_collectives"]


def _segment(
    store: Any, key: str, local_rank: int, n: int, slot_bytes: int, timeout: float
) -> Segment:
    """Map the host's segment: local rank 0 creates it, the rest find its path in the store."""
    if local_rank == 0:
        seg = Segment.create(n, slot_bytes, 0, timeout)
        store.set(f"{key}/path", seg.path)
    else:
        seg = Segment(store.get(f"{key}/path").decode(), local_rank, n, slot_bytes, timeout)
    store.set(f"{key}/attached/{local_rank}", "1")
    store.wait([f"{key}/attached/{i}" for i in range(n)])
    seg.start()
    if local_rank == 0:
        seg.unlink()  # every rank has it mapped: no name left behind, even after a crash
    return seg


def build_collectives(
    store: Any, rank: int, size: int, node: str, slot_bytes: int, timeout: float
) -> LocalCollectives | HierarchicalCollectives:
    """The collectives of group rank ``rank``: shared memory alone when every rank is on
    this rank's host ``node``, hierarchical otherwise. Collective: every rank calls it."""
    store.set(f"smp-node/{rank}", node)
    nodes = [store.get(f"smp-node/{r}").decode() for r in range(size)]
    order = list(dict.fromkeys(nodes))  # hosts in order of their lowest rank
    mine = [r for r in range(size) if nodes[r] == node]
    host = order.index(node)
    seg = _segment(store, f"smp-seg/{host}", mine.index(rank), len(mine), slot_bytes, timeout)
    local = LocalCollectives(seg)
    if len(order) == 1:
        return local
    groups = [[r for r in range(size) if nodes[r] == h] for h in order]
    return HierarchicalCollectives(local, groups, host, rank, store, timeout)


class HierarchicalCollectives:
    """The collectives of a group whose ranks span hosts (``groups[h]``: host ``h``'s ranks)."""

    def __init__(
        self, local: LocalCollectives, groups: list[list[int]], host: int, rank: int,
        store: Any, timeout: float,
    ) -> None:
        self.local, self.groups, self.host, self.rank = local, groups, host, rank
        self.size = sum(len(g) for g in groups)
        self.leader = groups[host][0] == rank
        self.host_of = {r: h for h, g in enumerate(groups) for r in g}
        self._leaders: Any = None
        if self.leader:
            self._leaders = ProcessGroupGloo(
                dist.PrefixStore("smp-leaders/", store), host, len(groups),
                timedelta(seconds=timeout),
            )

    def fail(self) -> None:
        """Mark this rank failed in its host's segment (its host peers raise)."""
        self.local.seg.fail()

    def _gather_hosts(self, flat: torch.Tensor) -> torch.Tensor:
        """(leaders only) every host's ``flat``, one row per host."""
        rows = torch.empty((len(self.groups), flat.numel()), dtype=flat.dtype)
        # As bytes: gloo moves only some dtypes (not bool, not the unsigned ones).
        raw = rows.view(-1).view(torch.uint8)
        self._leaders._allgather_base(raw, flat.view(torch.uint8), c10d.AllgatherOptions()).wait()
        return rows

    def barrier(self) -> None:
        """Return once every rank has called it."""
        self.local.barrier()
        if self.leader:
            self._gather_hosts(torch.zeros(1))
        self.local.barrier()

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """``out`` = every rank's ``inp`` in rank order."""
        c, widest = inp.numel(), max(len(g) for g in self.groups)
        block = torch.zeros(widest * c, dtype=inp.dtype)  # padded: gloo gathers equal sizes
        mine = self.groups[self.host]
        self.local.all_gather(block[: len(mine) * c], inp)
        if self.leader:
            rows = self._gather_hosts(block).view(len(self.groups), widest, c)
            dst = out.view(self.size, c)
            for h, g in enumerate(self.groups):
                for i, r in enumerate(g):
                    dst[r].copy_(rows[h, i])
        self.local.broadcast(out, 0)

    def all_reduce(self, t: torch.Tensor, op: str) -> None:
        """``t`` = the reduction of every rank's ``t``: hosts in order, ranks in order."""
        inner = "sum" if op == "avg" else op
        self.local.all_reduce(t, inner)
        if self.leader:
            rows = self._gather_hosts(t)
            reduce_into(t, list(rows), inner, len(self.groups))
            if op == "avg":
                t.div_(self.size)
        self.local.broadcast(t, 0)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str) -> None:
        """``out`` = the reduction of block ``rank`` of every rank's ``inp`` (by an all-reduce
        of the whole input: simple, and exact in the same order as :meth:`all_reduce`)."""
        whole = inp.clone()
        self.all_reduce(whole, op)
        out.copy_(whole.view(self.size, -1)[self.rank])

    def broadcast(self, t: torch.Tensor, root: int) -> None:
        """Every rank's ``t`` = ``root``'s."""
        src = self.host_of[root]
        if self.host == src:
            self.local.broadcast(t, self.groups[src].index(root))
        if self.leader:
            opts = c10d.BroadcastOptions()
            opts.rootRank = src
            self._leaders.broadcast([t.view(torch.uint8)], opts).wait()
        if self.host != src:
            self.local.broadcast(t, 0)
