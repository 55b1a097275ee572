"""Build a :class:`Cluster` for the job we are running in.

Sources, in order: the launcher's environment (torchrun, then SLURM) for nodes and ranks per node;
the visible CUDA devices (torch) for the GPU model and memory; NVML (``pynvml`` / nvidia-ml-py, optional)
for the number and generation of active NVLinks. What cannot be observed (NIC bandwidth, achievable
efficiency) comes from the matching preset, and ``Cluster.sources`` says which figures were assumed.
Without a GPU the result is the ``cpu`` (gloo) preset. Every input can be injected, so tests can fake
them: ``discover(env={...}, torch_module=fake, nvml=fake_nvml)``.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping
from typing import Any

from .cluster import PRESETS, Cluster, ClusterError

__all__ = ["discover", "launcher_layout", "nvlink_info"]

# Device-name fragment -> preset whose accelerator and links describe that family (first match wins).
_FAMILIES = [
    ("GB200", "gb200-nvl72"), ("B200", "gb200-nvl72"), ("H200", "dgx-h200"), ("H100", "dgx-h100"),
    ("H800", "dgx-h100"), ("A100", "dgx-a100"), ("A800", "dgx-a100"), ("L20", "pcie-8gpu"),
]  # fmt: skip
# NVLink generation -> GB/s per link per direction (NVLink 2-4: 25 GB/s, NVLink 5: 50 GB/s).
_NVLINK_GB_S_PER_LINK = {2: 25.0, 3: 25.0, 4: 25.0, 5: 50.0}
_NVLINK_MAX_LINKS = 18


def _int(env: Mapping[str, str], key: str) -> int | None:
    raw = env.get(key)
    if raw is None or raw == "":
        return None
    m = re.match(r"\s*(\d+)", raw)
    if not m:
        raise ClusterError(f"environment variable {key}={raw!r} is not an integer")
    return int(m.group(1))


def _slurm_per_node(raw: str) -> int:
    """Parse SLURM's compressed per-node lists: ``8``, ``8(x4)``, ``8,8`` or ``h100:8``."""
    counts = []
    for part in raw.split(","):
        m = re.fullmatch(r"\s*(?:[\w-]+:)?(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ClusterError(f"cannot parse SLURM per-node count {raw!r}")
        counts.append(int(m.group(1)))
    if len(set(counts)) != 1:
        raise ClusterError(f"SLURM gives different task counts per node ({raw!r}); nodes must be identical")
    return counts[0]


def launcher_layout(env: Mapping[str, str] | None = None) -> tuple[int, int | None, str]:
    """``(nodes, ranks_per_node or None, source)`` from torchrun or SLURM variables."""
    env = os.environ if env is None else env
    world, local = _int(env, "WORLD_SIZE"), _int(env, "LOCAL_WORLD_SIZE")
    if world is not None and local is not None:
        if local < 1 or world % local:
            raise ClusterError(
                f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local}: nodes with different "
                "GPU counts are not supported; launch the same number of ranks on every node"
            )
        return world // local, local, "torchrun (WORLD_SIZE, LOCAL_WORLD_SIZE)"
    nodes = _int(env, "SLURM_NNODES") or _int(env, "SLURM_JOB_NUM_NODES")
    if nodes is not None:
        if env.get("SLURM_NTASKS_PER_NODE"):
            return nodes, _slurm_per_node(env["SLURM_NTASKS_PER_NODE"]), "SLURM (SLURM_NTASKS_PER_NODE)"
        tasks = _int(env, "SLURM_NTASKS")
        if tasks is not None:
            if tasks % nodes:
                raise ClusterError(
                    f"SLURM_NTASKS={tasks} is not a multiple of SLURM_NNODES={nodes}; use --ntasks-per-node"
                )
            return nodes, tasks // nodes, "SLURM (SLURM_NTASKS / SLURM_NNODES)"
        for key in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
            if env.get(key):
                return nodes, _slurm_per_node(env[key]), f"SLURM ({key})"
        return nodes, None, "SLURM (SLURM_NNODES)"
    if world is not None:  # plain WORLD_SIZE without LOCAL_WORLD_SIZE: assume one node
        return 1, world, "WORLD_SIZE (single node assumed)"
    return 1, None, "no launcher"


def nvlink_info(nvml: Any, index: int = 0) -> tuple[int, int] | None:
    """``(active_links, nvlink_version)`` of GPU ``index`` via NVML, or None when NVML is unusable."""
    try:
        nvml.nvmlInit()
    except Exception:  # noqa: BLE001 - any NVML failure means "unknown", never a crash
        return None
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        enabled = getattr(nvml, "NVML_FEATURE_ENABLED", 1)
        active, version = 0, 0
        for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", _NVLINK_MAX_LINKS)):
            try:
                if nvml.nvmlDeviceGetNvLinkState(handle, link) == enabled:
                    active += 1
                    if not version:
                        version = int(nvml.nvmlDeviceGetNvLinkVersion(handle, link))
            except Exception:  # noqa: BLE001 - link not present on this GPU
                continue
        return active, version
    except Exception:  # noqa: BLE001
        return None
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def _import_nvml() -> Any:
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None
    return pynvml


def _family(device_name: str) -> str | None:
    upper = device_name.upper()
    return next((preset for frag, preset in _FAMILIES if frag in upper), None)


def discover(
    env: Mapping[str, str] | None = None,
    *,
    torch_module: Any = None,
    nvml: Any = None,
) -> Cluster:
    """Describe the cluster this process runs in (see the module docstring for the sources).

    Args:
        env: Environment variables; None: `os.environ`.
        torch_module: torch, for the visible CUDA devices (tests pass a fake); None: imported if available.
        nvml: pynvml, for the active NVLinks (tests pass a fake); None: imported if available.

    Returns:
        The cluster.
    """
    env = os.environ if env is None else env
    nodes, per_node, launcher = launcher_layout(env)
    if torch_module is None:
        import torch as torch_module  # local: discovery is the only place that touches devices
    cuda = getattr(torch_module, "cuda", None)
    n_dev = cuda.device_count() if cuda is not None and cuda.is_available() else 0
    sources = [f"layout from {launcher}"]
    if n_dev == 0:
        sources.append("no CUDA device visible: CPU/gloo preset")
        return Cluster.preset("cpu", nodes=nodes, gpus_per_node=per_node or 1, name="discovered-cpu", sources=sources)

    gpus_per_node = per_node or n_dev
    name = str(cuda.get_device_name(0))
    family = _family(name)
    if family is None:
        warnings.warn(
            f"unknown GPU {name!r}: using H100-class links and a placeholder 100 TFLOPS peak; write a "
            "cluster YAML (Cluster.save) with the real figures for planning",
            stacklevel=2,
        )
        family = "dgx-h100"
        data = dict(PRESETS[family], accelerator={**PRESETS[family]["accelerator"], "name": name, "peak_tflops": 100.0})
    else:
        data = dict(PRESETS[family])
    data["accelerator"] = dict(data["accelerator"])
    try:
        data["accelerator"]["memory_gb"] = round(cuda.get_device_properties(0).total_memory / 1e9, 1)
    except Exception:  # noqa: BLE001 - keep the preset's figure
        pass
    sources.append(f"GPU {name!r} x {n_dev} visible, figures of preset {family!r}")

    info = nvlink_info(nvml if nvml is not None else _import_nvml())
    if info is None:
        sources.append("NVML unavailable: intra-node link assumed from the preset")
    elif info[0] == 0:
        data["intra_node"] = {"kind": "pcie", "bandwidth_gb_s": 25.0, "latency_us": 5.0}
        data.pop("nvlink_domain_gpus", None)
        sources.append("NVML: no active NVLink, intra-node link is PCIe (25 GB/s assumed)")
    else:
        active, version = info
        per_link = _NVLINK_GB_S_PER_LINK.get(version, 25.0)
        data["intra_node"] = {"kind": "nvlink", "bandwidth_gb_s": active * per_link, "latency_us": 3.0}
        sources.append(f"NVML: {active} active NVLink v{version} links x {per_link:g} GB/s per direction")
    if data.get("socket_gpus") and gpus_per_node != data["gpus_per_node"]:
        data.pop("socket_gpus"), data.pop("cross_socket", None)  # the preset's socket split no longer applies
    domain = _int(env, "HYBRID_CP_NVLINK_DOMAIN")
    if domain is not None:
        data["nvlink_domain_gpus"] = domain
        sources.append(f"NVLink domain of {domain} GPUs from HYBRID_CP_NVLINK_DOMAIN")
    elif (
        data.get("nvlink_domain_gpus")
        and nodes * gpus_per_node > data["nvlink_domain_gpus"]
        and (nodes * gpus_per_node) % data["nvlink_domain_gpus"]
    ):
        data.pop("nvlink_domain_gpus")  # partial rack: do not assume a domain we cannot see
    data.update(name=f"discovered-{family}", nodes=nodes, gpus_per_node=gpus_per_node, sources=sources)
    if data.get("nvlink_domain_gpus") and data["nvlink_domain_gpus"] % gpus_per_node:
        data.pop("nvlink_domain_gpus")
    return Cluster.from_dict(data, origin="discovered cluster")
