"""Rank layout: which global rank plays which (data, pipeline, tensor) coordinate.

The placement is a permutation of ``"DPT"``; reading it right to left, each letter's
parallelism is performed over ranks that are closer together. ``"cluster"`` is ``"DPT"``:
tensor-parallel peers are neighbours, then pipeline stages, and replicas are furthest apart.
``"spread"`` is ``"TPD"``: replicas are neighbours and tensor-parallel peers furthest apart.

With degrees ``pp, tp, rdp`` and the placement string ``XYZ``, a rank's coordinates are the
mixed-radix digits of the rank with ``Z`` varying fastest::

    rank = x * (deg(Y) * deg(Z)) + y * deg(Z) + z

Groups (each a sorted list of global ranks):

- ``PP_GROUP``: same (d, t), all p — one pipeline.
- ``TP_GROUP``: same (d, p), all t.
- ``RDP_GROUP``: same (p, t), all d — the ranks that hold identical parameters.
- ``DP_GROUP``: same p, all (d, t) — ``TP_GROUP`` is a subset of it (TP across DP).
- ``MP_GROUP``: same d, all (p, t) — one full model replica.
- ``EP_GROUP`` (expert parallelism, degree ``ep``): ``ep`` consecutive members of the
  ``RDP_GROUP`` (same (p, t), d in ``[b * ep, (b + 1) * ep)``) — they split the routed
  experts between them.
- ``EDP_GROUP``: same p and the same ``d % ep``, all t — the ranks holding the same experts
  (one per ep group and TP rank); expert gradients are averaged over it.

Ranks inside a group are ordered by global rank, so ``tp_rank`` is the index of this rank in
its ``TP_GROUP`` and so on. In particular ``dp_rank`` orders the data shards of a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

__all__ = ["Coord", "Topology"]


@dataclass(frozen=True)
class Coord:
    """A rank's coordinates: reduced-data-parallel, pipeline and tensor index."""

    d: int
    p: int
    t: int


class Topology:
    """Pure rank arithmetic for ``pp * tp * rdp`` ranks under a placement (no communication)."""

    def __init__(self, pp: int, tp: int, rdp: int, placement: str = "DPT", ep: int = 1) -> None:
        if sorted(placement) != ["D", "P", "T"]:
            raise ValueError(f"placement must be a permutation of 'DPT', got {placement!r}")
        if ep < 1 or rdp % ep:
            raise ValueError(f"the expert-parallel degree {ep} must divide rdp={rdp}")
        self.pp, self.tp, self.rdp, self.ep = pp, tp, rdp, ep
        self.placement = placement
        self.size = pp * tp * rdp
        self._deg = {"D": rdp, "P": pp, "T": tp}
        self._coords = [self._coord_of(r) for r in range(self.size)]
        self._rank_of = {c: r for r, c in enumerate(self._coords)}

    def _coord_of(self, rank: int) -> Coord:
        digits: dict[str, int] = {}
        rest = rank
        for letter in reversed(self.placement):
            digits[letter] = rest % self._deg[letter]
            rest //= self._deg[letter]
        return Coord(d=digits["D"], p=digits["P"], t=digits["T"])

    def coord(self, rank: int) -> Coord:
        """Coordinates of a global rank."""
        return self._coords[rank]

    def rank(self, d: int, p: int, t: int) -> int:
        """Global rank at the given coordinates."""
        return self._rank_of[Coord(d, p, t)]

    def _group(self, rank: int, vary: str) -> list[int]:
        c = self.coord(rank)
        fixed = {"d": c.d, "p": c.p, "t": c.t}
        ranges = {k: [v] for k, v in fixed.items()}
        for letter in vary:
            key = letter.lower()
            ranges[key] = list(range(self._deg[letter]))
        ranks = [self.rank(d, p, t) for d, p, t in product(ranges["d"], ranges["p"], ranges["t"])]
        return sorted(ranks)

    def pp_group(self, rank: int) -> list[int]:
        return self._group(rank, "P")

    def tp_group(self, rank: int) -> list[int]:
        return self._group(rank, "T")

    def rdp_group(self, rank: int) -> list[int]:
        return self._group(rank, "D")

    def dp_group(self, rank: int) -> list[int]:
        return self._group(rank, "DT")

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
        """Every distinct group of a kind (``"pp"``, ``"tp"``, ``"rdp"``, ``"dp"``, ``"mp"``,
        ``"ep"``, ``"edp"``),
        in a fixed order that is the same on every rank."""
        fn = getattr(self, f"{kind}_group")
        seen: list[list[int]] = []
        for r in range(self.size):
            g = fn(r)
            if g not in seen:
                seen.append(g)
        return seen
