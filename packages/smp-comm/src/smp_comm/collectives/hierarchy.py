"""Group set-up, and collectives across hosts: within each host by its segment, between hosts
by one leader per host (the host's lowest group rank) over a gloo group of the leaders.

Floating-point all-reduces stay in a fixed order across hosts too: each host reduces its
ranks in rank order, then every leader gathers the hosts' partial results and adds them in
host order, so every rank gets the same bits. All-gather, broadcast and integer reductions
are exact.

The two stages overlap: a tensor is cut into pieces of ``chunk_bytes``
(``SMP_COMM_COLL_HOST_CHUNK_BYTES``, 4 MiB), and while the leaders exchange one piece
between hosts (gloo runs it on its own threads) the host's ranks already work on the next
in shared memory; the last stage (the host-wide broadcast of a finished piece) overlaps
the exchange of the pieces after it. Cutting changes no element's order of reduction.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroupGloo

from smp_comm.collectives.local import LocalCollectives, flat, reduce_into
from smp_comm.collectives.shm import Segment

__all__ = ["DEFAULT_HOST_CHUNK_BYTES", "HierarchicalCollectives", "build_collectives"]

DEFAULT_HOST_CHUNK_BYTES = 4 << 20


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
    store: Any, rank: int, size: int, node: str, slot_bytes: int, timeout: float,
    chunk_bytes: int = DEFAULT_HOST_CHUNK_BYTES, labels: list[str] | None = None,
) -> LocalCollectives | HierarchicalCollectives:
    """The collectives of group rank ``rank``: shared memory alone when every rank is on
    this rank's host ``node``, hierarchical otherwise. Collective: every rank calls it.
    ``labels[r]`` names group rank ``r`` in errors."""
    store.set(f"smp-node/{rank}", node)
    nodes = [store.get(f"smp-node/{r}").decode() for r in range(size)]
    order = list(dict.fromkeys(nodes))  # hosts in order of their lowest rank
    mine = [r for r in range(size) if nodes[r] == node]
    host = order.index(node)
    seg = _segment(store, f"smp-seg/{host}", mine.index(rank), len(mine), slot_bytes, timeout)
    if labels is not None:
        seg.labels = [labels[r] for r in mine]
    local = LocalCollectives(seg)
    if len(order) == 1:
        return local
    groups = [[r for r in range(size) if nodes[r] == h] for h in order]
    return HierarchicalCollectives(local, groups, host, rank, store, timeout, chunk_bytes)


class HierarchicalCollectives:
    """The collectives of a group whose ranks span hosts (``groups[h]``: host ``h``'s ranks)."""

    def __init__(
        self, local: LocalCollectives, groups: list[list[int]], host: int, rank: int,
        store: Any, timeout: float, chunk_bytes: int = DEFAULT_HOST_CHUNK_BYTES,
    ) -> None:
        self.local, self.groups, self.host, self.rank = local, groups, host, rank
        self.chunk_bytes = chunk_bytes
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

    def _ranges(self, total: int, item_bytes: int) -> list[tuple[int, int]]:
        """``[lo, hi)`` element ranges of at most ``chunk_bytes`` each (one, maybe empty, at
        least: every rank takes the same steps for the same call)."""
        step = max(1, self.chunk_bytes // max(1, item_bytes))
        return [(lo, min(total, lo + step)) for lo in range(0, total, step)] or [(0, 0)]

    def _gather_hosts(self, flat: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """(leaders only) start gathering every host's ``flat``: the rows (one per host)
        and the gloo work to wait on before reading them."""
        rows = torch.empty((len(self.groups), flat.numel()), dtype=flat.dtype)
        # As bytes: gloo moves only some dtypes (not bool, not the unsigned ones).
        raw = rows.view(-1).view(torch.uint8)
        work = self._leaders._allgather_base(raw, flat.view(torch.uint8), c10d.AllgatherOptions())
        return rows, work

    def barrier(self) -> None:
        """Return once every rank has called it."""
        self.local.barrier()
        if self.leader:
            self._gather_hosts(torch.zeros(1))[1].wait()
        self.local.barrier()

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """``out`` = every rank's ``inp`` in rank order."""
        c, widest, mine = inp.numel(), max(len(g) for g in self.groups), self.groups[self.host]
        dst = out.view(self.size, c)
        ranges = self._ranges(c, inp.element_size() * self.size)
        started = []
        for lo, hi in ranges:  # host stage of each piece; its exchange starts at once
            block = torch.zeros((widest, hi - lo), dtype=inp.dtype)  # padded: gloo gathers equal sizes
            self.local.all_gather(block[: len(mine)].view(-1), inp[lo:hi])
            started.append(self._gather_hosts(block.view(-1)) if self.leader else None)
        for (lo, hi), job in zip(ranges, started):
            stage = torch.empty((self.size, hi - lo), dtype=inp.dtype)
            if job is not None:
                rows, work = job
                work.wait()
                rows = rows.view(len(self.groups), widest, hi - lo)
                for h, g in enumerate(self.groups):
                    for i, r in enumerate(g):
                        stage[r].copy_(rows[h, i])
            self.local.broadcast(stage.view(-1), 0)
            dst[:, lo:hi].copy_(stage)

    def all_reduce(self, t: torch.Tensor, op: str) -> None:
        """``t`` = the reduction of every rank's ``t``: hosts in order, ranks in order."""
        inner = "sum" if op == "avg" else op
        t = flat(t)
        pieces = [t[lo:hi] for lo, hi in self._ranges(t.numel(), t.element_size())]
        started = []
        for piece in pieces:
            self.local.all_reduce(piece, inner)
            started.append(self._gather_hosts(piece) if self.leader else None)
        for piece, job in zip(pieces, started):
            if job is not None:
                rows, work = job
                work.wait()
                reduce_into(piece, list(rows), inner, len(self.groups))
                if op == "avg":
                    piece.div_(self.size)
            self.local.broadcast(piece, 0)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str) -> None:
        """``out`` = the reduction of block ``rank`` of every rank's ``inp`` (by an all-reduce
        of the whole input: simple, and exact in the same order as :meth:`all_reduce`)."""
        whole = inp.clone()
        self.all_reduce(whole, op)
        out.copy_(whole.view(self.size, -1)[self.rank])

    def broadcast(self, t: torch.Tensor, root: int) -> None:
        """Every rank's ``t`` = ``root``'s."""
        src = self.host_of[root]
        pieces = [t[lo:hi] for lo, hi in self._ranges(t.numel(), t.element_size())]
        opts = c10d.BroadcastOptions()
        opts.rootRank = src
        works: list[Any] = []
        for piece in pieces:  # the root's host, piece by piece; every leader posts its part
            if self.host == src:
                self.local.broadcast(piece, self.groups[src].index(root))
            if self.leader:
                works.append(self._leaders.broadcast([piece.view(torch.uint8)], opts))
        for i, piece in enumerate(pieces):
            if self.leader:
                works[i].wait()
            if self.host != src:
                self.local.broadcast(piece, 0)
