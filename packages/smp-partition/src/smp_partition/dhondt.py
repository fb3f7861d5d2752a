"""D'Hondt allocation of devices to segments (paper Algorithm 3, corrected:
see below and "Algorithms" in docs/packages/smp-partition.md).

Devices are handed out one at a time, in the given order, to the segment with the largest
quotient ``cost / (seats + 1)``; ties go to the earliest segment. (The paper's pseudo-code
divides by one counter shared by all segments; the D'Hondt method it cites, and this code,
divide each segment's cost by its own seat count plus one.)
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


class _Quotient:
    """Heap entry ordered by larger ``cost/(seats+1)`` first, then lower index (exact)."""

    __slots__ = ("cost", "div", "index")

    def __init__(self, cost: int, div: int, index: int) -> None:
        self.cost = cost
        self.div = div
        self.index = index

    def __lt__(self, other: _Quotient) -> bool:
        left = self.cost * other.div
        right = other.cost * self.div
        if left != right:
            return left > right
        return self.index < other.index


def dhondt(devices: Sequence[int], costs: Sequence[int]) -> list[list[int]]:
    """Allocate ``devices`` (in order) to segments with non-negative ``costs``.

    Returns one device list per segment; a segment may receive none.
    """
    if any(c < 0 for c in costs):
        raise ValueError("segment costs must be non-negative")
    out: list[list[int]] = [[] for _ in costs]
    if not costs:
        return out
    heap = [_Quotient(c, 1, i) for i, c in enumerate(costs)]
    heapq.heapify(heap)
    for device in devices:
        top = heap[0]
        out[top.index].append(device)
        heapq.heapreplace(heap, _Quotient(top.cost, top.div + 1, top.index))
    return out


def dhondt_seats(costs: Sequence[int], seats: int) -> list[int]:
    """How many of ``seats`` devices each segment receives."""
    return [len(p) for p in dhondt(range(seats), costs)]
