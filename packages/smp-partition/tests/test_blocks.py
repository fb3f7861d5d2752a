"""Repeated blocks (smp_partition.blocks) and the default method's whole-block candidates."""

from __future__ import annotations

import re
from pathlib import Path

from smp_partition import Module, ModuleGraph, partition
from smp_partition.blocks import contract_blocks, keep_blocks_whole, outer_blocks
from smp_partition.tree import build_tree

# Hugging Face LlamaForCausalLM (4 decoder layers, head tied to the embedding), traced by
# smp-pipeline on one microbatch of 32 sequences (benchmarks/plan_models.py "llama-tied").
LLAMA = Path(__file__).resolve().parent / "data" / "llama-tied.json"
IN_LAYER = re.compile(r"model\.layers\.\d+(\.|$)")  # a layer or below it


def _graph() -> ModuleGraph:
    """root -> stack (ModuleList) -> three Layers (attn, moe -> two Experts -> w), head."""
    mods = [Module("", "Net", ("stack", "head"), {}), Module("stack", "ModuleList", (), {})]
    layers = []
    for i in range(3):
        p = f"stack.{i}"
        layers.append(p)
        mods += [
            Module(p, "Layer", (f"{p}.attn", f"{p}.moe"), {}),
            Module(f"{p}.attn", "Attn", (), {f"{p}.a": 10}),
            Module(f"{p}.moe", "Moe", (f"{p}.moe.0", f"{p}.moe.1"), {}),
        ]
        for e in range(2):
            q = f"{p}.moe.{e}"
            mods += [Module(q, "Expert", (f"{q}.w",), {}), Module(f"{q}.w", "Linear", (), {q: 5})]
    mods[1] = Module("stack", "ModuleList", tuple(layers), {})
    mods.append(Module("head", "Linear", (), {"h": 7}))
    return ModuleGraph(mods)


def test_outer_blocks_are_the_outermost_repeated_modules_with_children() -> None:
    g = _graph()
    tree = build_tree(g)
    inside = outer_blocks(g, tree)
    name = {n: g.modules[tree.modules[n][0]].name for n in range(len(tree))}
    node = {v: k for k, v in name.items()}
    got = {name[n]: (name[b] if b >= 0 else None) for n, b in enumerate(inside)}
    # The layers are blocks (three of a type, with children); the experts are blocks too,
    # but inside a layer, so everything under a layer maps to the layer.
    assert got["stack.0"] is None and got["stack.2"] is None
    assert got["stack.1.attn"] == "stack.1"
    assert got["stack.1.moe.0"] == "stack.1"
    assert got["stack.1.moe.0.w"] == "stack.1"
    # Not blocks: the root, the container, a lone head, leaves.
    assert got["stack"] is None and got["head"] is None and got[""] is None
    # Keeping whole moves every inside node onto its layer's device; contraction puts a
    # layer's whole cost on the layer node.
    device = [0] * len(tree)
    device[node["stack.1.moe.1.w"]] = 1
    whole = keep_blocks_whole(inside, device)
    assert whole[node["stack.1.moe.1.w"]] == 0
    own = list(range(len(tree)))
    contracted = contract_blocks(inside, own)
    assert sum(contracted) == sum(own)
    assert contracted[node["stack.1.attn"]] == 0
    assert contracted[node["stack.1"]] == sum(
        own[n] for n in range(len(tree)) if n == node["stack.1"] or inside[n] == node["stack.1"]
    )


def test_untyped_or_unique_modules_are_not_blocks() -> None:
    mods = [
        Module("", "", ("a", "b"), {}),
        Module("a", "", ("a.x",), {}),  # untyped: never a block
        Module("b", "", ("b.x",), {}),
        Module("a.x", "L", (), {"ax": 1}),
        Module("b.x", "L", (), {"bx": 1}),
    ]
    g = ModuleGraph(mods)
    assert max(outer_blocks(g, build_tree(g))) == -1


def test_llama_decoder_layers_stay_whole_at_pp4() -> None:
    # Before whole-block candidates, pp=4 with smp's slack put layer 2 on one stage and its
    # attention and MLP on the next, and layer 3's MLP on the one after: 8 cut edges, each a
    # request round trip per microbatch. A whole-layer split within the slack cuts 5.
    g = ModuleGraph.from_json(LLAMA)
    strict = partition(g, 4, alpha=0.8)
    loose = partition(g, 4, alpha=0.8, balance_slack=0.15)
    assert [(p, c) for p, c in loose.cut_edges if IN_LAYER.match(p)] == []
    assert len(loose.cut_edges) == 5
    assert loose.max_load <= strict.max_load * 1.15
    assert loose.loads.count(0.0) == 0
