"""Shared helpers: graph builders, a random-graph strategy, independent recomputations."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st
from smp_partition import SCHEMA, Module, ModuleGraph, PartitionResult


def mod(name: str, children: tuple[str, ...] = (), **params: int) -> Module:
    """A module whose params are given as key=numel (keys use '_' for '.')."""
    return Module(name, "M", children, {k.replace("_", "."): v for k, v in params.items()})


def t5_like(layers: int = 4) -> ModuleGraph:
    """A small encoder-decoder with an embedding tied to the LM head and reused by both stacks."""
    h = 64
    mods = [
        Module("", "T5", ("shared", "encoder", "decoder", "lm_head")),
        Module("shared", "Embedding", (), {"shared.weight": 1000 * h}),
        Module("lm_head", "Linear", (), {"shared.weight": 1000 * h}),
    ]
    for stack, extra in (("encoder", 0), ("decoder", 1)):
        blocks = tuple(f"{stack}.block.{i}" for i in range(layers))
        mods.append(Module(stack, "Stack", ("shared", f"{stack}.block", f"{stack}.norm")))
        mods.append(Module(f"{stack}.block", "ModuleList", blocks))
        mods.append(Module(f"{stack}.norm", "Norm", (), {f"{stack}.norm.w": h}))
        for b in blocks:
            parts = ["attn"] + (["cross"] if extra else []) + ["ff"]
            mods.append(Module(b, "Block", tuple(f"{b}.{p}" for p in parts)))
            for p in parts:
                size = 8 * h * h if p == "ff" else 4 * h * h
                mods.append(Module(f"{b}.{p}", "Layer", (), {f"{b}.{p}.w": size}))
    return ModuleGraph(mods)


@st.composite
def graphs(draw: Any, max_modules: int = 24) -> ModuleGraph:
    """Random DAGs rooted at '': a random tree plus extra parent links (module reuse),
    parameters shared through a small key pool, optional activations and times."""
    n = draw(st.integers(1, max_modules))
    names = [""] + [f"m{i}" for i in range(1, n)]
    children: list[list[str]] = [[] for _ in range(n)]
    for i in range(1, n):
        children[draw(st.integers(0, i - 1))].append(names[i])
    for _ in range(draw(st.integers(0, n // 3))):  # extra parents: edges go forward only
        if n < 3:
            break
        i = draw(st.integers(2, n - 1))
        j = draw(st.integers(0, i - 1))
        if names[i] not in children[j]:
            children[j].append(names[i])
    pool = draw(st.lists(st.integers(0, 1000), min_size=1, max_size=6))
    timed = draw(st.booleans())
    mods = []
    for i in range(n):
        params: dict[str, int] = {}
        if draw(st.integers(0, 3)):  # most modules own a parameter
            params[f"p{i}"] = draw(st.integers(0, 5000))
        if draw(st.integers(0, 5)) == 0:  # some share one from the pool
            k = draw(st.integers(0, len(pool) - 1))
            params[f"shared{k}"] = pool[k]
        mods.append(
            Module(
                names[i],
                "M",
                tuple(children[i]),
                params,
                activation_bytes=draw(st.sampled_from([0, 0, 400, 4000])),
                forward_ms=draw(st.floats(0, 10)) if timed and draw(st.booleans()) else None,
            )
        )
    order = draw(st.permutations(mods))
    return ModuleGraph(order)


def expected_costs(graph: ModuleGraph, alpha: float) -> dict[str, float]:
    """The documented cost model, recomputed independently (module name -> cbar)."""
    mods = {m.name: m for m in graph.modules}
    counted: set[str] = set()
    mem: dict[str, float] = {}
    for m in graph.modules:
        mem[m.name] = sum(v for k, v in m.params.items() if k not in counted)
        counted.update(m.params)
        mem[m.name] += m.activation_bytes / 4
    timed = any(m.forward_ms is not None for m in graph.modules)

    def ms(name: str) -> float:
        t = mods[name].forward_ms
        return 0.0 if t is None else t

    comp = {
        m.name: max(0.0, ms(m.name) - sum(ms(c) for c in dict.fromkeys(m.children)))
        if timed
        else 1.0
        for m in graph.modules
    }
    if sum(comp.values()) == 0:
        comp = {k: 1.0 for k in comp}
    psi, w = sum(comp.values()), sum(mem.values())
    return {
        # fractions first: with subnormal times, (1 - alpha) * t would round before dividing
        k: alpha * (mem[k] / w if w else comp[k] / psi) + (1 - alpha) * (comp[k] / psi)
        for k in mods
    }


def expected_loads(graph: ModuleGraph, result: PartitionResult) -> list[float]:
    cost = expected_costs(graph, result.alpha)
    loads = [0.0] * result.num_devices
    for name, d in result.assignment.items():
        loads[d] += cost[name]
    return loads


def expected_cuts(graph: ModuleGraph, result: PartitionResult) -> set[tuple[str, str]]:
    a = result.assignment
    return {(m.name, c) for m in graph.modules for c in m.children if a[m.name] != a[c]}


def graph_dict(*modules: dict[str, Any]) -> dict[str, Any]:
    return {"schema": SCHEMA, "modules": list(modules)}


def m(name: str, children: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    return {"name": name, "type": "M", "children": children or [], "params": {}, **extra}


BAD: list[tuple[str, dict[str, Any], str]] = [
    ("schema", {"schema": "other@1", "modules": [m("")]}, "unknown schema 'other@1'"),
    ("no schema", {"modules": [m("")]}, "missing key 'schema'"),
    ("duplicate", graph_dict(m("", ["a"]), m("a"), m("a")), "duplicate module name 'a'"),
    ("child", graph_dict(m("", ["a"]), m("a", ["ghost"])), "module 'a' lists child 'ghost'"),
    ("cycle", graph_dict(m("", ["a"]), m("a", ["b"]), m("b", ["a"])), "cycle in children at module 'a'"),
    ("self cycle", graph_dict(m("", ["a"]), m("a", ["a"])), "cycle in children at module 'a'"),
    ("root cycle", graph_dict(m("", ["a"]), m("a", [""])), "cycle in children"),
    ("negative params", graph_dict(m("", ["a"]), m("a", params={"w": -3})), "module 'a': parameter 'w' has a negative size"),
    ("float params", graph_dict(m("", ["a"]), m("a", params={"w": 1.5})), "module 'a': parameter 'w' size must be an integer"),
    ("negative activations", graph_dict(m("", ["a"]), m("a", activation_bytes=-1)), "module 'a': activation_bytes is negative"),
    ("negative time", graph_dict(m("", ["a"]), m("a", forward_ms=-0.5)), "module 'a': forward_ms is negative"),
    ("nan time", graph_dict(m("", ["a"]), m("a", forward_ms=float("nan"))), "module 'a': forward_ms must be finite"),
    ("missing root", graph_dict(m("a")), "missing root module"),
    ("unreachable", graph_dict(m(""), m("lost"), m("lost2")), "module 'lost' is not reachable from the root (and 1 more)"),
    ("size clash", graph_dict(m("", ["a", "b"]), m("a", params={"w": 3}), m("b", params={"w": 4})), "module 'b': shared parameter 'w' has size 4 but 3 in module 'a'"),
    ("modules type", {"schema": SCHEMA, "modules": {}}, "'modules' must be a list"),
    ("name type", graph_dict({"name": 3}), "modules[0]: 'name' must be a string"),
    ("children type", graph_dict(m("", "a")), "module '' (the root): 'children' must be a list"),
]  # fmt: skip
