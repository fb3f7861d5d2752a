"""Optimal contiguous min-max segmentation against brute force, and D'Hondt by hand."""

from __future__ import annotations

import random
from itertools import combinations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from smp_partition.dhondt import dhondt, dhondt_seats
from smp_partition.segment import min_max_value, segment


def brute(costs: list[int], k: int) -> int:
    """Min over every split into exactly min(k, n) non-empty contiguous parts."""
    n = len(costs)
    k = min(k, n)
    best = None
    for cuts in combinations(range(1, n), k - 1):
        edges = (0, *cuts, n)
        worst = max(sum(costs[a:b]) for a, b in zip(edges, edges[1:]))
        best = worst if best is None else min(best, worst)
    assert best is not None
    return best


def linear_reference(costs: list[int], k: int) -> int:
    """Plain bisection over integers with a linear greedy: a second, independent method."""

    def fits(limit: int) -> bool:
        parts, run = 1, 0
        for c in costs:
            if c > limit:
                return False
            if run + c > limit:
                parts, run = parts + 1, c
            else:
                run += c
        return parts <= k

    lo, hi = 0, sum(costs)
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def check_bounds(bounds: list[tuple[int, int]], n: int, k: int) -> None:
    assert len(bounds) == min(k, n)
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    for (_, b), (c, _) in zip(bounds, bounds[1:]):
        assert b == c
    assert all(a < b for a, b in bounds)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 30), min_size=1, max_size=9),
    st.integers(1, 10),
    st.lists(st.integers(0, 5), min_size=9, max_size=9),
)
def test_optimal_against_brute_force(costs: list[int], k: int, penalty: list[int]) -> None:
    best = brute(costs, k)
    assert min_max_value(costs, k) == best
    for choice in (None, penalty):
        bounds = segment(costs, k, choice)
        check_bounds(bounds, len(costs), k)
        assert max(sum(costs[a:b]) for a, b in bounds) == best


def test_penalty_picks_cheap_boundaries() -> None:
    # optimum 4; balanced ends would be 3 and 6 or 7, the penalty asks for 4 and 8
    costs = [1] * 10
    cheap = [9, 9, 9, 9, 0, 9, 9, 9, 0, 9]
    assert segment(costs, 3, cheap) == [(0, 4), (4, 8), (8, 10)]


def test_large_against_linear_reference() -> None:
    rng = random.Random(7)
    for n, k in ((5000, 97), (3000, 1024), (200, 3), (50, 50)):
        costs = [rng.choice((0, 1, 5, rng.randrange(10**15))) for _ in range(n)]
        best = linear_reference(costs, k)
        assert min_max_value(costs, k) == best
        bounds = segment(costs, k)
        check_bounds(bounds, n, k)
        assert max(sum(costs[a:b]) for a, b in bounds) == best


def test_examples() -> None:
    assert segment([1, 1, 1, 1], 2) == [(0, 2), (2, 4)]
    # optimum 10; the balanced canonical split is 5 | 10 | 7 rather than 10 | 10 | 2
    assert segment([5, 5, 5, 5, 1, 1], 3) == [(0, 1), (1, 3), (3, 6)]
    # one heavy element sets the optimum; the rest is still shared evenly
    assert segment([100, 10, 10, 10, 10, 10, 10], 4) == [(0, 1), (1, 3), (3, 5), (5, 7)]
    assert segment([0, 0, 0], 2) == [(0, 1), (1, 3)]  # zeros: still non-empty segments
    assert segment([3], 5) == [(0, 1)]
    assert segment([], 2) == []
    with pytest.raises(ValueError):
        segment([1], 0)


def test_dhondt_textbook() -> None:
    # The textbook example: 8 seats for 100k, 80k, 30k and 20k votes -> 4, 3, 1, 0.
    assert dhondt_seats([100_000, 80_000, 30_000, 20_000], 8) == [4, 3, 1, 0]


def test_dhondt_hand_worked_devices() -> None:
    # quotients 7 | 3 -> seg1; 3.5 | 3 -> seg1; 2.33 | 3 -> seg0; 2.33 | 1.5 -> seg1
    assert dhondt([0, 1, 2, 3], [3, 7]) == [[2], [0, 1, 3]]
    # ties go to the earlier segment: 5 | 5 -> seg0; 2.5 | 5 -> seg1; 2.5 | 2.5 -> seg0
    assert dhondt([0, 1, 2], [5, 5]) == [[0, 2], [1]]
    # Per-segment divisors, not the paper's shared counter: 10 | 3 -> 5, 3.33, 2.5 against
    # 3 gives seg0 three devices; the shared counter would have divided seg0 down to
    # 10/2/3 = 1.67 after two seats and given the third device to seg1.
    assert dhondt([0, 1, 2, 3], [10, 3]) == [[0, 1, 2], [3]]
    assert dhondt([4, 5], [0, 0, 0]) == [[4, 5], [], []]
    assert dhondt([], [1, 2]) == [[], []]
