"""Discovery from faked launcher environments, faked torch devices and a faked NVML."""

from types import SimpleNamespace

import pytest

from topology import ClusterError, discover
from topology.discovery import launcher_layout


def fake_torch(name="NVIDIA H100 80GB HBM3", count=8, memory=80e9):
    cuda = SimpleNamespace(
        is_available=lambda: count > 0,
        device_count=lambda: count,
        get_device_name=lambda i: name,
        get_device_properties=lambda i: SimpleNamespace(total_memory=memory),
    )
    return SimpleNamespace(cuda=cuda)


class FakeNVML:
    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_MAX_LINKS = 18

    def __init__(self, links=18, version=4, fail_init=False):
        self.links, self.version, self.fail_init, self.shutdown = links, version, fail_init, False

    def nvmlInit(self):
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self):
        self.shutdown = True

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetNvLinkState(self, handle, link):
        if link >= self.links:
            raise RuntimeError("NVML_ERROR_INVALID_ARGUMENT")
        return 1

    def nvmlDeviceGetNvLinkVersion(self, handle, link):
        return self.version


def test_torchrun_two_nodes_h100_with_nvml():
    nvml = FakeNVML(links=18, version=4)
    env = {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "RANK": "3", "LOCAL_RANK": "3"}
    c = discover(env, torch_module=fake_torch(), nvml=nvml)
    assert (c.nodes, c.gpus_per_node) == (2, 8)
    assert c.intra_node.kind == "nvlink" and c.intra_node.bandwidth_gb_s == 450
    assert c.accelerator.peak_tflops == 989 and c.accelerator.memory_gb == 80
    assert nvml.shutdown and any("NVML: 18 active" in s for s in c.sources)


def test_torchrun_inconsistent_world_is_a_clear_error():
    with pytest.raises(ClusterError, match="WORLD_SIZE=12 is not a multiple of LOCAL_WORLD_SIZE=8"):
        discover({"WORLD_SIZE": "12", "LOCAL_WORLD_SIZE": "8"}, torch_module=fake_torch(), nvml=FakeNVML())


@pytest.mark.parametrize(
    "env, layout",
    [
        ({"SLURM_NNODES": "4", "SLURM_NTASKS_PER_NODE": "8(x4)"}, (4, 8)),
        ({"SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "16"}, (2, 8)),
        ({"SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "4"}, (2, 4)),
        ({"SLURM_NNODES": "3", "SLURM_GPUS_PER_NODE": "h100:8"}, (3, 8)),
        ({"SLURM_NNODES": "2"}, (2, None)),
        ({"WORLD_SIZE": "4"}, (1, 4)),
        ({}, (1, None)),
    ],
)
def test_launcher_layout(env, layout):
    assert launcher_layout(env)[:2] == layout


@pytest.mark.parametrize(
    "env, match",
    [
        ({"SLURM_NNODES": "2", "SLURM_NTASKS": "15"}, "not a multiple"),
        ({"SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "8,4"}, "different task counts"),
        ({"SLURM_NNODES": "two"}, "not an integer"),
    ],
)
def test_launcher_errors(env, match):
    with pytest.raises(ClusterError, match=match):
        launcher_layout(env)


def test_slurm_a100_cluster():
    env = {"SLURM_NNODES": "4", "SLURM_NTASKS": "32", "SLURM_PROCID": "0"}
    c = discover(env, torch_module=fake_torch("NVIDIA A100-SXM4-80GB"), nvml=FakeNVML(links=12, version=3))
    assert c.world_size == 32 and c.intra_node.bandwidth_gb_s == 300 and c.inter_node.bandwidth_gb_s == 25


def test_no_nvlink_means_pcie():
    c = discover({}, torch_module=fake_torch("NVIDIA H100 PCIe", count=4), nvml=FakeNVML(links=0))
    assert c.gpus_per_node == 4 and c.intra_node.kind == "pcie"


def test_nvml_failure_falls_back_to_preset_links():
    c = discover({}, torch_module=fake_torch(count=8), nvml=FakeNVML(fail_init=True))
    assert c.intra_node.bandwidth_gb_s == 450
    assert any("NVML unavailable" in s for s in c.sources)


def test_no_gpu_falls_back_to_cpu():
    c = discover({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, torch_module=fake_torch(count=0))
    assert c.backend == "gloo" and (c.nodes, c.gpus_per_node) == (2, 2)


def test_real_torch_on_this_machine_does_not_crash():
    c = discover({})
    assert c.world_size >= 1


def test_unknown_gpu_warns_and_uses_placeholder():
    with pytest.warns(UserWarning, match="unknown GPU"):
        c = discover({}, torch_module=fake_torch("Mystery Accelerator 9000"), nvml=FakeNVML())
    assert c.accelerator.name == "Mystery Accelerator 9000"


def test_gb200_domain_and_override():
    env = {"WORLD_SIZE": "72", "LOCAL_WORLD_SIZE": "4"}
    c = discover(env, torch_module=fake_torch("NVIDIA GB200", count=4), nvml=FakeNVML(links=18, version=5))
    assert c.domain_size == 72 and c.intra_node.bandwidth_gb_s == 900
    c2 = discover(
        {**env, "HYBRID_CP_NVLINK_DOMAIN": "36"},
        torch_module=fake_torch("NVIDIA GB200", count=4),
        nvml=FakeNVML(links=18, version=5),
    )
    assert c2.domain_size == 36
