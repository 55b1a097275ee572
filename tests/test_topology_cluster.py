"""Cluster model: presets, validation errors, YAML/JSON round trips, link tiers."""

import pytest
from pydantic import ValidationError
from tolerance import relative_difference, within

from topology import Cluster, ClusterError, LinkSpec
from topology.cluster import PRESETS

# Model predictions compared with `within(relative_difference(...))`: the same closed form evaluated two ways,
# so fp64 round-off only (rel 1e-12, 1e-9, or pytest.approx's 1e-6): worst 5.1e-16 (at 1e-12), 2.2e-16 (at 1e-9)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_validates_and_cites_sources(name):
    c = Cluster.preset(name, nodes=1)
    assert c.world_size == c.gpus_per_node
    assert c.sources, f"preset {name} must say where its figures come from"
    assert 0 < c.accelerator.attention_efficiency <= 1


def test_preset_aliases_nodes_and_overrides():
    c = Cluster.preset("H100", nodes=4)
    assert c.name == "dgx-h100" and c.world_size == 32
    assert c.intra_node.bandwidth_gb_s == 450 and c.inter_node.bandwidth_gb_s == 50
    cpu = Cluster.preset("cpu", gpus_per_node=4)
    assert cpu.world_size == 4 and cpu.backend == "gloo"
    assert Cluster.preset("dgx-h200").accelerator.memory_gb == 141


def test_unknown_preset_lists_choices():
    with pytest.raises(ClusterError, match="dgx-h100"):
        Cluster.preset("dgx-z900")


def test_nvl72_domain_spans_trays_and_must_be_filled():
    c = Cluster.preset("gb200-nvl72", nodes=18)
    assert c.world_size == 72 and c.domain_size == 72
    assert c.link_between(0, 71).kind == "nvlink"
    two_racks = Cluster.preset("gb200-nvl72", nodes=36)
    assert two_racks.link_between(0, 72).kind == "infiniband"
    with pytest.raises(ValidationError, match="whole NVLink domains"):
        Cluster.preset("gb200-nvl72", nodes=20)


def test_link_tiers():
    dgx = Cluster.preset("dgx-h100", nodes=2)
    assert dgx.link_between(0, 7).kind == "nvlink"
    assert dgx.link_between(7, 8).kind == "infiniband"
    pcie = Cluster.preset("pcie-8gpu")
    assert pcie.link_between(0, 3).kind == "pcie"
    assert pcie.link_between(3, 4).kind == "upi"
    assert pcie.tier_name(pcie.tier(3, 4)) == "cross-socket"
    assert dgx.tier_name(dgx.tier(0, 1)) == "intra-node"


@pytest.mark.parametrize("fmt", ["yaml", "json"])
def test_round_trip_text_and_files(tmp_path, fmt):
    c = Cluster.preset("pcie-8gpu", nodes=2)
    text = getattr(c, f"to_{fmt}")()
    assert getattr(Cluster, f"from_{fmt}")(text) == c
    path = c.save(tmp_path / f"cluster.{fmt}")
    assert Cluster.load(path) == c
    assert getattr(Cluster, f"from_{fmt}")(path) == c


def _base(**kw):
    data = Cluster.preset("dgx-h100", nodes=2).to_dict()
    data.update(kw)
    return data


@pytest.mark.parametrize(
    "data, match",
    [
        (_base(nodes=0), "nodes"),
        (_base(inter_node=None), "inter_node"),
        (_base(nvlink_domain_gpus=12), "multiple of gpus_per_node=8"),
        (_base(socket_gpus=4), "cross_socket"),
        (_base(socket_gpus=3, cross_socket={"kind": "upi", "bandwidth_gb_s": 5}), "must divide"),
        (_base(cross_socket={"kind": "upi", "bandwidth_gb_s": 5}), "socket_gpus"),
        (_base(bandwith=1), "bandwith"),  # typo: extra fields are refused
        (_base(intra_node={"kind": "nvlink", "bandwidth_gb_s": -1}), "bandwidth_gb_s"),
        (_base(intra_node={"kind": "nvlink", "bandwidth_gb_s": 400_000}), "gigabits"),
        (_base(intra_node={"kind": "nvlink", "bandwidth_gb_s": 450, "latency_us": -2}), "latency_us"),
        (_base(intra_node={"kind": "warp-drive", "bandwidth_gb_s": 450}), "kind"),
        (_base(accelerator={**PRESETS["dgx-h100"]["accelerator"], "attention_efficiency": 55}), "fraction"),
        (_base(accelerator={**PRESETS["dgx-h100"]["accelerator"], "peak_tflops": 0}), "peak_tflops"),
    ],
)
def test_invalid_clusters_name_the_field(data, match):
    with pytest.raises(ClusterError, match=match):
        Cluster.from_dict(data)


def test_pcie_nvlink_domain_is_rejected():
    data = Cluster.preset("pcie-8gpu", nodes=2).to_dict()
    data["nvlink_domain_gpus"] = 16
    with pytest.raises(ClusterError, match="only an NVLink"):
        Cluster.from_dict(data)


def test_bad_files(tmp_path):
    with pytest.raises(ClusterError, match="does not exist"):
        Cluster.load(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes: [1, 2\n")
    with pytest.raises(ClusterError, match="not valid YAML"):
        Cluster.load(bad)
    with pytest.raises(ClusterError, match="mapping"):
        Cluster.from_yaml("- 1\n- 2\n")
    with pytest.raises(ClusterError, match="not valid JSON"):
        Cluster.from_json("{nodes: 1")


def test_link_transfer_time():
    link = LinkSpec(kind="infiniband", bandwidth_gb_s=50, latency_us=10)
    assert link.transfer_s(0) == 0
    within(relative_difference(link.transfer_s(50e9), 1 + 10e-6, floor=1e-6), 1e-6, "link.transfer_s(50e9)")
