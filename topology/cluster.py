"""Cluster description: accelerators, links and how GPUs group into sockets, nodes and NVLink domains.

A :class:`Cluster` is plain, validated data (pydantic v2). It can be written by hand, loaded from
YAML/JSON, built from a named preset (figures sourced in ``docs/planner.md``) or discovered at run time
(:func:`topology.discover`). The cost model only ever asks one question of it: *which link joins
global ranks a and b?* (:meth:`Cluster.link_between`), with ranks laid out node-major (rank ``g``
lives on node ``g // gpus_per_node``), which is what torchrun and SLURM produce by default.

Units: bandwidths are GB/s (1e9 bytes/s) **per GPU and per direction** (what one GPU can push while
all its peers push too), latencies are microseconds, compute is dense bf16 TFLOP/s (1e12 FLOP/s).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .rates import Calibration

__all__ = ["LinkSpec", "Accelerator", "Cluster", "ClusterError", "PRESETS"]

# Share of device memory the planners fill: the rest is left for what they do not model (the CUDA context,
# NCCL buffers, allocator fragmentation; docs/memory.md).
MEMORY_BUDGET_FRACTION = 0.9

LinkKind = Literal["nvlink", "pcie", "upi", "infiniband", "roce", "ethernet", "loopback"]


class ClusterError(ValueError):
    """A cluster description that cannot be used (bad preset name, unreadable file, ...)."""


class _Strict(BaseModel):
    # extra="forbid": a typo in a YAML file ("bandwith_gb_s") must fail loudly, not be ignored; no figure
    # of a cluster is infinite or NaN (the ranges are each field's constraints)
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)


class LinkSpec(_Strict):
    """One kind of link as seen by one GPU: sustained bandwidth per direction and per-message latency."""

    kind: LinkKind = Field(description="physical link family, informational and used by discovery")
    bandwidth_gb_s: float = Field(gt=0, description="GB/s per GPU per direction, all GPUs sending at once")
    latency_us: float = Field(default=5.0, ge=0, description="fixed cost of one collective/P2P message, µs")
    contention: float = Field(
        default=1.0,
        ge=1.0,
        description="slowdown when every group exchanges at once vs one group alone (1 = none; measured by calibrate)",
    )

    @field_validator("bandwidth_gb_s")
    @classmethod
    def _bw(cls, v: float) -> float:
        if v > 10_000:
            raise ValueError(
                f"bandwidth_gb_s={v} GB/s is above any real link (NVLink 5 is 900 GB/s per direction); "
                "the unit is gigabytes per second, not gigabits: divide Gb/s by 8"
            )
        return v

    def transfer_s(self, nbytes: float) -> float:
        """Time to move ``nbytes`` one way over this link, latency included (0 bytes cost nothing)."""
        if nbytes <= 0:
            return 0.0
        return self.latency_us * 1e-6 + nbytes / (self.bandwidth_gb_s * 1e9)


class Accelerator(_Strict):
    """Compute side of one GPU (or CPU process): peak and the fraction real kernels reach."""

    name: str
    peak_tflops: float = Field(gt=0, description="dense (non-sparse) bf16 tensor peak, TFLOP/s")
    attention_efficiency: float = Field(
        default=0.55, description="fraction of peak a flash-attention fwd+bwd reaches at long sequence"
    )
    dense_efficiency: float = Field(default=0.6, description="fraction of peak the rest of the layer (GEMMs) reaches")
    memory_gb: float = Field(gt=0, description="device memory, GB (1e9 bytes)")
    ring_step_overhead_us: float = Field(
        default=30.0, ge=0, description="fixed cost of one ring step (kernel launches, block slicing), µs"
    )
    hbm_gb_s: float = Field(
        default=2000.0, gt=0, description="device memory bandwidth, GB/s: prices the ring's per-step softmax merge"
    )
    kernel_call_overhead_us: float = Field(
        default=0.0,
        ge=0,
        description="fixed cost of one attention kernel call: makes the smaller blocks of many ring steps less efficient",
    )
    ring_overlap: float = Field(
        default=1.0, ge=0, le=1, description="fraction of a ring transfer that the step's compute can hide (1 = ideal)"
    )

    @field_validator("attention_efficiency", "dense_efficiency")
    @classmethod
    def _eff(cls, v: float, info: Any) -> float:
        if not 0 < v <= 1:
            raise ValueError(
                f"{info.field_name}={v!r} must be a fraction in (0, 1] of peak_tflops "
                "(e.g. 0.55 for 55%); pass achieved TFLOP/s as a fraction, not a percentage"
            )
        return v

    @property
    def attention_flops(self) -> float:
        """Achievable attention FLOP/s."""
        return self.peak_tflops * 1e12 * self.attention_efficiency

    @property
    def dense_flops(self) -> float:
        """Achievable FLOP/s for the layer's GEMMs."""
        return self.peak_tflops * 1e12 * self.dense_efficiency

    @property
    def memory_budget(self) -> float:
        """Bytes per device the planners plan with by default: MEMORY_BUDGET_FRACTION of ``memory_gb``."""
        return MEMORY_BUDGET_FRACTION * self.memory_gb * 1e9


# Tiers of the link hierarchy, cheapest first. A pair of ranks is joined by the tier of the smallest
# group that holds both.
TIER_SOCKET, TIER_NODE, TIER_DOMAIN, TIER_FABRIC = 0, 1, 2, 3


class Cluster(_Strict):
    """Nodes of identical GPUs, the links between them and the NVLink domain they form.

    ``nvlink_domain_gpus`` is the number of GPUs that share one NVLink/NVSwitch fabric: equal to
    ``gpus_per_node`` for a DGX (the default when the intra-node link is NVLink), 72 for a GB200 NVL72
    rack. Inside a domain every pair of GPUs talks over ``intra_node``; across domains over
    ``inter_node``. ``socket_gpus``/``cross_socket`` describe PCIe boxes whose GPUs hang off two CPU
    root complexes: traffic between the halves crosses UPI/QPI and is much slower.
    """

    name: str = "custom"
    nodes: int = Field(ge=1, description="number of nodes (hosts)")
    gpus_per_node: int = Field(ge=1, description="GPUs (or CPU ranks) per node")
    accelerator: Accelerator
    intra_node: LinkSpec
    inter_node: LinkSpec | None = Field(default=None, description="per-GPU NIC share; needed when ranks span domains")
    nvlink_domain_gpus: int | None = Field(default=None, ge=1)
    socket_gpus: int | None = Field(default=None, ge=1, description="GPUs behind one CPU root complex")
    cross_socket: LinkSpec | None = None
    backend: Literal["nccl", "gloo"] = "nccl"
    host_memory_gb: float | None = Field(
        default=None, gt=0, description="host RAM per node, GB (1e9 bytes): bounds offloaded checkpoints"
    )
    sources: list[str] = Field(default_factory=list, description="where the figures come from")
    calibration: Calibration | None = Field(
        default=None, description="rates measured by `hybrid-cp calibrate`; the cost model prefers them when set"
    )

    @model_validator(mode="after")
    def _consistent(self) -> "Cluster":
        g = self.gpus_per_node
        if self.nvlink_domain_gpus is not None:
            d = self.nvlink_domain_gpus
            if self.intra_node.kind != "nvlink" and d != g:
                raise ValueError(
                    f"nvlink_domain_gpus={d} but intra_node.kind={self.intra_node.kind!r}: only an NVLink "
                    f"fabric spans nodes; use intra_node.kind='nvlink' or drop nvlink_domain_gpus"
                )
            if d % g:
                raise ValueError(
                    f"nvlink_domain_gpus={d} must be a multiple of gpus_per_node={g} (a domain is made of "
                    f"whole nodes); use {g} for one node per domain or e.g. {g * max(1, round(d / g))}"
                )
            if self.world_size > d and self.world_size % d:
                raise ValueError(
                    f"{self.nodes} nodes x {g} GPUs = {self.world_size} GPUs do not fill whole NVLink domains of "
                    f"{d}; use a node count that is a multiple of {d // g} or at most {d // g}"
                )
        if self.socket_gpus is not None:
            s = self.socket_gpus
            if g % s:
                raise ValueError(f"socket_gpus={s} must divide gpus_per_node={g}")
            if s < g and self.cross_socket is None:
                raise ValueError(
                    f"socket_gpus={s} < gpus_per_node={g} splits each node in two, so cross_socket "
                    "(the link between the halves, e.g. UPI) is required"
                )
        elif self.cross_socket is not None:
            raise ValueError("cross_socket is set but socket_gpus is not: say how many GPUs share one socket")
        if self.world_size > self.domain_size and self.inter_node is None:
            raise ValueError(
                f"nodes={self.nodes} spans {self.world_size // self.domain_size} NVLink domains/nodes, so "
                "inter_node (the per-GPU NIC: bandwidth_gb_s, latency_us) is required"
            )
        return self

    # ------------------------------------------------------------------ geometry
    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def domain_size(self) -> int:
        """GPUs reachable over the fast (intra-node/NVLink) link from any GPU."""
        return self.nvlink_domain_gpus or self.gpus_per_node

    @property
    def _socket(self) -> int:
        return self.socket_gpus or self.gpus_per_node

    def tier(self, a: int, b: int) -> int:
        """Link tier joining global ranks ``a`` and ``b`` (ranks placed node-major)."""
        if a // self._socket == b // self._socket:
            return TIER_SOCKET
        if a // self.gpus_per_node == b // self.gpus_per_node:
            return TIER_NODE
        if a // self.domain_size == b // self.domain_size:
            return TIER_DOMAIN
        return TIER_FABRIC

    def tier_link(self, tier: int) -> LinkSpec:
        """The link used at ``tier`` (see :meth:`tier`)."""
        if tier == TIER_SOCKET or tier == TIER_DOMAIN:
            return self.intra_node
        if tier == TIER_NODE:
            return self.cross_socket or self.intra_node
        if self.inter_node is None:
            raise ClusterError(f"cluster {self.name!r} has no inter_node link but ranks span domains")
        return self.inter_node

    def tier_name(self, tier: int) -> str:
        """Human name of a tier for tables ("none" for a group of one rank)."""
        split = self.cross_socket is not None
        return {
            TIER_SOCKET: "intra-socket" if split else "intra-node",
            TIER_NODE: "cross-socket" if split else "intra-node",
            TIER_DOMAIN: "nvlink-domain",
            TIER_FABRIC: "inter-node",
        }.get(tier, "none")

    def link_between(self, a: int, b: int) -> LinkSpec:
        """The link a message from global rank ``a`` to ``b`` travels over."""
        return self.tier_link(self.tier(a, b))

    @property
    def host_memory_per_gpu(self) -> float | None:
        """Bytes of host RAM per GPU (``host_memory_gb`` shared by the node's GPUs), None when unknown."""
        return None if self.host_memory_gb is None else self.host_memory_gb * 1e9 / self.gpus_per_node

    # ------------------------------------------------------------------ presets
    @classmethod
    def preset(cls, name: str, /, nodes: int = 1, **overrides: Any) -> "Cluster":
        """A named, sourced cluster description (see ``Cluster.preset_names()`` and docs/planner.md).

        ``nodes`` is the number of hosts (for ``gb200-nvl72``: compute trays of 4 GPUs, 18 per rack).
        ``overrides`` replace top-level fields, e.g. ``gpus_per_node=4`` for the CPU preset.
        """
        key = name.lower().replace("_", "-")
        key = _ALIASES.get(key, key)
        if key not in PRESETS:
            raise ClusterError(f"unknown preset {name!r}; choose one of {', '.join(cls.preset_names())}")
        data = json.loads(json.dumps(PRESETS[key]))  # deep copy
        data.update(overrides)
        data["nodes"] = nodes
        return cls.model_validate(data)

    @staticmethod
    def preset_names() -> list[str]:
        return sorted(PRESETS)

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_none=True)

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2) + "\n"
        if path is not None:
            Path(path).write_text(text)
        return text

    def to_yaml(self, path: str | Path | None = None) -> str:
        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, origin: str = "cluster description") -> "Cluster":
        if not isinstance(data, dict):
            raise ClusterError(f"{origin}: expected a mapping of cluster fields, got {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:  # re-raise with the origin so the user knows which file is wrong
            raise ClusterError(f"{origin} is not a valid cluster:\n{exc}") from exc

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> "Cluster":
        text, origin = _read(text_or_path)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ClusterError(f"{origin}: not valid JSON ({exc})") from exc
        return cls.from_dict(data, origin=origin)

    @classmethod
    def from_yaml(cls, text_or_path: str | Path) -> "Cluster":
        text, origin = _read(text_or_path)
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ClusterError(f"{origin}: not valid YAML ({exc})") from exc
        return cls.from_dict(data, origin=origin)

    def save(self, path: str | Path) -> Path:
        """Write to ``path``; ``.json`` gives JSON, anything else YAML."""
        p = Path(path)
        (self.to_json if p.suffix.lower() == ".json" else self.to_yaml)(p)
        return p

    @classmethod
    def load(cls, path: str | Path) -> "Cluster":
        """Read a file written by :meth:`save` (JSON by ``.json`` suffix, else YAML)."""
        p = Path(path)
        if not p.is_file():
            raise ClusterError(f"cluster file {str(p)!r} does not exist")
        return cls.from_json(p) if p.suffix.lower() == ".json" else cls.from_yaml(p)

    def describe(self) -> str:
        """One line for logs and the CLI header."""
        parts = [
            f"{self.name}: {self.nodes} node(s) x {self.gpus_per_node} {self.accelerator.name}",
            f"intra {self.intra_node.kind} {self.intra_node.bandwidth_gb_s:g} GB/s",
        ]
        if self.domain_size > self.gpus_per_node:
            parts.append(f"NVLink domain {self.domain_size}")
        if self.cross_socket is not None:
            parts.append(f"cross-socket {self.cross_socket.kind} {self.cross_socket.bandwidth_gb_s:g} GB/s")
        if self.inter_node is not None:
            parts.append(f"inter {self.inter_node.kind} {self.inter_node.bandwidth_gb_s:g} GB/s")
        if self.calibration is not None:
            c = self.calibration
            parts.append(f"calibrated on {c.world} {c.backend} ranks ({c.device}, kernel {c.kernel} {c.dtype})")
        return ", ".join(parts)


def _read(text_or_path: str | Path) -> tuple[str, str]:
    """Accept either a path to a file or the text itself."""
    if isinstance(text_or_path, Path) or ("\n" not in str(text_or_path) and Path(str(text_or_path)).is_file()):
        p = Path(text_or_path)
        if not p.is_file():
            raise ClusterError(f"cluster file {str(p)!r} does not exist")
        return p.read_text(), str(p)
    return str(text_or_path), "cluster text"


# ---------------------------------------------------------------------------------------------------
# Presets. Every figure is from a vendor datasheet or a cited measurement; docs/planner.md has the
# table with links. Bandwidths are per GPU per direction (NVIDIA quotes NVLink as bidirectional:
# "900 GB/s" for H100 = 450 GB/s each way).

_A100 = {
    "name": "A100-SXM4-80GB",
    "peak_tflops": 312.0,  # NVIDIA A100 datasheet: BF16 tensor 312 TFLOPS dense (624 with sparsity)
    "attention_efficiency": 0.55,  # FlashAttention-2 paper: fwd+bwd up to ~60% of A100 peak
    "dense_efficiency": 0.6,
    "memory_gb": 80.0,
    "ring_step_overhead_us": 30.0,
    "hbm_gb_s": 2039.0,  # A100 80GB SXM datasheet: 2,039 GB/s HBM2e
}
_H100 = {
    "name": "H100-SXM5-80GB",
    "peak_tflops": 989.0,  # NVIDIA H100 datasheet: BF16 tensor 1,979 TFLOPS with sparsity -> 989 dense
    "attention_efficiency": 0.5,  # FlashAttention-3 paper: fwd up to ~75%, bwd lower; fwd+bwd ~50%
    "dense_efficiency": 0.6,
    "memory_gb": 80.0,
    "ring_step_overhead_us": 30.0,  # calibrated on ring-flash-attn's 8xH800 zigzag fwd (see docs)
    "hbm_gb_s": 3350.0,  # H100 SXM datasheet: 3.35 TB/s HBM3
}
_IB_HDR = {"kind": "infiniband", "bandwidth_gb_s": 25.0, "latency_us": 8.0}  # 200 Gb/s HDR per GPU
_IB_NDR = {"kind": "infiniband", "bandwidth_gb_s": 50.0, "latency_us": 8.0}  # 400 Gb/s NDR per GPU

PRESETS: dict[str, dict[str, Any]] = {
    "dgx-a100": {
        "name": "dgx-a100",
        "gpus_per_node": 8,
        "accelerator": _A100,
        # NVLink 3 via NVSwitch: 600 GB/s bidirectional per GPU -> 300 GB/s per direction.
        "intra_node": {"kind": "nvlink", "bandwidth_gb_s": 300.0, "latency_us": 3.0},
        "inter_node": _IB_HDR,  # DGX A100: 8x ConnectX-6 200 Gb/s HDR InfiniBand (one per GPU)
        "sources": [
            "NVIDIA A100 Tensor Core GPU datasheet (BF16 312 TFLOPS dense, NVLink 600 GB/s)",
            "NVIDIA DGX A100 datasheet (8x 200 Gb/s HDR InfiniBand for compute)",
        ],
    },
    "dgx-h100": {
        "name": "dgx-h100",
        "gpus_per_node": 8,
        "accelerator": _H100,
        # NVLink 4 via NVSwitch: 900 GB/s bidirectional per GPU -> 450 GB/s per direction.
        "intra_node": {"kind": "nvlink", "bandwidth_gb_s": 450.0, "latency_us": 3.0},
        "inter_node": _IB_NDR,  # DGX H100: 8x ConnectX-7 400 Gb/s NDR (one per GPU)
        "host_memory_gb": 2048.0,
        "sources": [
            "NVIDIA H100 Tensor Core GPU datasheet (SXM5 BF16 1,979 TFLOPS sparse = 989 dense, NVLink 900 GB/s)",
            "NVIDIA DGX H100 datasheet (8x ConnectX-7 400 Gb/s, 2 TB system memory)",
        ],
    },
    "dgx-h200": {
        "name": "dgx-h200",
        "gpus_per_node": 8,
        "accelerator": {**_H100, "name": "H200-SXM-141GB", "memory_gb": 141.0, "hbm_gb_s": 4800.0},
        "intra_node": {"kind": "nvlink", "bandwidth_gb_s": 450.0, "latency_us": 3.0},
        "inter_node": _IB_NDR,
        "host_memory_gb": 2048.0,
        "sources": [
            "NVIDIA H200 datasheet (SXM BF16 1,979 TFLOPS sparse = 989 dense, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s)",
            "NVIDIA DGX H200 datasheet (8x ConnectX-7 400 Gb/s, 2 TB system memory)",
        ],
    },
    "gb200-nvl72": {
        "name": "gb200-nvl72",
        "gpus_per_node": 4,  # one compute tray = 2 Grace CPUs + 4 Blackwell GPUs; 18 trays per rack
        "nvlink_domain_gpus": 72,
        "accelerator": {
            "name": "B200 (GB200)",
            "peak_tflops": 2500.0,  # GB200 NVL72: FP16/BF16 360 PFLOPS (sparse) / 72 GPUs / 2 = 2.5 PF dense
            "attention_efficiency": 0.5,
            "dense_efficiency": 0.6,
            "memory_gb": 186.0,  # 13.4 TB HBM3e per rack / 72
            "ring_step_overhead_us": 30.0,
            "hbm_gb_s": 8000.0,  # 576 TB/s per rack / 72
        },
        # NVLink 5: 1.8 TB/s bidirectional per GPU -> 900 GB/s per direction, across the whole rack.
        "intra_node": {"kind": "nvlink", "bandwidth_gb_s": 900.0, "latency_us": 4.0},
        "inter_node": {"kind": "infiniband", "bandwidth_gb_s": 50.0, "latency_us": 8.0},  # ConnectX-7 400 Gb/s per GPU
        "sources": [
            "NVIDIA GB200 NVL72 datasheet (72 GPUs, FP16/BF16 360 PFLOPS sparse, NVLink 130 TB/s = 1.8 TB/s per GPU, 13.4 TB HBM3e at 576 TB/s)",
            "NVIDIA GB200 NVL72 reference: 400 Gb/s ConnectX-7 per GPU for the scale-out fabric",
        ],
    },
    "pcie-8gpu": {
        "name": "pcie-8gpu",
        "gpus_per_node": 8,
        "socket_gpus": 4,  # two CPU sockets, 4 GPUs behind each PCIe switch
        "accelerator": {
            "name": "L20-48GB",
            "peak_tflops": 119.5,  # NVIDIA L20 spec sheet: FP16/BF16 tensor 119.5 TFLOPS
            "attention_efficiency": 0.5,
            "dense_efficiency": 0.6,
            "memory_gb": 48.0,
            "ring_step_overhead_us": 30.0,
            "hbm_gb_s": 864.0,  # L20: 864 GB/s GDDR6
        },
        # PCIe Gen4 x16: 32 GB/s per direction raw, ~25 GB/s achieved GPU-to-GPU through a switch.
        "intra_node": {"kind": "pcie", "bandwidth_gb_s": 25.0, "latency_us": 5.0},
        # Cross-socket P2P goes through host UPI/QPI: ~20 GB/s shared by the 4 GPUs of a socket.
        "cross_socket": {"kind": "upi", "bandwidth_gb_s": 5.0, "latency_us": 10.0},
        "inter_node": {"kind": "roce", "bandwidth_gb_s": 12.5, "latency_us": 10.0},  # 100 Gb/s per GPU
        "sources": [
            "NVIDIA L20 product brief (FP16/BF16 tensor 119.5 TFLOPS, 48 GB, PCIe Gen4 x16 64 GB/s bidirectional)",
            "yunchang/USP issue #73: 8xL20 box is a 2x4 grid (PCIe switch + QPI); cross-socket figure is an estimate",
        ],
    },
    "cpu": {
        "name": "cpu",
        "gpus_per_node": 2,
        "backend": "gloo",
        "accelerator": {
            "name": "cpu",
            "peak_tflops": 1.0,  # order of magnitude for a few AVX-512 cores; only relative results matter
            "attention_efficiency": 0.3,
            "dense_efficiency": 0.5,
            "memory_gb": 16.0,
            "ring_step_overhead_us": 200.0,
            "hbm_gb_s": 50.0,  # DRAM stream bandwidth of a few cores
        },
        "intra_node": {"kind": "loopback", "bandwidth_gb_s": 2.0, "latency_us": 50.0},  # gloo over TCP loopback
        "inter_node": {"kind": "ethernet", "bandwidth_gb_s": 1.25, "latency_us": 100.0},  # 10 GbE
        "sources": ["rough figures for gloo on localhost; use for tests and dry runs, not for decisions"],
    },
}

_ALIASES = {
    "a100": "dgx-a100",
    "h100": "dgx-h100",
    "h200": "dgx-h200",
    "nvl72": "gb200-nvl72",
    "gb200": "gb200-nvl72",
    "l20": "pcie-8gpu",
    "l20-8gpu": "pcie-8gpu",
    "pcie": "pcie-8gpu",
    "gloo": "cpu",
    "localhost": "cpu",
}
