"""Module nodes and the node tree (paper Appendix C.2; docs/packages/smp-partition.md, "Cost model").

Modules that share a parameter key are merged into one *node* by union–find. The node
graph follows module→child edges; a node reached from several parents keeps the first
parent found by breadth-first search from the root (children in listed order), so the
result is always a tree. Node ids are assigned in that BFS order: node 0 holds the root
module and ``parent[n] < n`` for every other node.
"""

from __future__ import annotations

from dataclasses import dataclass

from smp_partition.graph import ROOT, ModuleGraph


@dataclass(frozen=True)
class NodeTree:
    """The tree of module nodes built from a :class:`ModuleGraph`."""

    module_node: list[int]
    """Module index (position in ``graph.modules``) → node id."""
    modules: list[list[int]]
    """Node id → its module indices, in graph order."""
    children: list[list[int]]
    """Node id → child node ids (tree edges), in BFS discovery order."""
    parent: list[int]
    """Node id → parent node id; ``-1`` for the root node 0."""

    def __len__(self) -> int:
        return len(self.modules)

    def preorder(self) -> list[int]:
        """Node ids in depth-first pre-order (children in order): the execution order."""
        out: list[int] = []
        stack = [0]
        children = self.children
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(reversed(children[n]))
        return out


def _union_find_roots(graph: ModuleGraph) -> list[int]:
    """Representative module of every module's parameter-sharing component."""
    n = len(graph)
    up = list(range(n))

    def find(i: int) -> int:
        while up[i] != i:
            up[i] = up[up[i]]  # path halving keeps the trees shallow
            i = up[i]
        return i

    holder: dict[str, int] = {}
    for i, m in enumerate(graph.modules):
        for key in m.params:
            j = holder.setdefault(key, i)
            if j != i:
                a, b = find(i), find(j)
                if a != b:
                    # Keep the earlier module as representative: deterministic and cheap.
                    if a < b:
                        up[b] = a
                    else:
                        up[a] = b
    return [find(i) for i in range(n)]


def build_tree(graph: ModuleGraph) -> NodeTree:
    """Merge parameter-sharing modules and span the node graph by BFS from the root."""
    rep = _union_find_roots(graph)
    n = len(graph)
    members: dict[int, list[int]] = {}
    for i in range(n):
        r = rep[i]
        group = members.get(r)
        if group is None:
            members[r] = [i]
        else:
            group.append(i)

    comp_node: dict[int, int] = {}
    modules: list[list[int]] = []
    children: list[list[int]] = []
    parent: list[int] = []
    root_comp = rep[graph.index_of(ROOT)]
    comp_node[root_comp] = 0
    modules.append(members[root_comp])
    children.append([])
    parent.append(-1)
    head = 0
    while head < len(modules):
        node = head
        head += 1
        kids = children[node]
        for m in modules[node]:
            for c in graph.child_indices(m):
                comp = rep[c]
                if comp not in comp_node:
                    new = len(modules)
                    comp_node[comp] = new
                    modules.append(members[comp])
                    children.append([])
                    parent.append(node)
                    kids.append(new)
    module_node = [comp_node[rep[i]] for i in range(n)]
    return NodeTree(module_node=module_node, modules=modules, children=children, parent=parent)
