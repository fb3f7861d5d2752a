"""The cost model (docs/packages/smp-partition.md, "Cost model")."""

from __future__ import annotations

import pytest
from conftest import expected_costs
from smp_partition import Module, ModuleGraph, partition
from smp_partition.costs import compute_costs
from smp_partition.tree import build_tree


def costs(graph: ModuleGraph, alpha: float) -> dict[str, float]:
    c = compute_costs(graph, build_tree(graph), alpha)
    return {m.name: c.module_cost[i] for i, m in enumerate(graph.modules)}


def test_memory_counts_shared_once_and_activations_in_fp32_elements() -> None:
    g = ModuleGraph(
        [Module("", children=("e", "h")), Module("e", params={"w": 60}),
         Module("h", params={"w": 60, "b": 20}, activation_bytes=80)]
    )  # fmt: skip
    c = costs(g, 1.0)
    # w counted once (on e), h holds b=20 and 80 bytes = 20 elements: total 100.
    assert c == pytest.approx({"": 0.0, "e": 0.6, "h": 0.4})


def test_compute_counts_modules_without_times() -> None:
    g = ModuleGraph([Module("", children=("a", "b")), Module("a"), Module("b")])
    assert costs(g, 0.0) == pytest.approx({"": 1 / 3, "a": 1 / 3, "b": 1 / 3})


def test_compute_uses_exclusive_times_clamped() -> None:
    g = ModuleGraph(
        [Module("", children=("a", "b"), forward_ms=10.0),
         Module("a", children=("c",), forward_ms=6.0), Module("b", forward_ms=2.0),
         Module("c", forward_ms=7.0)]
    )  # fmt: skip
    # exclusive: '' 10-8=2, a 6-7 -> 0, b 2, c 7: total 11
    assert costs(g, 0.0) == pytest.approx({"": 2 / 11, "a": 0.0, "b": 2 / 11, "c": 7 / 11})


def test_components_are_normalised_before_mixing() -> None:
    g = ModuleGraph([Module("", children=("a",)), Module("a", params={"w": 10**9})])
    # memory all on a, compute split evenly: 0.5*1 + 0.5*0.5
    assert costs(g, 0.5) == pytest.approx({"": 0.25, "a": 0.75})


def test_zero_totals_fall_back() -> None:
    # No parameters at all: the memory component falls back to compute (1 per module).
    g = ModuleGraph([Module("", children=("a", "b")), Module("a"), Module("b")])
    assert costs(g, 1.0) == pytest.approx({"": 1 / 3, "a": 1 / 3, "b": 1 / 3})
    # All times zero: compute falls back to module counts.
    z = ModuleGraph([Module("", children=("a",), forward_ms=0.0), Module("a", forward_ms=0.0)])
    assert costs(z, 0.0) == pytest.approx({"": 0.5, "a": 0.5})
    r = partition(g, 2, alpha=1.0)
    assert sum(r.loads) == pytest.approx(1.0)


def test_missing_times_count_zero_when_others_are_timed() -> None:
    g = ModuleGraph(
        [Module("", children=("a", "b"), forward_ms=4.0), Module("a", forward_ms=3.0), Module("b")]
    )
    assert costs(g, 0.0) == pytest.approx({"": 0.25, "a": 0.75, "b": 0.0})
    assert costs(g, 0.0) == pytest.approx(expected_costs(g, 0.0))
