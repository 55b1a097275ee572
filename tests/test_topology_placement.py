"""Mesh rank order and placement checks."""

import warnings

import pytest

from topology import (
    Cluster,
    PlacementError,
    PlacementWarning,
    check_placement,
    fitting_ulysses_degrees,
    mesh_ranks,
    ring_groups,
    ulysses_groups,
)


def test_rank_order_ulysses_innermost():
    assert mesh_ranks(16, 4, 2) == [[[0, 1, 2, 3], [4, 5, 6, 7]], [[8, 9, 10, 11], [12, 13, 14, 15]]]
    assert ulysses_groups(8, 2, 2, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert ring_groups(8, 2, 4) == [[0, 2, 4, 6], [1, 3, 5, 7]]


@pytest.mark.parametrize(
    "args, match", [((8, 3, 1), "does not divide"), ((8, 2, 2, 3), "must equal"), ((8, 0, 1), "ulysses")]
)
def test_bad_degrees(args, match):
    with pytest.raises(PlacementError, match=match):
        mesh_ranks(*args)


def test_ulysses_across_nodes_raises_with_fitting_degrees():
    c = Cluster.preset("dgx-h100", nodes=2)
    with pytest.raises(PlacementError) as err:
        check_placement(c, ulysses=16, ring=1)
    msg = str(err.value)
    assert "ranks 0-15 on nodes 0-1" in msg and "Ulysses degrees that fit: 1, 2, 4, 8" in msg
    assert "ulysses=8, ring=2" in msg
    with pytest.warns(PlacementWarning, match="cross the inter-node fabric"):
        report = check_placement(c, ulysses=16, ring=1, warn=True)
    assert not report.ok and report.ulysses_link == "inter-node"


def test_good_placements():
    c = Cluster.preset("dgx-h100", nodes=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = check_placement(c, ulysses=8, ring=4)
        assert r.ok and r.ulysses_link == "intra-node" and r.ring_link == "inter-node"
        assert check_placement(c, ulysses=4, ring=2).ring_link == "intra-node"  # dp=4, ring inside a node
        nvl = Cluster.preset("gb200-nvl72", nodes=18)
        assert check_placement(nvl, ulysses=72, ring=1).ulysses_link == "nvlink-domain"


def test_uneven_ulysses_straddles_nodes():
    c = Cluster.preset("dgx-h100", nodes=3)
    with pytest.raises(PlacementError, match="nodes 0-1"):
        check_placement(c, ulysses=3, ring=1)  # group [6, 7, 8] straddles nodes 0 and 1


def test_pcie_cross_socket_only_warns():
    c = Cluster.preset("pcie-8gpu")
    with pytest.warns(PlacementWarning, match="both CPU sockets"):
        report = check_placement(c, ulysses=8)
    assert report.ok and report.notes


def test_fitting_degrees_and_subset_world():
    assert fitting_ulysses_degrees(Cluster.preset("dgx-h100", nodes=2)) == [1, 2, 4, 8]
    assert fitting_ulysses_degrees(Cluster.preset("dgx-h100", nodes=2), cp_size=4) == [1, 2, 4]
    assert 72 in fitting_ulysses_degrees(Cluster.preset("gb200-nvl72", nodes=18))
    c = Cluster.preset("dgx-h100", nodes=2)
    assert check_placement(c, ulysses=4, ring=1, world_size=4).dp == 1
    with pytest.raises(PlacementError, match="world_size"):
        check_placement(c, ulysses=4, world_size=32)
