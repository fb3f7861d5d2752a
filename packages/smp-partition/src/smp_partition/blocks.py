"""Repeated blocks: the model's layers, which a pipeline should not cut through.

A *block* is a node with children whose parent has another child node of the same module
type (a decoder layer in its ``ModuleList``, an expert among its peers, one stage of an
``nn.Sequential`` of identical sub-blocks). Inside a block the parent calls each child in
turn, so a cut there is one more request round trip per microbatch and per call, and the
two stages it joins wait on each other within the block instead of pipelining. Only the
outermost block counts: the experts inside a decoder layer are inside the layer.

The default method adds, for each of its candidates, the variant with every block whole
(and the optimal contiguous split with blocks indivisible); they win only by the usual
rule (max load, idle devices, cut edges, with ``balance_slack``), so they are chosen when
keeping blocks whole costs no more balance than the slack allows.
"""

from __future__ import annotations

from collections.abc import Sequence

from smp_partition.graph import ModuleGraph
from smp_partition.tree import NodeTree


def outer_blocks(graph: ModuleGraph, tree: NodeTree) -> list[int]:
    """For every node, the outermost block it lies strictly inside, or ``-1``.

    A block itself maps to its enclosing block (``-1`` for an outermost one). A node's
    type is its first module's ``type``; nodes without a type are never blocks.
    """
    count = len(tree)
    types = [graph.modules[tree.modules[n][0]].type for n in range(count)]
    is_block = [False] * count
    for kids in tree.children:
        seen: dict[str, int] = {}
        for c in kids:
            if types[c]:
                seen[types[c]] = seen.get(types[c], 0) + 1
        for c in kids:
            if tree.children[c] and seen.get(types[c], 0) >= 2:
                is_block[c] = True
    inside = [-1] * count
    for n in range(1, count):  # BFS ids: a parent's entry is final before its children's
        p = tree.parent[n]
        inside[n] = inside[p] if inside[p] >= 0 else (p if is_block[p] else -1)
    return inside


def keep_blocks_whole(inside: Sequence[int], device: Sequence[int]) -> list[int]:
    """``device`` with every node inside a block moved to its outermost block's device."""
    return [device[b] if b >= 0 else d for b, d in zip(inside, device)]


def contract_blocks(inside: Sequence[int], own: Sequence[int]) -> list[int]:
    """Node costs with each outermost block carrying its whole subtree (inside nodes 0), so
    a split of the execution order never needs to cut inside a block to balance."""
    out = list(own)
    for n, b in enumerate(inside):
        if b >= 0:
            out[b] += own[n]
            out[n] = 0
    return out

