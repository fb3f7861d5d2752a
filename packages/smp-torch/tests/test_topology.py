"""Rank layout for every placement (pure arithmetic)."""

from __future__ import annotations

import itertools

import pytest
from smp_torch.topology import Topology


@pytest.mark.parametrize("placement", ["".join(p) for p in itertools.permutations("DPT")])
@pytest.mark.parametrize(("pp", "tp", "rdp"), [(2, 2, 2), (4, 1, 2), (1, 4, 2), (2, 3, 1)])
def test_groups_partition_the_world(placement: str, pp: int, tp: int, rdp: int) -> None:
    topo = Topology(pp, tp, rdp, placement)
    world = set(range(topo.size))
    for kind, size in (("pp", pp), ("tp", tp), ("rdp", rdp), ("dp", tp * rdp), ("mp", pp * tp)):
        groups = topo.all_groups(kind)
        assert sorted(r for g in groups for r in g) == sorted(world)
        assert all(len(g) == size for g in groups)
    for r in world:
        assert set(topo.tp_group(r)) <= set(topo.dp_group(r))
        assert set(topo.rdp_group(r)) <= set(topo.dp_group(r))
        c = topo.coord(r)
        assert topo.rank(c.d, c.p, c.t) == r


def test_cluster_and_spread_layouts() -> None:
    cluster = Topology(2, 2, 2, "DPT")
    assert cluster.tp_group(0) == [0, 1]  # tensor-parallel peers are neighbours
    assert cluster.pp_group(0) == [0, 2]
    assert cluster.rdp_group(0) == [0, 4]
    spread = Topology(2, 2, 2, "TPD")
    assert spread.rdp_group(0) == [0, 1]  # replicas are neighbours
    assert spread.pp_group(0) == [0, 2]
    assert spread.tp_group(0) == [0, 4]


@pytest.mark.parametrize("placement", ["DPT", "TPD", "PDT"])
@pytest.mark.parametrize(("pp", "tp", "rdp", "ep"), [(1, 1, 4, 2), (1, 1, 4, 4), (2, 2, 4, 2), (1, 2, 6, 3)])
def test_expert_groups(placement: str, pp: int, tp: int, rdp: int, ep: int) -> None:
    topo = Topology(pp, tp, rdp, placement, ep)
    world = set(range(topo.size))
    for kind, size in (("ep", ep), ("edp", tp * rdp // ep)):
        groups = topo.all_groups(kind)
        assert sorted(r for g in groups for r in g) == sorted(world)
        assert all(len(g) == size for g in groups)
    for r in world:
        replicas = topo.rdp_group(r)
        ep_group, edp_group = topo.ep_group(r), topo.edp_group(r)
        # ep groups: consecutive blocks of the replicas; edp: the same place in each block,
        # on every TP rank (TP peers feed their own samples to the same experts).
        block = replicas.index(r) // ep
        assert ep_group == replicas[block * ep : (block + 1) * ep]
        slot = replicas.index(r) % ep
        want = sorted(q for t in topo.tp_group(r) for q in topo.rdp_group(t)[slot::ep])
        assert edp_group == want
        assert set(ep_group) & set(edp_group) == {r}


def test_expert_degree_must_divide_rdp() -> None:
    with pytest.raises(ValueError):
        Topology(1, 1, 4, "DPT", 3)


@pytest.mark.parametrize("placement", ["".join(p) for p in itertools.permutations("CDPT")])
@pytest.mark.parametrize(("pp", "tp", "rdp", "cp"), [(2, 2, 2, 2), (1, 1, 2, 4), (2, 1, 1, 2)])
def test_context_groups(placement: str, pp: int, tp: int, rdp: int, cp: int) -> None:
    topo = Topology(pp, tp, rdp, placement, cp=cp)
    world = set(range(topo.size))
    assert topo.size == pp * tp * rdp * cp
    sizes = {"pp": pp, "tp": tp, "cp": cp, "rdp": rdp, "dp": tp * rdp, "rdp_cp": rdp * cp,
             "dp_cp": tp * rdp * cp, "mp": pp * tp}
    for kind, size in sizes.items():
        groups = topo.all_groups(kind)
        assert sorted(r for g in groups for r in g) == sorted(world)
        assert all(len(g) == size for g in groups)
    for r in world:
        here = topo.coord(r)
        # a cp group: the same (d, p, t), every c; the gradient groups: dp / rdp joined over cp
        assert {topo.coord(q).c for q in topo.cp_group(r)} == set(range(cp))
        assert all((topo.coord(q).d, topo.coord(q).p, topo.coord(q).t) == (here.d, here.p, here.t)
                   for q in topo.cp_group(r))
        assert set(topo.dp_cp_group(r)) == {q for c in topo.cp_group(r) for q in topo.dp_group(c)}
        assert set(topo.rdp_cp_group(r)) == {q for c in topo.cp_group(r) for q in topo.rdp_group(c)}
        assert not set(topo.cp_group(r)) & set(topo.dp_group(r)) - {r}  # dp excludes cp
        assert topo.rank(here.d, here.p, here.t, here.c) == r


def test_cp_peers_sit_next_to_tp_peers() -> None:
    cluster = Topology(2, 2, 2, "DPT", cp=2)  # DPT is DPCT
    assert cluster.tp_group(0) == [0, 1]
    assert cluster.cp_group(0) == [0, 2]
    assert cluster.pp_group(0) == [0, 4]
    assert cluster.rdp_group(0) == [0, 8]
    # cp = 1 leaves every rank where it was
    assert [Topology(2, 2, 2, "DPT").coord(r) for r in range(8)] == [
        Topology(2, 2, 2, "DPCT", cp=1).coord(r) for r in range(8)]
