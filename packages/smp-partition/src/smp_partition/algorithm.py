"""Device assignment of module nodes: the paper's algorithm and the default's variants.

All functions return ``node -> device`` lists for a :class:`~smp_partition.tree.NodeTree`
whose node ids are in BFS order, given quantised integer costs from
:mod:`smp_partition.costs`.
"""

from __future__ import annotations

from collections.abc import Sequence

from smp_partition.dhondt import dhondt
from smp_partition.segment import segment
from smp_partition.tree import NodeTree


def _partition(
    devices: list[int], nodes: list[int], subtree: Sequence[int], out: list[list[int]]
) -> None:
    """Paper Algorithm 2: give every node of ``nodes`` its device set ``out[n]``."""
    stack: list[tuple[list[int], list[int]]] = [(devices, nodes)]
    while stack:
        devs, group = stack.pop()
        costs = [subtree[n] for n in group]
        # ℓ = |P| segments; with fewer nodes than devices each node is its own segment.
        bounds = segment(costs, len(devs))
        seg_costs = [sum(costs[a:b]) for a, b in bounds]
        for (a, b), share in zip(bounds, dhondt(devs, seg_costs)):
            members = group[a:b]
            if not share:
                # No device: stay with the first device of this call (the parent's device
                # in the top-level call), saving a request round for a cheap segment.
                same = [devs[0]]
                for n in members:
                    out[n] = same
            elif len(members) == 1 or len(share) == 1:
                for n in members:
                    out[n] = share
            else:
                # Each segment is strictly shorter than ``group``, so this terminates even
                # when some costs are zero (the paper needs strictly positive costs).
                stack.append((share, members))


def paper_assign(tree: NodeTree, subtree: Sequence[int], num_devices: int) -> list[int]:
    """Paper Algorithm 1: BFS over nodes, each node takes ``P(n)[0]``, children split P(n)."""
    count = len(tree)
    sets: list[list[int]] = [[] for _ in range(count)]
    sets[0] = list(range(num_devices))
    device = [0] * count
    children = tree.children
    for n in range(count):  # node ids are BFS order
        own = sets[n]
        device[n] = own[0]
        kids = children[n]
        if not kids:
            continue
        if len(own) > 1:
            _partition(own, kids, subtree, sets)
        else:
            for c in kids:
                sets[c] = own
    return device


def chain_assign(tree: NodeTree, own: Sequence[int], num_devices: int) -> list[int]:
    """Optimal contiguous split of the execution-order (pre-order) node sequence.

    Every node's own modules are the indivisible unit, so the bottleneck is at most
    ``1/D`` plus the largest node; devices follow execution order like pipeline stages.
    """
    order = tree.preorder()
    bounds = segment([own[n] for n in order], num_devices)
    device = [0] * len(tree)
    for d, (a, b) in enumerate(bounds):
        for n in order[a:b]:
            device[n] = d
    return device


def refine(tree: NodeTree, own: Sequence[int], device: list[int], num_devices: int) -> list[int]:
    """Move single nodes next to their tree neighbours without creating a new peak load.

    A node adjacent to cut tree edges moves to the device most of its neighbours (parent
    and children) use, if that strictly reduces its cut edges and the target's new load
    stays within the source's old load (free for zero-cost nodes such as containers). So
    the larger load of the two devices never grows: the maximum cannot rise and the other
    devices keep their balance. A cheap local pass over the cut edges only.
    """
    device = device[:]
    load = [0] * num_devices
    for n, d in enumerate(device):
        load[d] += own[n]
    parent = tree.parent
    children = tree.children
    touched: set[int] = set()
    for n in range(1, len(tree)):
        if device[n] != device[parent[n]]:
            touched.add(n)
            touched.add(parent[n])
    candidates = sorted(touched)
    for sweep in (reversed(candidates), iter(candidates)):
        for n in sweep:
            votes: dict[int, int] = {}
            if n:
                p = device[parent[n]]
                votes[p] = 1
            for c in children[n]:
                d = device[c]
                votes[d] = votes.get(d, 0) + 1
            cur = device[n]
            mine = votes.get(cur, 0)
            best, score = cur, mine
            for d, v in votes.items():
                if v > score:
                    best, score = d, v
            cost = own[n]
            if best != cur and score > mine and (cost == 0 or load[best] + cost <= load[cur]):
                load[cur] -= cost
                load[best] += cost
                device[n] = best
    return device
