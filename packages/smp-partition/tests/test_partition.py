"""partition(): the paper's algorithm by hand, properties of both methods, argument errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import expected_cuts, expected_loads, graphs, mod, t5_like
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from smp_partition import (
    ASSIGNMENT_SCHEMA,
    Module,
    ModuleGraph,
    PartitionError,
    PartitionResult,
    partition,
)
from smp_partition.costs import SCALE, compute_costs
from smp_partition.segment import min_max_value
from smp_partition.tree import build_tree

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "graphs" / "t5-small.json"


def flat(**sizes: int) -> ModuleGraph:
    """A root with leaf children in the given order and parameter sizes."""
    names = tuple(sizes)
    return ModuleGraph(
        [mod("", names)] + [Module(n, "M", (), {f"{n}.w": s}) for n, s in sizes.items()]
    )


def test_paper_two_segments() -> None:
    # [a,b | c] is the optimal 2-split (55 vs 45); one device each.
    r = partition(flat(a=10, b=45, c=45), 2, alpha=1.0, method="paper")
    assert r.assignment == {"": 0, "a": 0, "b": 0, "c": 1}
    assert r.loads == pytest.approx([0.55, 0.45])
    assert r.cut_edges == [("", "c")]


def test_paper_zero_device_segment_stays_with_parent_and_recursion() -> None:
    # 3 devices: the only optimal split is [a,b]=10 [c]=10 [d,e]=2; D'Hondt: dev0->s0,
    # dev1->s1 (10 vs 5), dev2->s0 (5 | 5 | 2, tie -> earlier). [d,e] gets no device: it
    # stays on the parent's device 0. [a,b] has devices {0, 2}: recursion gives a->0, b->2.
    r = partition(flat(a=5, b=5, c=10, d=1, e=1), 3, alpha=1.0, method="paper")
    assert r.assignment == {"": 0, "a": 0, "b": 2, "c": 1, "d": 0, "e": 0}
    assert r.loads == pytest.approx([7 / 22, 10 / 22, 5 / 22])


def test_paper_big_child_takes_all_devices_and_tiny_sibling_stays() -> None:
    g = ModuleGraph(
        [mod("", ("tiny", "big")), mod("tiny", (), t=1), mod("big", ("x", "y")),
         mod("x", (), x=99), mod("y", (), y=99)]
    )  # fmt: skip
    r = partition(g, 2, alpha=1.0, method="paper")
    assert r.assignment == {"": 0, "tiny": 0, "big": 0, "x": 0, "y": 1}
    assert r.cut_edges == [("big", "y")]


def test_single_device_and_more_devices_than_modules() -> None:
    g = t5_like(2)
    one = partition(g, 1)
    assert set(one.assignment.values()) == {0} and one.loads == pytest.approx([1.0])
    assert one.cut_edges == [] and one.max_load == pytest.approx(one.lower_bound)
    many = partition(flat(a=1, b=1), 5)
    assert sorted(many.loads) == pytest.approx([0, 0, 0, 0.5, 0.5])
    assert many.lower_bound == pytest.approx(0.5)


def test_t5_like_default_beats_paper() -> None:
    g = t5_like(6)
    for alpha in (1.0, 0.2):
        paper = partition(g, 8, alpha=alpha, method="paper")
        default = partition(g, 8, alpha=alpha)
        assert default.max_load <= paper.max_load
        assert default.max_load < 0.15
        # the tied embedding and head are one node: same device
        assert default.assignment["shared"] == default.assignment["lm_head"]


@pytest.mark.skipif(not EXAMPLE.exists(), reason="runs inside the monorepo checkout")
def test_bundled_example() -> None:
    g = ModuleGraph.from_json(EXAMPLE)
    r = partition(g, 4, alpha=0.8)
    assert r.max_load < 0.26 and r.assignment["shared"] == r.assignment["lm_head"]
    assert r.loads == pytest.approx(expected_loads(g, r))


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)  # fmt: skip
@given(graphs(), st.integers(1, 9), st.sampled_from([0.0, 0.3, 0.8, 1.0]))
def test_properties(graph: ModuleGraph, devices: int, alpha: float) -> None:
    results = {m: partition(graph, devices, alpha=alpha, method=m) for m in ("paper", "default")}
    for r in results.values():
        names = {m.name for m in graph.modules}
        assert set(r.assignment) == names
        assert all(0 <= d < devices for d in r.assignment.values())
        holder: dict[str, int] = {}
        for m in graph.modules:  # modules sharing a parameter run on one device
            for key in m.params:
                assert holder.setdefault(key, r.assignment[m.name]) == r.assignment[m.name]
        assert sum(r.loads) == pytest.approx(1.0)
        assert r.loads == pytest.approx(expected_loads(graph, r), abs=1e-9)
        assert r.max_load == max(r.loads)
        assert r.max_load >= r.lower_bound - 1e-9
        assert set(r.cut_edges) == expected_cuts(graph, r)
        assert sum(r.module_counts) == len(graph)
    assert results["default"].max_load <= results["paper"].max_load
    # ... and no worse than the optimal contiguous split of the execution order.
    tree = build_tree(graph)
    own = compute_costs(graph, tree, alpha).node_own
    chain_best = min_max_value([own[n] for n in tree.preorder()], devices) / SCALE
    assert results["default"].max_load <= chain_best + 1e-9


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)  # fmt: skip
@given(graphs(), st.integers(2, 6), st.sampled_from([0.0, 0.8]), st.sampled_from([0.02, 0.1]))
def test_balance_slack_trades_balance_for_cuts(
    graph: ModuleGraph, devices: int, alpha: float, slack: float
) -> None:
    strict = partition(graph, devices, alpha=alpha)
    paper = partition(graph, devices, alpha=alpha, method="paper")
    loose = partition(graph, devices, alpha=alpha, balance_slack=slack)
    assert loose.max_load <= min(paper.max_load, strict.max_load) * (1 + slack) + 1e-9
    assert loose.loads.count(0.0) <= strict.loads.count(0.0)
    if loose.loads.count(0.0) == strict.loads.count(0.0):
        assert len(loose.cut_edges) <= len(strict.cut_edges)
    assert loose.loads == pytest.approx(expected_loads(graph, loose), abs=1e-9)


def test_balance_slack_keeps_a_cheap_module_with_its_caller() -> None:
    # A cheap final norm between the last block and a head tied to the embedding: strict
    # balance sends it to the second device (one more request per microbatch), slack keeps it.
    mods = [
        {"name": "", "children": ["emb", "b0", "b1", "norm", "head"], "params": {}},
        {"name": "emb", "children": [], "params": {"w": 100}},
        {"name": "b0", "children": [], "params": {"b0": 1000}},
        {"name": "b1", "children": [], "params": {"b1": 1090}},
        {"name": "norm", "children": [], "params": {"n": 10}},
        {"name": "head", "children": [], "params": {"w": 100}},
    ]
    g = ModuleGraph.from_dict({"schema": "smp-partition/module-graph@1", "modules": mods})
    strict = partition(g, 2, alpha=1.0)
    loose = partition(g, 2, alpha=1.0, balance_slack=0.05)
    assert strict.assignment["norm"] != strict.assignment["head"]
    assert loose.assignment["norm"] == loose.assignment["head"]
    assert len(loose.cut_edges) < len(strict.cut_edges)
    assert loose.max_load <= strict.max_load * 1.05


@pytest.mark.parametrize("bad", [-0.1, 1.5, "0.1", True, float("nan")])
def test_balance_slack_is_validated(bad: object) -> None:
    with pytest.raises(PartitionError, match="balance_slack"):
        partition(flat(a=1, b=1), 2, balance_slack=bad)  # type: ignore[arg-type]


def test_json_schema_and_round_trip() -> None:
    r = partition(t5_like(2), 3, alpha=0.5)
    d = json.loads(r.to_json())
    assert list(d) == [
        "schema", "num_devices", "alpha", "method", "assignment", "loads", "max_load",
        "lower_bound", "cut_edges",
    ]  # fmt: skip
    assert d["schema"] == ASSIGNMENT_SCHEMA and d["num_devices"] == 3 and d["method"] == "default"
    assert all(isinstance(e, list) and len(e) == 2 for e in d["cut_edges"])
    back = PartitionResult.from_dict(d)
    assert back.assignment == r.assignment and back.cut_edges == r.cut_edges


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"num_devices": 0}, "num_devices must be an integer >= 1, got 0"),
        ({"num_devices": 2.0}, "num_devices"),
        ({"num_devices": True}, "num_devices"),
        ({"num_devices": 2**20 + 1}, "num_devices must be at most 1048576"),
        ({"num_devices": 2, "alpha": 1.5}, "alpha must be a number in [0, 1], got 1.5"),
        ({"num_devices": 2, "alpha": -0.1}, "alpha"),
        ({"num_devices": 2, "alpha": float("nan")}, "alpha"),
        ({"num_devices": 2, "method": "greedy"}, "method must be one of"),
    ],
)
def test_argument_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(PartitionError) as info:
        partition(t5_like(1), **kwargs)  # type: ignore[arg-type]
    assert message in str(info.value) and isinstance(info.value, ValueError)


def test_wide_and_deep_graphs_stay_fast_and_valid() -> None:
    # A 3000-layer ModuleList on 512 devices and a 2000-deep chain: no O(k n^2) DP, no
    # recursion limit.
    layers = tuple(f"l.{i}" for i in range(3000))
    wide = ModuleGraph(
        [mod("", ("l",)), mod("l", layers)] + [Module(n, "M", (), {n: 1 + i % 7}) for i, n in enumerate(layers)]
    )  # fmt: skip
    r = partition(wide, 512, alpha=1.0)
    assert r.max_load <= partition(wide, 512, alpha=1.0, method="paper").max_load
    chain = [Module("", children=("c0",))] + [
        Module(f"c{i}", "M", (f"c{i + 1}",) if i < 1999 else (), {f"c{i}": 1}) for i in range(2000)
    ]
    r = partition(ModuleGraph(chain), 16, alpha=1.0)
    assert r.max_load == pytest.approx(1 / 16, abs=1e-3)


def test_one_huge_embedding_leaves_the_rest_balanced() -> None:
    # The tied embedding/head node alone sets the max load; the paper method leaves a device
    # idle, the default shares the blocks evenly over the other three.
    blocks = tuple(f"blocks.{i}" for i in range(12))
    g = ModuleGraph(
        [Module("", "Net", ("embed", "blocks", "head")),
         Module("embed", "Embedding", (), {"embed.weight": 50_000 * 512}),
         Module("blocks", "ModuleList", blocks),
         *[Module(b, "Block", (), {f"{b}.w": 3_000_000}) for b in blocks],
         Module("head", "Linear", (), {"embed.weight": 50_000 * 512})]
    )  # fmt: skip
    paper = partition(g, 4, alpha=1.0, method="paper")
    default = partition(g, 4, alpha=1.0)
    assert default.max_load == pytest.approx(default.lower_bound)
    assert paper.max_load == pytest.approx(default.max_load)
    assert 0.0 in paper.loads
    assert sorted(default.loads)[:3] == pytest.approx([12e6 / 61.6e6] * 3)


def test_garbage_collector_state_is_restored() -> None:
    import gc

    g = t5_like(1)
    assert gc.isenabled()
    partition(g, 2)
    assert gc.isenabled()
    gc.disable()
    try:
        partition(g, 2)
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(PartitionError):
        partition(g, 0)
    assert gc.isenabled()
