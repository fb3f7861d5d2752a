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

from bisect import bisect_left, bisect_right
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


_SCAN = 256


def segment(
    costs: Sequence[int], k: int, penalty: Sequence[int] | None = None
) -> list[tuple[int, int]]:
    """An optimal split of ``costs`` into exactly ``min(k, len(costs))`` non-empty segments.

    Returns ``[(start, end), ...]`` half-open index ranges covering the sequence in order.
    Among the optimal splits it returns a canonical, balanced one: scanning from the left,
    each segment ends where its sum is closest to an equal share of what is left (ties to
    the shorter segment), among the ends that keep the rest splittable within the optimum.
    So when one heavy element sets the optimum, the other segments still share the rest
    evenly instead of some being packed to the optimum and the last ones left nearly empty.

    With ``penalty`` (one value per index: the price of starting a segment there), each
    end is instead the cheapest allowed one within ``_SCAN`` positions of the balanced
    choice, ties going to the better balanced. The split stays optimal.
    """
    m = len(costs)
    if m == 0:
        if k < 1:
            raise ValueError(f"number of segments must be >= 1, got {k}")
        return []
    best = min_max_value(costs, k)
    k = min(k, m)
    prefix = list(accumulate(costs, initial=0))
    total = prefix[m]
    # after[j]: the smallest start from which the tail splits into j segments within
    # ``best`` (a greedy from the right end that makes each segment as long as allowed).
    after = [m] * k
    pos = m
    for j in range(1, k):
        if pos > 0:
            pos = bisect_left(prefix, prefix[pos] - best, 0, pos)
        after[j] = min(pos, m - j)
    bounds: list[tuple[int, int]] = []
    start = 0
    for i in range(k):
        left = k - i - 1
        if left == 0:
            bounds.append((start, m))
            break
        base = prefix[start]
        hi = min(bisect_right(prefix, base + best, start + 1, m + 1) - 1, m - left)
        lo = max(start + 1, after[left])
        share = (total - base) // (left + 1)
        end = bisect_left(prefix, base + share, lo, hi + 1)
        # ``end`` is the first end reaching the share; the one before may be closer.
        if end > hi or (end > lo and base + share - prefix[end - 1] <= prefix[end] - base - share):
            end -= 1
        if penalty is not None:
            target = base + share
            end = min(
                range(max(lo, end - _SCAN), min(hi, end + _SCAN) + 1),
                key=lambda e: (penalty[e], abs(prefix[e] - target)),
            )
        bounds.append((start, end))
        start = end
    return bounds
