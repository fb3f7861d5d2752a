"""Rank layout: which global rank plays which (data, pipeline, context, tensor) coordinate.

The placement is a permutation of ``"CDPT"``; reading it right to left, each letter's
parallelism is performed over ranks that are closer together. ``"cluster"`` is ``"DPCT"``:
tensor-parallel peers are neighbours, then context-parallel peers, then pipeline stages, and
replicas are furthest apart. ``"spread"`` is ``"CTPD"``: replicas are neighbours and
tensor- and context-parallel peers furthest apart. A permutation of ``"DPT"`` (the form
before context parallelism) gets ``C`` just left of ``T``: context-parallel peers exchange
keys and values every layer, so they sit next to the tensor-parallel ones (with ``cp`` 1 the
letter changes nothing).

With degrees ``pp, tp, rdp, cp`` and the placement string ``WXYZ``, a rank's coordinates are
the mixed-radix digits of the rank with ``Z`` varying fastest::

    rank = ((w * deg(X) + x) * deg(Y) + y) * deg(Z) + z

Groups (each a sorted list of global ranks):

- ``PP_GROUP``: same (d, c, t), all p — one pipeline.
- ``TP_GROUP``: same (d, p, c), all t.
- ``CP_GROUP``: same (d, p, t), all c — one sequence split across ranks (same inputs).
- ``RDP_GROUP``: same (p, c, t), all d — the replicas that read different data.
- ``DP_GROUP``: same (p, c), all (d, t) — ``TP_GROUP`` is a subset of it (TP across DP).
- ``RDP_CP_GROUP`` / ``DP_CP_GROUP``: the same with all c — every rank holding the same
  parameters as this one; gradients are averaged over these (equal to the two above when
  ``cp`` is 1).
- ``MP_GROUP``: same (d, c), all (p, t) — one full model replica.
- ``EP_GROUP`` (expert parallelism, degree ``ep``): ``ep`` consecutive members of the
  ``RDP_GROUP`` (same (p, c, t), d in ``[b * ep, (b + 1) * ep)``) — they split the routed
  experts between them.
- ``EDP_GROUP``: same (p, c) and the same ``d % ep``, all t — the ranks holding the same experts
  (one per ep group and TP rank); expert gradients are averaged over it.

Ranks inside a group are ordered by global rank, so ``tp_rank`` is the index of this rank in
its ``TP_GROUP`` and so on. In particular ``dp_rank`` orders the data shards of a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

__all__ = ["Coord", "Topology", "with_context_axis"]


@dataclass(frozen=True)
class Coord:
    """A rank's coordinates: reduced-data-parallel, pipeline, tensor and context index."""

    d: int
    p: int
    t: int
    c: int = 0


_LETTERS = "CDPT"


class Topology:
    """Pure rank arithmetic for ``pp * tp * rdp * cp`` ranks under a placement (no communication)."""

    def __init__(self, pp: int, tp: int, rdp: int, placement: str = "DPCT", ep: int = 1,
                 cp: int = 1) -> None:
        if sorted(placement) == ["D", "P", "T"]:
            placement = with_context_axis(placement)
        if sorted(placement) != sorted(_LETTERS):
            raise ValueError(f"placement must be a permutation of 'CDPT', got {placement!r}")
        if ep < 1 or rdp % ep:
            raise ValueError(f"the expert-parallel degree {ep} must divide rdp={rdp}")
        if cp < 1:
            raise ValueError(f"the context-parallel degree must be >= 1, got {cp}")
        self.pp, self.tp, self.rdp, self.ep, self.cp = pp, tp, rdp, ep, cp
        self.placement = placement
        self.size = pp * tp * rdp * cp
        self._deg = {"D": rdp, "P": pp, "T": tp, "C": cp}
        self._coords = [self._coord_of(r) for r in range(self.size)]
        self._rank_of = {c: r for r, c in enumerate(self._coords)}

    def _coord_of(self, rank: int) -> Coord:
        digits: dict[str, int] = {}
        rest = rank
        for letter in reversed(self.placement):
            digits[letter] = rest % self._deg[letter]
            rest //= self._deg[letter]
        return Coord(d=digits["D"], p=digits["P"], t=digits["T"], c=digits["C"])

    def coord(self, rank: int) -> Coord:
        """Coordinates of a global rank."""
        return self._coords[rank]

    def rank(self, d: int, p: int, t: int, c: int = 0) -> int:
        """Global rank at the given coordinates."""
        return self._rank_of[Coord(d, p, t, c)]

    def _group(self, rank: int, vary: str) -> list[int]:
        here = self.coord(rank)
        ranges = {k: [getattr(here, k)] for k in "dptc"}
        for letter in vary:
            ranges[letter.lower()] = list(range(self._deg[letter]))
        return sorted(self.rank(d, p, t, c) for d, p, t, c in
                      product(ranges["d"], ranges["p"], ranges["t"], ranges["c"]))

    def pp_group(self, rank: int) -> list[int]:
        return self._group(rank, "P")

    def tp_group(self, rank: int) -> list[int]:
        return self._group(rank, "T")

    def cp_group(self, rank: int) -> list[int]:
        return self._group(rank, "C")

    def rdp_group(self, rank: int) -> list[int]:
        return self._group(rank, "D")

    def dp_group(self, rank: int) -> list[int]:
        return self._group(rank, "DT")

    def rdp_cp_group(self, rank: int) -> list[int]:
        return self._group(rank, "DC")

    def dp_cp_group(self, rank: int) -> list[int]:
        return self._group(rank, "DTC")

    def mp_group(self, rank: int) -> list[int]:
        return self._group(rank, "PT")

    def ep_group(self, rank: int) -> list[int]:
        replicas = self.rdp_group(rank)  # sorted by global rank, i.e. by d
        block = self.coord(rank).d // self.ep
        return [r for r in replicas if self.coord(r).d // self.ep == block]

    def edp_group(self, rank: int) -> list[int]:
        # Over the whole DP group (TP peers included): each TP rank feeds its own samples to
        # the (TP-replicated) experts, so every (d, t) with this d % ep holds these experts.
        peers = self.dp_group(rank)
        slot = self.coord(rank).d % self.ep
        return [r for r in peers if self.coord(r).d % self.ep == slot]

    def all_groups(self, kind: str) -> list[list[int]]:
        """Every distinct group of a kind (``"pp"``, ``"tp"``, ``"cp"``, ``"rdp"``, ``"dp"``,
        ``"rdp_cp"``, ``"dp_cp"``, ``"mp"``, ``"ep"``, ``"edp"``), in a fixed order that is the
        same on every rank."""
        fn = getattr(self, f"{kind}_group")
        seen: list[list[int]] = []
        for r in range(self.size):
            g = fn(r)
            if g not in seen:
                seen.append(g)
        return seen


def with_context_axis(placement: str) -> str:
    """A permutation of ``"DPT"`` with ``C`` inserted just left of ``T`` (``"DPT"`` → ``"DPCT"``)."""
    i = placement.index("T")
    return placement[:i] + "C" + placement[i:]
