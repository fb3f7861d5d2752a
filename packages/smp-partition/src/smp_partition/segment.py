"""Optimal contiguous min–max segmentation (paper Appendix C.4, problem (2)).

Split a sequence of non-negative integer costs into ``k`` contiguous segments so that
the largest segment sum is as small as possible. Instead of the O(k·n²) dynamic program
(3) we search the optimum directly: a greedy "probe" decides in O(k log n) whether a
bottleneck ``T`` is feasible (each segment extends as far as ``T`` allows, found by binary
search over prefix sums), and a bisection over ``T`` that jumps to the next candidate
value on each side (a feasible probe lowers ``hi`` to the largest segment it built, an
infeasible one raises ``lo`` to the smallest sum a segment would have needed to grow) finds
the exact optimum in few probes. Costs are integers, so everything is exact.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from itertools import accumulate


def _probe(prefix: list[int], k: int, limit: int) -> tuple[bool, int, int]:
    """Greedy check of bottleneck ``limit`` (every single cost must be <= limit).

    Returns ``(feasible, largest segment built, smallest sum that would have let a
    segment grow)``; when infeasible, the optimum is at least the third value.
    """
    m = len(prefix) - 1
    start = 0
    count = 0
    largest = 0
    grow = -1
    while start < m:
        if count == k:
            return False, largest, grow
        base = prefix[start]
        end = bisect_right(prefix, base + limit, start + 1, m + 1) - 1
        seg = prefix[end] - base
        if seg > largest:
            largest = seg
        if end < m:
            need = prefix[end + 1] - base
            if grow < 0 or need < grow:
                grow = need
        count += 1
        start = end
    return True, largest, grow


def min_max_value(costs: Sequence[int], k: int) -> int:
    """The optimal bottleneck of splitting ``costs`` into at most ``k`` contiguous parts."""
    if k < 1:
        raise ValueError(f"number of segments must be >= 1, got {k}")
    m = len(costs)
    if m == 0:
        return 0
    k = min(k, m)
    prefix = list(accumulate(costs, initial=0))
    total = prefix[-1]
    biggest = max(costs)
    lo = max(biggest, -(-total // k))
    # Greedy at total/k + biggest always fits in k segments, so this first probe succeeds.
    ok, hi, _ = _probe(prefix, k, lo + biggest)
    assert ok
    while lo < hi:
        mid = (lo + hi) // 2
        ok, largest, grow = _probe(prefix, k, mid)
        if ok:
            hi = largest
        else:
            lo = max(mid + 1, grow)
    return hi


def segment(costs: Sequence[int], k: int) -> list[tuple[int, int]]:
    """An optimal split of ``costs`` into exactly ``min(k, len(costs))`` non-empty segments.

    Returns ``[(start, end), ...]`` half-open index ranges covering the sequence in order.
    Among the optimal splits it returns the canonical one that makes every segment as long
    as the optimum allows, scanning from the left, while leaving one element for each
    remaining segment.
    """
    m = len(costs)
    if m == 0:
        if k < 1:
            raise ValueError(f"number of segments must be >= 1, got {k}")
        return []
    best = min_max_value(costs, k)
    k = min(k, m)
    prefix = list(accumulate(costs, initial=0))
    bounds: list[tuple[int, int]] = []
    start = 0
    for i in range(k):
        left = k - i - 1
        if left == 0:
            end = m
        else:
            end = bisect_right(prefix, prefix[start] + best, start + 1, m + 1) - 1
            end = min(end, m - left)
        bounds.append((start, end))
        start = end
    return bounds
