"""Sharded data parallelism's planning (pure, no MPI job): units, prefetch, hierarchy."""

from __future__ import annotations

import pytest
from smp_torch.config import parse_config
from smp_torch.errors import ConfigError
from smp_torch.sharded import choose_units, post_forward_reshard, prefetch_plan
from smp_torch.sharded_pp import stage_tops, unit_groups
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)
        self.ln = nn.LayerNorm(width)


class Net(nn.Module):
    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 8)
        self.blocks = nn.ModuleList([Block(8), Block(8)])
        self.head = nn.Linear(8, 100, bias=False)
        if tied:
            self.head.weight = self.emb.weight


def test_units_follow_the_threshold_and_keep_small_modules_with_the_parent() -> None:
    # fc1: 288, fc2: 264, ln: 16, a block: 568, emb/head: 800 each.
    units = choose_units(Net(tied=False), threshold=500, bucket=10**9)
    assert units == [("emb", 800), ("blocks.0", 568), ("blocks.1", 568), ("head", 800), ("", 0)]
    units = choose_units(Net(tied=False), threshold=200, bucket=10**9)
    assert [n for n, _ in units][:3] == ["emb", "blocks.0.fc1", "blocks.0.fc2"]
    assert ("blocks.0", 16) not in units  # the layer norm (16) stays with the root
    assert units[-1] == ("", 32)
    assert choose_units(Net(), threshold=10**6, bucket=10**9) == [("", 800 + 2 * 568)]


def test_a_tied_parameter_stays_in_the_common_ancestor() -> None:
    units = choose_units(Net(tied=True), threshold=500, bucket=10**9)
    assert [n for n, _ in units] == ["blocks.0", "blocks.1", ""]
    assert dict(units)[""] == 800  # the shared embedding/head weight, counted once


def test_bucket_size_splits_off_small_children() -> None:
    units = choose_units(Net(tied=False), threshold=1000, bucket=300)
    names = [n for n, _ in units]
    assert "blocks.0.fc1" in names and "blocks.1.fc1" in names
    assert all(size <= 300 for n, size in units if n not in ("", "emb", "head"))


def test_an_atomic_module_keeps_its_subtree_in_one_unit() -> None:
    # smp-tp's distributed modules use their submodules' parameters directly: a block marked
    # atomic is one unit (568) or stays with its parent, never split into fc1/fc2 units.
    def atomic(m: nn.Module) -> bool:
        return isinstance(m, Block)

    units = choose_units(Net(tied=False), threshold=200, bucket=10**9, atomic=atomic)
    assert [n for n, _ in units] == ["emb", "blocks.0", "blocks.1", "head", ""]
    units = choose_units(Net(tied=False), threshold=1200, bucket=10**9, atomic=atomic)
    assert units == [("", 800 + 2 * 568 + 800)]


def test_prefetch_respects_the_live_bound() -> None:
    units = [("a", 100), ("b", 100), ("c", 100), ("", 50)]
    fwd, bwd = prefetch_plan(units, ["", "a", "b", "c"], max_live=260)
    assert fwd == {"a": ["b"], "b": ["c"], "c": []}
    assert bwd == {"c": ["b"], "b": ["a"], "a": []}
    fwd, _ = prefetch_plan(units, ["", "a", "b", "c"], max_live=10**9)
    assert fwd["a"] == ["b", "c"]
    fwd, _ = prefetch_plan(units, ["", "a", "b", "c"], max_live=10**9, depth=1)
    assert fwd["a"] == ["b"]
    fwd, _ = prefetch_plan(units, ["", "a", "b", "c"], max_live=0)
    assert all(not v for v in fwd.values())


def test_hierarchical_reshard_size() -> None:
    nodes = ["x", "x", "y", "y"]
    assert post_forward_reshard([0, 1, 2, 3], nodes, True) == 2
    assert post_forward_reshard([0, 1, 2, 3], nodes, False) is True
    assert post_forward_reshard([0, 1, 2, 3], ["x"] * 4, True) is True  # one node
    assert post_forward_reshard([0, 1, 2, 3], ["x", "y", "x", "y"], True) is True  # interleaved
    assert post_forward_reshard([0, 1, 2, 3], ["x", "y", "y", "y"], True) is True  # uneven


def test_sharded_config_keys() -> None:
    cfg = parse_config({"sharded_data_parallel_degree": 2}, world_size=4)
    assert cfg.sdp == 2 and cfg.rdp == 4
    assert cfg.sdp_gradient_clipping == 0.0 and not cfg.sdp_hierarchical_allgather
    # With tensor parallelism the sharding groups are cut from each slice's ranks (rdp).
    cfg = parse_config({"sharded_data_parallel_degree": 2, "tensor_parallel_degree": 2}, world_size=8)
    assert cfg.sdp == 2 and cfg.rdp == 4
    # All three: each stage's tensor-parallel slice sharded over its 2 data-parallel ranks.
    both = {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2}
    cfg = parse_config({"sharded_data_parallel_degree": 2, **both}, world_size=8)
    assert cfg.sdp == 2 and cfg.rdp == 2


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"sharded_data_parallel_degree": 3}, "sharded_data_parallel_degree"),
        ({"sharded_data_parallel_degree": 4, "pipeline_parallel_degree": 4}, "sharded_data_parallel_degree"),
        # tp=4 of 8 ranks leaves 2 ranks per tensor-parallel slice: sdp=4 does not fit.
        ({"sharded_data_parallel_degree": 4, "tensor_parallel_degree": 4}, "sharded_data_parallel_degree"),
        ({"sharded_data_parallel_degree": 2, "shard_optimizer_state": True}, "shard_optimizer_state"),
        ({"sharded_data_parallel_degree": 2, "sdp_reduce_bucket_size": -1}, "sdp_reduce_bucket_size"),
        ({"sdp_max_live_parameters": -1}, "sdp_max_live_parameters"),
        ({"sdp_gradient_clipping": -0.5}, "sdp_gradient_clipping"),
        ({"sharded_data_parallel_degree": 2.0}, "sharded_data_parallel_degree"),
    ],
)
def test_bad_sharded_configs(config: dict, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(config, world_size=8)
    assert info.value.key == key


def test_stage_tops_are_owned_modules_with_a_foreign_parent_outermost_first() -> None:
    # Stage 0 owns the root, the embedding, the head and (non-contiguously) a part of block 2.
    owned = ["", "emb", "head", "blocks.2.attn", "blocks.2.attn.q"]
    assert stage_tops(owned) == ["", "blocks.2.attn"]
    # Stage 1: two whole blocks under a container owned by stage 0.
    assert stage_tops(["blocks.0", "blocks.0.fc", "blocks.1", "ln"]) == ["ln", "blocks.0", "blocks.1"]


def _groups(net: nn.Module, owned: list[str]) -> list[list[str]]:
    modules = dict(net.named_modules())
    local = {id(p) for name in owned for p in modules[name]._parameters.values() if p is not None}
    return unit_groups(stage_tops(owned), modules, local)


def test_stage_tops_sharing_a_parameter_are_one_unit() -> None:
    # A stage holding the tied embedding and head but not the root: two tops, one parameter,
    # so one (grouped) unit; the blocks stay units of their own.
    owned = ["emb", "head", "blocks.1", "blocks.1.fc1", "blocks.1.fc2", "blocks.1.ln"]
    assert _groups(Net(tied=True), owned) == [["emb", "head"], ["blocks.1"]]
    assert _groups(Net(tied=False), owned) == [["emb"], ["head"], ["blocks.1"]]


def test_a_nested_stage_top_joins_the_enclosing_one() -> None:
    # The root with block 0's fc1 (non-contiguous: block 0 itself is elsewhere) is one unit;
    # a top without parameters here (a foreign subtree only) is none.
    owned = ["", "emb", "head", "blocks.0.fc1"]
    assert _groups(Net(tied=True), owned) == [[""]]
    assert _groups(Net(tied=True), ["blocks.0.ln"]) == [["blocks.0.ln"]]
    assert _groups(Net(tied=True), []) == []
