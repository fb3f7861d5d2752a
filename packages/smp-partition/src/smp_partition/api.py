"""``partition()``: the public entry point."""

from __future__ import annotations

import math
from collections.abc import Sequence

from smp_partition._gc import gc_paused
from smp_partition.algorithm import chain_assign, paper_assign, refine
from smp_partition.blocks import contract_blocks, keep_blocks_whole, outer_blocks
from smp_partition.costs import compute_costs
from smp_partition.errors import PartitionError
from smp_partition.graph import ModuleGraph
from smp_partition.result import PartitionResult
from smp_partition.tree import NodeTree, build_tree

METHODS = ("default", "paper")
MAX_DEVICES = 1 << 20


def _check_args(
    graph: object, num_devices: object, alpha: object, method: object, balance_slack: object = 0.0
) -> None:
    if not isinstance(graph, ModuleGraph):
        raise PartitionError(f"graph must be a ModuleGraph, got {type(graph).__name__}")
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise PartitionError(f"num_devices must be an integer >= 1, got {num_devices!r}")
    if num_devices > MAX_DEVICES:
        # Per-device lists are materialised; a typo like 10**9 should fail, not swap.
        raise PartitionError(f"num_devices must be at most {MAX_DEVICES}, got {num_devices}")
    if (
        isinstance(alpha, bool)
        or not isinstance(alpha, (int, float))
        or not math.isfinite(alpha)
        or not 0.0 <= alpha <= 1.0
    ):
        raise PartitionError(f"alpha must be a number in [0, 1], got {alpha!r}")
    if method not in METHODS:
        raise PartitionError(f"method must be one of {', '.join(METHODS)}; got {method!r}")
    if (
        isinstance(balance_slack, bool)
        or not isinstance(balance_slack, (int, float))
        or not 0.0 <= balance_slack <= 1.0
    ):
        raise PartitionError(f"balance_slack must be a number in [0, 1], got {balance_slack!r}")


def _node_edges(graph: ModuleGraph, tree: NodeTree) -> list[tuple[int, int]]:
    """Every parent→child module edge, as (parent's node, child's node)."""
    node = tree.module_node
    return [(node[i], node[c]) for i in range(len(graph)) for c in graph.child_indices(i)]


def _loads(node_cost: Sequence[float], node_device: Sequence[int], devices: int) -> list[float]:
    loads = [0.0] * devices
    for cost, d in zip(node_cost, node_device):
        loads[d] += cost
    return loads


def partition(
    graph: ModuleGraph,
    num_devices: int,
    alpha: float = 1.0,
    method: str = "default",
    balance_slack: float = 0.0,
) -> PartitionResult:
    """Assign every module of ``graph`` to one of ``num_devices`` pipeline devices.

    ``alpha`` weighs memory (1.0) against compute (0.0) in the cost model. ``method="paper"``
    runs the paper's Algorithms 1–3; ``"default"`` also tries an optimal contiguous split of
    the execution order, a local clean-up of cut edges and, of each of these, the variant
    that cuts no repeated block (such as a decoder layer, :mod:`smp_partition.blocks`)
    through its inside, and returns the candidate with the smallest maximum load, then the
    fewest idle devices, then the fewest cut edges, so it is never worse than ``"paper"`` on
    maximum load (with ``balance_slack=0``).

    ``balance_slack`` (default method only): max loads within ``(1 + balance_slack)`` of the
    smallest one count as equal, so fewer idle devices and fewer cut edges (each one a
    request round trip per microbatch in a pipeline) decide among them; the clean-up may
    also move a node across a cut edge when the max load grows by at most that factor. (So
    with slack, the max load may exceed ``"paper"``'s by at most that factor.)
    """
    _check_args(graph, num_devices, alpha, method, balance_slack)
    with gc_paused():
        return _partition(graph, num_devices, float(alpha), method, float(balance_slack))


def _partition(
    graph: ModuleGraph, num_devices: int, alpha: float, method: str, slack: float = 0.0
) -> PartitionResult:
    tree = build_tree(graph)
    costs = compute_costs(graph, tree, alpha)
    own, sub = costs.node_own, costs.node_subtree
    module_node = tree.module_node

    paper = paper_assign(tree, sub, num_devices)
    candidates = [paper]
    if method == "default" and num_devices > 1:
        candidates.append(refine(tree, own, paper, num_devices))
        for shallow in (False, True):
            chain = chain_assign(tree, own, num_devices, shallow)
            candidates += [chain, refine(tree, own, chain, num_devices)]
        if slack > 0:
            candidates += [refine(tree, own, c, num_devices, slack) for c in list(candidates)]
        inside = outer_blocks(graph, tree)
        if max(inside) >= 0:
            # Whole-block variants: each candidate with its blocks' insides moved onto the
            # block, and the optimal contiguous split of the order with blocks indivisible.
            whole = [keep_blocks_whole(inside, c) for c in candidates]
            chain = keep_blocks_whole(
                inside, chain_assign(tree, contract_blocks(inside, own), num_devices, True)
            )
            whole.append(chain)
            whole.append(keep_blocks_whole(inside, refine(tree, own, chain, num_devices, slack)))
            candidates += whole

    node_cost = [0.0] * len(tree)
    for m, n in enumerate(module_node):
        node_cost[n] += costs.module_cost[m]
    edges = _node_edges(graph, tree)
    scored = []
    for node_device in candidates:
        loads = _loads(node_cost, node_device, num_devices)
        cuts = sum(1 for a, b in edges if node_device[a] != node_device[b])
        scored.append((max(loads), loads.count(0.0), cuts, node_device))
    # Smallest max load first (it bounds pipeline throughput and per-device memory), then
    # fewest idle devices (when the max is set by one big node, the others should still
    # share the rest), then fewest cut edges (request rounds). With slack, max loads within
    # it of the best count as equal.
    best_max = min(m for m, _, _, _ in scored)
    limit = best_max * (1.0 + slack)
    eligible = [c for c in scored if c[0] <= limit]
    chosen = min(eligible, key=lambda c: (c[1], c[2], c[0]) if slack > 0 else c[:3])[3]
    loads = _loads(node_cost, chosen, num_devices)
    module_device = [chosen[n] for n in module_node]

    mods = graph.modules
    cut_edges = [
        (mods[i].name, mods[c].name)
        for i in range(len(graph))
        for c in graph.child_indices(i)
        if module_device[i] != module_device[c]
    ]
    params = [0] * num_devices
    counts = [0] * num_devices
    for m, d in enumerate(module_device):
        params[d] += costs.module_params[m]
        counts[d] += 1
    return PartitionResult(
        num_devices=num_devices,
        alpha=alpha,
        method=method,
        assignment={m.name: d for m, d in zip(mods, module_device)},
        loads=loads,
        max_load=max(loads),
        lower_bound=max(1.0 / num_devices, max(node_cost)),
        cut_edges=cut_edges,
        parameters=params,
        module_counts=counts,
    )
