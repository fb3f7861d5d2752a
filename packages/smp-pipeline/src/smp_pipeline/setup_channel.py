"""The pipeline ranks' setup collectives: broadcast from the driver, gather to one rank.

Used outside steps (the automatic partition's placement, full state dicts, the timeline),
on the runtime's second tag (``tag + 1``) so they never match a step's messages. Every wait
is bounded by the runtime's ``timeout_s``: a rank that never joins raises instead of hanging.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class SetupChannel:
    """Broadcast and gather over ``comm`` among the pipeline's ranks (``comm_ranks[r]`` is
    pp rank ``r``; pp rank 0 is the driver)."""

    def __init__(
        self, comm: Any, comm_ranks: Sequence[int], pp_rank: int, tag: int, timeout_s: float
    ) -> None:
        self.comm = comm
        self.comm_ranks = list(comm_ranks)
        self.pp_rank = pp_rank
        self.tag = tag
        self.timeout_s = timeout_s

    def bcast(self, obj: Any) -> Any:
        """The driver's ``obj`` on every pp rank."""
        if self.pp_rank == 0:
            sends = [
                self.comm.isend(obj, dest=rank, tag=self.tag) for rank in self.comm_ranks[1:]
            ]
            for h in sends:
                h.wait(timeout=self.timeout_s)
            return obj
        got, _, _ = self.comm.irecv(source=self.comm_ranks[0], tag=self.tag).wait(
            timeout=self.timeout_s
        )
        return got

    def gather(self, obj: Any, dst: int) -> list[Any] | None:
        """Every pp rank's ``obj`` in pp rank order on ``dst``; None elsewhere."""
        if self.pp_rank != dst:
            self.comm.isend(obj, dest=self.comm_ranks[dst], tag=self.tag).wait(
                timeout=self.timeout_s
            )
            return None
        out = []
        for r, rank in enumerate(self.comm_ranks):
            if r == dst:
                out.append(obj)
                continue
            got, _, _ = self.comm.irecv(source=rank, tag=self.tag).wait(timeout=self.timeout_s)
            out.append(got)
        return out
