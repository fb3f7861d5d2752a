"""The cost model (paper Appendix C.3, with each term normalised before
mixing; docs/packages/smp-partition.md, "Cost model").

Per module ``m``:

* memory ``w(m)``: elements of the parameters registered on ``m`` (a shared parameter is
  counted once, on the first module of its node that holds it) plus
  ``activation_bytes / 4`` (fp32 elements);
* compute ``psi(m)``: the exclusive forward time ``forward_ms - sum(children forward_ms)``
  clamped at 0 when the graph has times, else 1 per module.

Both are normalised to sum to 1 and mixed: ``cbar = alpha*w/W + (1-alpha)*psi/Psi``.

Choices the paper leaves open (documented in docs/packages/smp-partition.md):

* A graph "has times" when at least one module has ``forward_ms``; a module without one
  (e.g. a branch the trace did not execute) then counts 0 ms.
* If the timed total ``Psi`` is 0, compute falls back to 1 per module.
* If the memory total ``W`` is 0 (no parameters, no activations), the memory component is
  replaced by the compute component, so loads still sum to 1 for every alpha.

The partitioning algorithms work on integers (``cbar`` scaled by 2**60 and rounded per
module), so segment sums, comparisons and D'Hondt quotients are exact; reported loads are
the float sums of ``cbar``.
"""

from __future__ import annotations

from dataclasses import dataclass

from smp_partition.graph import ModuleGraph
from smp_partition.tree import NodeTree

SCALE = 1 << 60


@dataclass(frozen=True)
class Costs:
    """Costs of one graph for one alpha."""

    module_cost: list[float]
    """``cbar`` per module index; sums to 1."""
    module_params: list[int]
    """Parameter elements attributed to each module (shared ones counted once)."""
    node_own: list[int]
    """Quantised cost of each node's own modules (the indivisible unit)."""
    node_subtree: list[int]
    """Quantised subtree cost ``c(n)`` of each node; ``node_subtree[0]`` is the total."""
    timed: bool
    """Whether compute came from measured ``forward_ms``."""


def compute_costs(graph: ModuleGraph, tree: NodeTree, alpha: float) -> Costs:
    """Module and node costs of ``graph`` for memory weight ``alpha``."""
    mods = graph.modules
    n = len(mods)
    seen: set[str] = set()
    params = [0] * n
    memory = [0.0] * n
    for i, m in enumerate(mods):
        p = 0
        for key, numel in m.params.items():
            if key not in seen:
                seen.add(key)
                p += numel
        params[i] = p
        memory[i] = p + m.activation_bytes / 4.0

    timed = any(m.forward_ms is not None for m in mods)
    compute = [1.0] * n
    if timed:
        fwd = [0.0 if m.forward_ms is None else float(m.forward_ms) for m in mods]
        for i in range(n):
            inner = sum(fwd[c] for c in graph.child_indices(i))
            compute[i] = max(0.0, fwd[i] - inner)
        if sum(compute) <= 0.0:
            compute = [1.0] * n
            timed = False
    psi_total = sum(compute)
    w_total = sum(memory)
    comp_frac = [x / psi_total for x in compute]
    mem_frac = [x / w_total for x in memory] if w_total > 0 else comp_frac
    beta = 1.0 - alpha
    cost = [alpha * a + beta * b for a, b in zip(mem_frac, comp_frac)]

    own = [0] * len(tree)
    for node, members in enumerate(tree.modules):
        own[node] = sum(round(cost[i] * SCALE) for i in members)
    sub = own[:]
    parent = tree.parent
    for node in range(len(tree) - 1, 0, -1):  # BFS ids: children come after parents
        sub[parent[node]] += sub[node]
    return Costs(
        module_cost=cost, module_params=params, node_own=own, node_subtree=sub, timed=timed
    )
