"""Human-readable views of a partition: a per-device table, Graphviz DOT and SVG.

The drawings show the node tree coloured by device, like the paper's Figures 9–10: each box
gives a node's name, its subtree's normalised cost and its device. To stay readable on
deep models, a node whose subtree lies on one device is not expanded (below the first
level), nothing deeper than 24 levels is drawn, and a run of sibling nodes of the same
type that lie entirely on one device is drawn as one box such as ``block[0:6]``.

A name may hold any character: in the SVG, ``& < > " '`` become entities and what XML 1.0
cannot hold at all (a NUL, other controls, U+FFFF, a lone surrogate) is shown as a Python
escape such as ``\\x00``, so the drawing always parses and still shows the name.
"""

from __future__ import annotations

import colorsys
import re
from dataclasses import dataclass, field
from xml.sax.saxutils import escape

from smp_partition.costs import compute_costs
from smp_partition.graph import ModuleGraph
from smp_partition.result import PartitionResult
from smp_partition.tree import NodeTree, build_tree

_PALETTE = [
    "#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462",
    "#b3de69", "#fccde5", "#d9d9d9", "#bc80bd", "#ccebc5", "#ffed6f",
]  # fmt: skip


# Characters XML 1.0 cannot hold (C0 controls but tab, newline and CR; surrogates; U+FFFE and
# U+FFFF), and tab, newline and CR too: a parser turns those into spaces or newlines, so a
# label holding one would not read back as written, and none belongs on a one-line label.
_NOT_IN_XML = re.compile("[\x00-\x1f\ud800-\udfff\ufffe\uffff]")


def _visible(text: str) -> str:
    """``text`` with each character of :data:`_NOT_IN_XML` written as a Python escape
    (``\\x00``, ``\\udc80``, ``\\uffff``): a module name may hold any character (JSON
    allows ``\\u0000``), and the drawing must still be valid XML and show what is there."""
    return _NOT_IN_XML.sub(lambda m: ascii(m.group())[1:-1], text)


def _xml(text: str) -> str:
    """``text`` as XML character data or attribute value: visible escapes for what XML
    cannot hold, then entities for ``& < > " '``."""
    return escape(_visible(text), {'"': "&quot;", "'": "&apos;"})


def device_colour(device: int) -> str:
    """A fill colour per device: a fixed palette, then golden-ratio hues."""
    if device < len(_PALETTE):
        return _PALETTE[device]
    hue = (device * 0.618033988749895) % 1.0
    r, g, b = colorsys.hls_to_rgb(hue, 0.78, 0.6)
    return f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"


def human(n: float) -> str:
    """``1234567`` → ``1.23M``."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"


def table(result: PartitionResult, title: str = "") -> str:
    """The per-device table: load, its excess over 1/D, parameters, modules; then the gap."""
    d = result.num_devices
    ideal = 1.0 / d
    lines = []
    if title:
        lines.append(title)
    lines.append(
        f"{d} devices, alpha {result.alpha:g}, method {result.method}, "
        f"{len(result.assignment)} modules"
    )
    lines.append("")
    lines.append(f"{'device':>6}  {'load':>7}  {'vs 1/D':>7}  {'params':>8}  {'modules':>7}")
    params = result.parameters or [0] * d
    counts = result.module_counts or [0] * d
    for i, load in enumerate(result.loads):
        mark = "  <- max" if load == result.max_load and d > 1 else ""
        lines.append(
            f"{i:>6}  {load:7.4f}  {(load / ideal - 1) * 100:+6.1f}%  "
            f"{human(params[i]):>8}  {counts[i]:>7}{mark}"
        )
    lines.append(
        f"{'total':>6}  {sum(result.loads):7.4f}  {'':>7}  {human(sum(params)):>8}  "
        f"{sum(counts):>7}"
    )
    lines.append("")
    lines.append(
        f"max load {result.max_load:.4f}, lower bound {result.lower_bound:.4f} "
        f"(gap {result.gap * 100:.1f}%), {len(result.cut_edges)} cut edges"
    )
    return "\n".join(lines) + "\n"


# Deeper levels are not drawn (and the recursion below stays far from Python's limit).
_MAX_DEPTH = 24


@dataclass
class Box:
    """One drawn box: a node, or a run of collapsed sibling nodes."""

    label: str
    cost: float
    device: int
    children: list[Box] = field(default_factory=list)


def _short(name: str, parent: str) -> str:
    if parent and name.startswith(parent + "."):
        return name[len(parent) + 1 :]
    return name


def boxes(graph: ModuleGraph, result: PartitionResult) -> Box:
    """The collapsed drawing tree of ``result`` over ``graph``."""
    tree: NodeTree = build_tree(graph)
    costs = compute_costs(graph, tree, result.alpha)
    mods = graph.modules
    n_nodes = len(tree)
    sub = [0.0] * n_nodes
    for m, n in enumerate(tree.module_node):
        sub[n] += costs.module_cost[m]
    for n in range(n_nodes - 1, 0, -1):
        sub[tree.parent[n]] += sub[n]
    device = [result.assignment[mods[ms[0]].name] for ms in tree.modules]
    # uniform[n]: the one device of n's whole subtree, or -1 when it spans several.
    uniform = device[:]
    for n in range(n_nodes - 1, 0, -1):
        p = tree.parent[n]
        if uniform[n] != uniform[p]:
            uniform[p] = -1
    first = [mods[ms[0]].name for ms in tree.modules]

    def label(n: int) -> str:
        if n == 0:
            return mods[tree.modules[0][0]].type or "(root)"
        parent = first[tree.parent[n]]
        members = tree.modules[n]
        text = _short(mods[members[0]].name, parent)
        # Parameter-sharing modules form one node: name the first, count the others.
        return text + (f" (+{len(members) - 1} tied)" if len(members) > 1 else "")

    def build(n: int, depth: int) -> Box:
        box = Box(label(n), sub[n], device[n])
        if (uniform[n] >= 0 and depth >= 1) or depth >= _MAX_DEPTH:
            if depth >= _MAX_DEPTH and uniform[n] < 0:
                box.label += " (+ subtree)"
            return box
        kids = tree.children[n]
        i = 0
        while i < len(kids):
            c = kids[i]
            j = i + 1
            kind = mods[tree.modules[c][0]].type
            if uniform[c] >= 0:
                while (
                    j < len(kids)
                    and uniform[kids[j]] == uniform[c]
                    and mods[tree.modules[kids[j]][0]].type == kind
                ):
                    j += 1
            if j - i >= 2:
                run = kids[i:j]
                a, b = label(run[0]), label(run[-1])
                if a.isdigit() and b.isdigit():
                    base = first[n].rsplit(".", 1)[-1] or "children"
                    text = f"{base}[{a}:{int(b) + 1}]"
                else:
                    text = f"{a} .. {b} ({j - i})"
                box.children.append(Box(text, sum(sub[k] for k in run), uniform[c]))
            else:
                box.children.append(build(c, depth + 1))
            i = j
        return box

    return build(0, 0)


def _walk(root: Box) -> list[tuple[int, Box, int]]:
    """(id, box, parent id) in pre-order."""
    out: list[tuple[int, Box, int]] = []
    stack: list[tuple[Box, int]] = [(root, -1)]
    while stack:
        box, parent = stack.pop()
        me = len(out)
        out.append((me, box, parent))
        stack.extend((c, me) for c in reversed(box.children))
    return out


def dot(graph: ModuleGraph, result: PartitionResult) -> str:
    """Graphviz DOT text of the collapsed tree, filled by device."""
    lines = [
        "digraph partition {",
        "  rankdir=TB;",
        '  node [shape=box, style="rounded,filled", fontname="Helvetica"];',
        f'  label="{result.num_devices} devices, alpha {result.alpha:g}, '
        f'max load {result.max_load:.3f} (bound {result.lower_bound:.3f})";',
    ]
    for me, box, parent in _walk(boxes(graph, result)):
        # DOT is not XML, but Graphviz reads no NUL either; then DOT's own quoting.
        text = _visible(box.label).replace("\\", "\\\\").replace('"', '\\"')
        lines.append(
            f'  n{me} [label="{text}\\n{box.cost:.3f}, {box.device}", '
            f'fillcolor="{device_colour(box.device)}"];'
        )
        if parent >= 0:
            lines.append(f"  n{parent} -> n{me};")
    lines.append("}")
    return "\n".join(lines) + "\n"


_W, _H, _GX, _GY, _PAD = 150, 40, 10, 36, 20


def svg(graph: ModuleGraph, result: PartitionResult, title: str = "") -> str:
    """A self-contained SVG drawing of the collapsed tree (pure-Python tidy layout)."""
    root = boxes(graph, result)
    pos: dict[int, tuple[float, int]] = {}
    slot = 0
    depth_max = 0
    walk = _walk(root)
    kids: dict[int, list[int]] = {}
    depth: dict[int, int] = {}
    for me, _, parent in walk:
        depth[me] = 0 if parent < 0 else depth[parent] + 1
        depth_max = max(depth_max, depth[me])
        if parent >= 0:
            kids.setdefault(parent, []).append(me)
    order = [me for me, _, _ in walk]
    # Leaves take columns left to right in pre-order; then, children before parents
    # (reversed pre-order), each parent is centred over its first and last child.
    for me in order:
        if me not in kids:
            pos[me] = (float(slot), depth[me])
            slot += 1
    for me in reversed(order):
        ch = kids.get(me)
        if ch:
            pos[me] = ((pos[ch[0]][0] + pos[ch[-1]][0]) / 2, depth[me])
    top = _PAD + (24 if title else 0) + 20
    width = max(1, slot) * (_W + _GX) - _GX + 2 * _PAD
    legend_y = top + (depth_max + 1) * (_H + _GY)
    legend_rows = (result.num_devices + 7) // 8
    height = legend_y + legend_rows * 22 + _PAD

    def xy(me: int) -> tuple[float, float]:
        col, row = pos[me]
        return _PAD + col * (_W + _GX), top + row * (_H + _GY)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="Helvetica, Arial, sans-serif">',
        f'<rect width="{width:.0f}" height="{height:.0f}" fill="white"/>',
    ]
    if title:
        out.append(f'<text x="{_PAD}" y="{_PAD + 14}" font-size="16">{_xml(title)}</text>')
    out.append(
        f'<text x="{_PAD}" y="{top - 12}" font-size="12" fill="#444">'
        f"{result.num_devices} devices, alpha {result.alpha:g}, method {_xml(result.method)}: "
        f"max load {result.max_load:.3f}, lower bound {result.lower_bound:.3f}, "
        f"{len(result.cut_edges)} cut edges</text>"
    )
    for me, _, parent in walk:
        if parent >= 0:
            (x1, y1), (x2, y2) = xy(parent), xy(me)
            out.append(
                f'<line x1="{x1 + _W / 2:.1f}" y1="{y1 + _H:.1f}" x2="{x2 + _W / 2:.1f}" '
                f'y2="{y2:.1f}" stroke="#888"/>'
            )
    for me, box, _ in walk:
        x, y = xy(me)
        text = box.label if len(box.label) <= 24 else box.label[:23] + "…"
        out.append(
            f"<g><title>{_xml(box.label)}</title>"
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{_W}" height="{_H}" rx="5" '
            f'fill="{device_colour(box.device)}" stroke="#333"/>'
            f'<text x="{x + _W / 2:.1f}" y="{y + 16:.1f}" font-size="12" '
            f'text-anchor="middle">{_xml(text)}</text>'
            f'<text x="{x + _W / 2:.1f}" y="{y + 32:.1f}" font-size="11" '
            f'text-anchor="middle" fill="#333">{box.cost:.3f}, {box.device}</text></g>'
        )
    for d, load in enumerate(result.loads):
        x = _PAD + (d % 8) * 120
        y = legend_y + (d // 8) * 22
        out.append(
            f'<rect x="{x}" y="{y}" width="14" height="14" fill="{device_colour(d)}" '
            f'stroke="#333"/><text x="{x + 20}" y="{y + 12}" font-size="11">'
            f"device {d}: {load:.3f}</text>"
        )
    out.append("</svg>")
    return "\n".join(out) + "\n"
