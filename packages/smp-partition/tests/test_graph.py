"""Loading, round-tripping and validating module graphs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import BAD, t5_like
from smp_partition import SCHEMA, GraphError, Module, ModuleGraph
from smp_partition.tree import build_tree


def test_round_trip(tmp_path: Path) -> None:
    g = t5_like(2)
    again = ModuleGraph.from_dict(json.loads(json.dumps(g.to_dict())))
    assert again.modules == g.modules
    path = tmp_path / "g.json"
    g.to_json(path)
    assert ModuleGraph.from_json(path).modules == g.modules
    assert "encoder" in g and g["encoder"].type == "Stack" and len(g) == len(g.modules)


def test_defaults_are_optional() -> None:
    g = ModuleGraph.from_dict({"schema": SCHEMA, "modules": [{"name": ""}]})
    assert g[""] == Module("")


@pytest.mark.parametrize("case,data,message", BAD, ids=[b[0] for b in BAD])
def test_errors_name_the_fault(case: str, data: dict[str, Any], message: str) -> None:
    with pytest.raises(GraphError) as info:
        ModuleGraph.from_dict(data)
    text = str(info.value)
    assert message in text
    assert "\n" not in text
    assert isinstance(info.value, ValueError)


def test_file_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(GraphError, match="invalid JSON"):
        ModuleGraph.from_json(bad)
    with pytest.raises(GraphError, match="missing.json"):
        ModuleGraph.from_json(tmp_path / "missing.json")


def test_duplicate_child_listing_and_reuse_are_fine() -> None:
    g = ModuleGraph(
        [Module("", children=("a", "b", "a")), Module("a", children=("c",)),
         Module("b", children=("c",)), Module("c")]
    )  # fmt: skip
    tree = build_tree(g)
    assert len(tree) == 4
    # c is reached from a first (BFS, listed order), so a is its tree parent.
    c = tree.module_node[g.index_of("c")]
    assert tree.parent[c] == tree.module_node[g.index_of("a")]


def test_shared_parameters_merge_nodes() -> None:
    g = t5_like(2)
    tree = build_tree(g)
    shared = tree.module_node[g.index_of("shared")]
    assert tree.module_node[g.index_of("lm_head")] == shared
    assert sorted(g.modules[i].name for i in tree.modules[shared]) == ["lm_head", "shared"]
    # Every node but the root has a parent with a smaller id (BFS ids).
    assert all(tree.parent[n] < n for n in range(1, len(tree)))
    assert len(tree.preorder()) == len(tree)


def test_parameter_sharing_between_parent_and_child_still_gives_a_tree() -> None:
    g = ModuleGraph(
        [Module("", children=("a",)), Module("a", children=("b",), params={"w": 1}),
         Module("b", children=("c",), params={"w": 1}), Module("c", params={"x": 2})]
    )  # fmt: skip
    tree = build_tree(g)
    assert len(tree) == 3  # '', {a, b}, c
    assert tree.parent == [-1, 0, 1]
