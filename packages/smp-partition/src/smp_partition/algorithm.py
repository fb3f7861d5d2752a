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
    unset: list[int] = []  # every node's set is written before BFS reaches it
    sets = [unset] * count
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


def chain_assign(
    tree: NodeTree, own: Sequence[int], num_devices: int, shallow: bool = False
) -> list[int]:
    """Optimal contiguous split of the execution-order (pre-order) node sequence.

    Every node's own modules are the indivisible unit, so the bottleneck is at most
    ``1/D`` plus the largest node; devices follow execution order like pipeline stages.
    With ``shallow``, among the optimal splits each boundary prefers to fall before a node
    near the root (cutting a block off its ModuleList costs one edge; cutting inside a
    block also cuts every enclosing level's later children), at some cost to the balance
    of the pieces below the maximum.
    """
    order = tree.preorder()
    penalty = None
    if shallow:
        depth = [0] * len(tree)
        parent = tree.parent
        for n in range(1, len(tree)):  # BFS ids: parents first
            depth[n] = depth[parent[n]] + 1
        penalty = [depth[n] for n in order]
    bounds = segment([own[n] for n in order], num_devices, penalty)
    device = [0] * len(tree)
    for d, (a, b) in enumerate(bounds):
        for n in order[a:b]:
            device[n] = d
    _slide(tree, own, order, bounds, device)
    return device


_SLIDE_REACH = 256


def _slide(
    tree: NodeTree,
    own: Sequence[int],
    order: list[int],
    bounds: list[tuple[int, int]],
    device: list[int],
) -> None:
    """Move each boundary of a contiguous split to where it cuts the fewest tree edges.

    A boundary between pieces ``j`` and ``j+1`` may slide (up to ``_SLIDE_REACH`` nodes
    each way) as long as the larger of the two pieces does not grow, so the maximum load
    is unchanged and no other piece is touched. Cut-edge changes are counted incrementally
    as the boundary passes each node. Ties keep the boundary closest to where it was.
    """
    parent = tree.parent
    children = tree.children
    starts = [a for a, _ in bounds]
    ends = [b for _, b in bounds]
    load = [sum(own[n] for n in order[a:b]) for a, b in bounds]

    def delta(node: int, old: int, new: int) -> int:
        change = 0
        neighbours = children[node]
        if node:
            d = device[parent[node]]
            change += (d != new) - (d != old)
        for c in neighbours:
            d = device[c]
            change += (d != new) - (d != old)
        return change

    for j in range(len(bounds) - 1):
        left, right = j, j + 1
        b = starts[right]
        peak = max(load[left], load[right])
        best_pos, best_gain = b, 0
        # Slide right: nodes order[b], order[b+1], ... move from ``right`` to ``left``.
        gain, lo_load, hi_load, p = 0, load[left], load[right], b
        while p < min(ends[right] - 1, b + _SLIDE_REACH):
            x = order[p]
            if lo_load + own[x] > peak:
                break
            gain -= delta(x, right, left)
            device[x] = left
            lo_load += own[x]
            hi_load -= own[x]
            p += 1
            if gain > best_gain:
                best_pos, best_gain = p, gain
        for q in range(b, p):  # undo the trial
            device[order[q]] = right
        # Slide left: nodes order[b-1], order[b-2], ... move from ``left`` to ``right``.
        gain, lo_load, hi_load, p = 0, load[left], load[right], b
        while p > max(starts[left] + 1, b - _SLIDE_REACH):
            x = order[p - 1]
            if hi_load + own[x] > peak:
                break
            gain -= delta(x, left, right)
            device[x] = right
            lo_load -= own[x]
            hi_load += own[x]
            p -= 1
            if gain > best_gain or (gain == best_gain and gain > 0 and b - p < abs(best_pos - b)):
                best_pos, best_gain = p, gain
        for q in range(p, b):
            device[order[q]] = left
        if best_pos != b:
            lo, hi = min(b, best_pos), max(b, best_pos)
            moved = sum(own[order[q]] for q in range(lo, hi))
            target = left if best_pos > b else right
            for q in range(lo, hi):
                device[order[q]] = target
            if best_pos > b:
                load[left] += moved
                load[right] -= moved
            else:
                load[left] -= moved
                load[right] += moved
            ends[left] = starts[right] = best_pos


def refine(
    tree: NodeTree, own: Sequence[int], device: list[int], num_devices: int, slack: float = 0.0
) -> list[int]:
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
    # With slack, a move may raise the target up to this (else only to the source's old load).
    slack_limit = int(max(load) * (1.0 + slack)) if slack > 0 else 0
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
            fits = load[best] + cost <= max(load[cur], slack_limit)
            if best != cur and score > mine and (cost == 0 or fits):
                load[cur] -= cost
                load[best] += cost
                device[n] = best
    return device
