"""Cluster profiles: the links and shape the planner, the projection and ``algorithm="auto"`` read.

A :class:`Profile` is either measured (``python -m hiersync calibrate`` writes one as JSON)
or one of the :data:`PRESETS` built from published numbers (docs/costmodel.md lists the
sources). :func:`preset_for_backend` names the preset that stands in for an uncalibrated
cluster. Pure: no torch.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .hierarchy import check_topology, intra_algorithm_for_backend
from .links import DEFAULT_TREE_EFFICIENCY, Link, check_count, check_efficiency, check_number
from .nccl import GPU_GENERATIONS, HOST_CPUS, INTRA_LINKS

__all__ = ["PROFILE_FORMAT", "Profile", "PRESETS", "get_preset", "preset_for_backend", "default_copy_gbps"]

logger = logging.getLogger(__name__)

PROFILE_FORMAT = "hiersync.profile/1"


@dataclass(frozen=True, kw_only=True)
class Profile:
    """Links and shape of a cluster: what the planner, the projection and ``algorithm="auto"`` read.

    ``python -m hiersync calibrate`` measures one; :data:`PRESETS` holds published ones.
    """

    intra: Link
    """Link between two ranks of one node (per GPU)."""
    inter: Link
    """Link of one NIC between nodes."""
    nodes: int
    """Number of nodes (N)."""
    ranks_per_node: int
    """Ranks per node (L)."""
    rails: int | None = None
    """NICs per node; None means one per rank."""
    backend: str = "nccl"
    """torch.distributed backend; ``"nccl"`` lets NCCL pick ring or tree, others use rings."""
    tree_efficiency: float = DEFAULT_TREE_EFFICIENCY
    """Fraction of line rate a pipelined tree reaches (eta)."""
    name: str = ""
    """Short name (the preset's key, or e.g. the cluster's)."""
    source: str = ""
    """Where the numbers come from (publication, or the calibration command)."""
    intra_reduce_scatter: Link | None = None
    """Measured effective link of the node's reduce-scatter, where it costs more than
    :attr:`intra` predicts; None: :attr:`intra`. torch's gloo backend, for one, runs
    reduce-scatter as an all-reduce of a fresh copy of the whole input plus a copy out
    (``ProcessGroupGloo::reduce_scatter_tensor_coalesced``), about 2-3x the ring's cost.
    ``python -m hiersync calibrate`` measures it."""
    intra_all_gather: Link | None = None
    """Measured effective link of the node's all-gather (gloo adds a flatten and a copy
    out through freshly allocated memory); None: :attr:`intra`."""
    intra_broadcast: Link | None = None
    """Measured effective link of one of the L shard broadcasts of the ``"allreduce_bcast"``
    gather (fitted as L broadcasts of n/L in a row, as ``HierComm`` issues them); None:
    :attr:`intra`, whose beta (fitted on all-reduces) also holds the reduction's cost."""
    copy_gbps: float | None = None
    """GB/s (1e9 bytes per second) at which a device copies memory: the speed of a sync's
    launch copies (snapshot, payload). None: unknown; the planner then assumes
    :func:`default_copy_gbps` of :attr:`backend` and says so."""
    nvls_gbps: float | None = None
    """NVLS (NVLink SHARP) all-reduce bus bandwidth of one node in GB/s (~480 on 8 x H100),
    where NVSwitches reduce in the fabric; None: no NVLS (rings and trees only). Read under
    NCCL only; :attr:`intra` stays the ring's (NVLS's figure is for all-reduce alone)."""
    gpu: str = "hopper"
    """GPU generation, ``"volta"``, ``"ampere"``, ``"hopper"`` or ``"blackwell"``: NCCL's
    per-channel bandwidth caps (:mod:`.nccl`)."""
    intra_link: str = "nvlink"
    """``"nvlink"`` or ``"pci"``: the class of the node's GPU links, which sets NCCL's hop
    latencies (and LL128, which needs NVLink)."""
    net_latency_us: float = 0.0
    """The fabric: microseconds it adds to each inter-node step on top of NCCL's network hop
    latencies (twice with the Simple protocol). 0 for NCCL's own InfiniBand and RoCE
    transport; measured by ``python -m hiersync calibrate`` on fabrics behind a network
    plugin (about 20 on AWS p5's EFA, 70 on p4d's; docs/costmodel-validation.md)."""
    tuner_net_latency_us: float | None = None
    """Microseconds the network plugin *reports* to NCCL's tuner, which chooses by it (75 for
    aws-ofi-nccl on p4d and p5, its platform table); None: :attr:`net_latency_us`."""
    host_cpu: str = "intel"
    """The nodes' CPU vendor, ``"intel"``, ``"amd"`` or ``"arm"``: NCCL's LL bandwidth cap across
    nodes and its network post overhead (1 us per message, 2 on AMD) depend on it (:mod:`.nccl`)."""
    channels: int = 16
    """NCCL's ring/tree channels; only its per-channel bandwidth caps read it."""
    leaf_nodes: int = 0
    """Nodes one leaf switch connects (per rail on a rail-optimised fabric); a job on more spans
    switch tiers (:func:`~.nccl.switch_tiers`). 0: one flat network, no tiers."""
    tier_efficiency: float = 1.0
    """Fraction of the network bandwidth kept per switch tier a job spans above its leaf (flows
    hashed onto shared uplinks collide). 1: no loss, as InfiniBand's adaptive routing gives;
    about 0.85 on AWS p5's EFA (docs/costmodel-validation.md)."""
    quant_gbps: float | None = None
    """GB/s of fp32 input one quantize or dequantize pass of ``compress="int8"/"int4"`` processes;
    None: :data:`~.compression.DEFAULT_QUANT_GBPS` (a conservative GPU rate, not measured)."""
    forward_s: float | None = None
    """Forward (+ optimizer) compute time per step of the model to plan, where measured; None: unknown."""
    backward_s: float | None = None
    """Backward compute time per step of the model to plan, where measured; None: unknown."""
    metadata: dict[str, Any] = field(default_factory=dict, hash=False)
    """Free-form JSON-able details (fit quality, hostnames, versions). ``calibrated_nodes``
    (int) states how many nodes the links were measured on (:attr:`calibrated_nodes`)."""

    def __post_init__(self) -> None:
        for name in ("intra", "inter"):
            if not isinstance(getattr(self, name), Link):
                raise TypeError(f"Profile.{name} must be a Link, got {type(getattr(self, name)).__name__}")
        for name in ("intra_reduce_scatter", "intra_all_gather", "intra_broadcast"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), Link):
                raise TypeError(f"Profile.{name} must be a Link or None, got {type(getattr(self, name)).__name__}")
        check_topology(self.nodes, self.ranks_per_node, self.rails)
        check_efficiency(self.tree_efficiency)
        for name in ("copy_gbps", "forward_s", "backward_s", "quant_gbps"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
                raise ValueError(f"Profile.{name} must be a number > 0 or None (unknown), got {value!r}")
        if self.nvls_gbps is not None and (isinstance(self.nvls_gbps, bool) or not self.nvls_gbps > 0):
            raise ValueError(f"Profile.nvls_gbps must be a number > 0 or None (no NVLS), got {self.nvls_gbps!r}")
        if self.gpu not in GPU_GENERATIONS:
            raise ValueError(f"Profile.gpu must be one of {', '.join(GPU_GENERATIONS)}, got {self.gpu!r}")
        if self.intra_link not in INTRA_LINKS:
            raise ValueError(f"Profile.intra_link must be one of {', '.join(INTRA_LINKS)}, got {self.intra_link!r}")
        check_number("Profile.net_latency_us", self.net_latency_us)
        if self.tuner_net_latency_us is not None:
            check_number("Profile.tuner_net_latency_us", self.tuner_net_latency_us)
        if self.host_cpu not in HOST_CPUS:
            raise ValueError(f"Profile.host_cpu must be one of {', '.join(HOST_CPUS)}, got {self.host_cpu!r}")
        check_count("Profile.channels", self.channels)
        if (
            isinstance(self.leaf_nodes, bool)
            or not isinstance(self.leaf_nodes, int)
            or self.leaf_nodes == 1
            or self.leaf_nodes < 0
        ):
            raise ValueError(f"Profile.leaf_nodes must be 0 (one flat network) or an int >= 2, got {self.leaf_nodes!r}")
        if isinstance(self.tier_efficiency, bool) or not 0 < self.tier_efficiency <= 1:
            raise ValueError(f"Profile.tier_efficiency must be in (0, 1] (1: no loss), got {self.tier_efficiency!r}")
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError(f"Profile.backend must be a backend name such as 'nccl' or 'gloo', got {self.backend!r}")

    def with_shape(self, *, nodes: int | None = None, ranks_per_node: int | None = None) -> Profile:
        """This profile's links on another cluster shape (None: keep the profile's)."""
        return replace(
            self,
            nodes=self.nodes if nodes is None else nodes,
            ranks_per_node=self.ranks_per_node if ranks_per_node is None else ranks_per_node,
        )

    @property
    def flat_algorithm(self) -> str:
        """``"auto"`` under NCCL (its tuner picks ring or tree), ``"ring"`` otherwise (gloo)."""
        return "auto" if "nccl" in self.backend.lower() else "ring"

    @property
    def intra_algorithm(self) -> str:
        """HierComm's intra algorithm on :attr:`backend`: ``"allreduce_bcast"`` on gloo, else ``"rs_ag"``."""
        return intra_algorithm_for_backend(self.backend)

    @property
    def calibrated_nodes(self) -> int | None:
        """Nodes the links were measured on: ``metadata["calibrated_nodes"]`` where stated,
        else :attr:`nodes` for a profile that ``python -m hiersync calibrate`` wrote (its
        metadata holds the ``"fits"``), else None (a preset or a hand-written profile)."""
        stated = self.metadata.get("calibrated_nodes")
        if isinstance(stated, int) and not isinstance(stated, bool) and stated >= 1:
            return stated
        return self.nodes if "fits" in self.metadata else None

    def to_json(self) -> dict[str, Any]:
        return {
            "format": PROFILE_FORMAT,
            "name": self.name,
            "backend": self.backend,
            "nodes": self.nodes,
            "ranks_per_node": self.ranks_per_node,
            "rails": self.rails,
            "tree_efficiency": self.tree_efficiency,
            "intra": self.intra.to_json(),
            "inter": self.inter.to_json(),
            "intra_reduce_scatter": None if self.intra_reduce_scatter is None else self.intra_reduce_scatter.to_json(),
            "intra_all_gather": None if self.intra_all_gather is None else self.intra_all_gather.to_json(),
            "intra_broadcast": None if self.intra_broadcast is None else self.intra_broadcast.to_json(),
            "nvls_gbps": self.nvls_gbps,
            "gpu": self.gpu,
            "intra_link": self.intra_link,
            "net_latency_us": self.net_latency_us,
            "tuner_net_latency_us": self.tuner_net_latency_us,
            "host_cpu": self.host_cpu,
            "channels": self.channels,
            "leaf_nodes": self.leaf_nodes,
            "tier_efficiency": self.tier_efficiency,
            "quant_gbps": self.quant_gbps,
            "copy_gbps": self.copy_gbps,
            "forward_s": self.forward_s,
            "backward_s": self.backward_s,
            "source": self.source,
            "metadata": dict(self.metadata),
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any] | str) -> Profile:
        """Build a profile from :meth:`to_json`'s dict or its JSON text."""
        if isinstance(obj, str):
            obj = json.loads(obj)
        if not isinstance(obj, Mapping):
            raise TypeError(f"a profile is a JSON object, got {type(obj).__name__}")
        fmt = obj.get("format", PROFILE_FORMAT)
        if fmt != PROFILE_FORMAT:
            raise ValueError(f"unsupported profile format {fmt!r}; this version reads {PROFILE_FORMAT!r}")
        missing = [k for k in ("intra", "inter", "nodes", "ranks_per_node") if k not in obj]
        if missing:
            raise ValueError(f"profile lacks {missing}; write it with Profile.save or `python -m hiersync calibrate`")
        return cls(
            intra=Link.from_json(obj["intra"]),
            inter=Link.from_json(obj["inter"]),
            nodes=obj["nodes"],
            ranks_per_node=obj["ranks_per_node"],
            rails=obj.get("rails"),
            backend=obj.get("backend", "nccl"),
            tree_efficiency=obj.get("tree_efficiency", DEFAULT_TREE_EFFICIENCY),
            intra_reduce_scatter=optional_link(obj.get("intra_reduce_scatter")),
            intra_all_gather=optional_link(obj.get("intra_all_gather")),
            intra_broadcast=optional_link(obj.get("intra_broadcast")),
            nvls_gbps=obj.get("nvls_gbps"),
            gpu=obj.get("gpu", "hopper"),
            intra_link=obj.get("intra_link", "nvlink"),
            net_latency_us=obj.get("net_latency_us", 0.0),
            tuner_net_latency_us=obj.get("tuner_net_latency_us"),
            host_cpu=obj.get("host_cpu", "intel"),
            channels=obj.get("channels", 16),
            leaf_nodes=obj.get("leaf_nodes", 0),
            tier_efficiency=obj.get("tier_efficiency", 1.0),
            quant_gbps=obj.get("quant_gbps"),
            copy_gbps=obj.get("copy_gbps"),
            forward_s=obj.get("forward_s"),
            backward_s=obj.get("backward_s"),
            name=obj.get("name", ""),
            source=obj.get("source", ""),
            metadata=dict(obj.get("metadata") or {}),
        )

    @classmethod
    def load(cls, path: str | os.PathLike) -> Profile:
        return cls.from_json(Path(path).read_text(encoding="utf-8"))

    def save(self, path: str | os.PathLike) -> Path:
        """Write the profile as JSON atomically (a reader never sees half a file)."""
        from hiersync._io import atomic_write_json

        return atomic_write_json(path, self.to_json())


def optional_link(obj: Mapping[str, Any] | None) -> Link | None:
    """:meth:`Link.from_json` of ``obj``, or None for None."""
    return None if obj is None else Link.from_json(obj)


_NCCL_SRC = "hop latencies and protocol limits: NCCL's tuner (src/graph/tuning.cc)"
# 8x H100 SXM: ring all-reduce busbw ~370 GB/s inside the node (also reduce-scatter and
# all-gather), NVLS all-reduce ~480 GB/s (NVIDIA/nccl-tests#212, maintainer's figures);
# 8x ConnectX-7 NDR 400 Gb/s, 46-48 GB/s achieved each (line rate 50 GB/s).
_H100_8RAIL = Profile(
    intra=Link.from_bandwidth(3.4e-6, 370e9),
    inter=Link.from_bandwidth(14e-6, 47e9),
    nodes=128,
    ranks_per_node=8,
    rails=8,
    backend="nccl",
    nvls_gbps=480.0,
    gpu="hopper",
    copy_gbps=1500.0,
    name="h100-8rail",
    source=(
        f"8xH100 ring busbw ~370 GB/s, NVLS all-reduce ~480 (nccl-tests#212); 8x NDR 400 Gb/s at 47 GB/s; "
        f"InfiniBand (no plugin latency); {_NCCL_SRC}; "
        "copies at 1500 GB/s assumed (half of 3.35 TB/s HBM3: a copy reads and writes)"
    ),
)

PRESETS: dict[str, Profile] = {
    "h100-8rail": _H100_8RAIL,
    # AWS p5.48xlarge: the 8x H100 node of h100-8rail behind 32x 100 Gb/s EFA, which aws-ofi-nccl
    # presents to NCCL as one 400 Gb/s device per GPU (47 GB/s, the 0.94 of line rate NDR reaches),
    # AMD EPYC hosts, aws-ofi-nccl reporting 75 us to NCCL's
    # tuner; the fabric's step latency (29 us) and switch tiers (0.85 of the bandwidth per tier
    # above 4-node leaves) fitted on the published p5 all-reduces, 2-32 nodes
    # (docs/costmodel-validation.md; AWS publishes neither).
    "p5-efa": replace(
        _H100_8RAIL,
        nodes=16,
        net_latency_us=29.0,
        tuner_net_latency_us=75.0,
        host_cpu="amd",
        leaf_nodes=4,
        tier_efficiency=0.85,
        name="p5-efa",
        source=(
            "AWS p5.48xlarge: 8xH100 as h100-8rail; 32x 100 Gb/s EFA, 4 per GPU as one 400 Gb/s device at 47 GB/s; "
            "aws-ofi-nccl reports 75 us "
            "(its platform table); fitted on published p5 all-reduces (docs/costmodel-validation.md): fabric "
            f"latency 29 us per step, 0.85 of the bandwidth per switch tier above 4-node leaves; {_NCCL_SRC}"
        ),
    ),
    # 8x A100 SXM: NCCL caps Ampere busbw at 235 GB/s (no NVLS); one 100 Gb/s NIC (12.5 GB/s line).
    "a100-1nic": Profile(
        intra=Link.from_bandwidth(3.4e-6, 235e9),
        inter=Link.from_bandwidth(14e-6, 11.5e9),
        nodes=16,
        ranks_per_node=8,
        rails=1,
        backend="nccl",
        gpu="ampere",
        copy_gbps=1000.0,
        name="a100-1nic",
        source=(
            f"8xA100 NVLink 235 GB/s busbw (NCCL's Ampere cap); 1x 100 Gb/s at 11.5 GB/s, InfiniBand; {_NCCL_SRC}; "
            "copies at 1000 GB/s assumed (half of 2.0 TB/s HBM2e)"
        ),
    ),
    # 8 GPUs on PCIe 4.0 x16 (~25 GB/s per direction, ~20 GB/s ring busbw); one 25 GbE
    # port under NCCL's socket transport (~2.8 GB/s of 3.125 line rate).
    "pcie-25gbe": Profile(
        intra=Link.from_bandwidth(5.7e-6, 20e9),
        inter=Link.from_bandwidth(30e-6, 2.8e9),
        nodes=8,
        ranks_per_node=8,
        rails=1,
        backend="nccl",
        gpu="ampere",
        intra_link="pci",
        copy_gbps=300.0,
        name="pcie-25gbe",
        source=(
            f"8 GPUs on PCIe 4.0 ~20 GB/s ring busbw; 1x 25 GbE TCP ~2.8 GB/s; {_NCCL_SRC} (PCI links); "
            "copies at 300 GB/s assumed (an A10-class GPU: half of 600 GB/s GDDR6)"
        ),
    ),
    # The one-machine testbed (docs/benchmarks.md): gloo over loopback inside a node, one veth
    # per node shaped by tbf to 800 Mbit/s (~95 MB/s of 100 MB/s) between nodes. The figures are
    # what `python -m hiersync calibrate --rails 1 --full` fitted there (docs/costmodel.md,
    # "Against the testbed"): gloo's all-reduce reduces and copies on the CPU, so its intra-node
    # link is ~1 GB/s, not the ~3 GB/s a raw loopback socket moves.
    "emulated": Profile(
        intra=Link.from_bandwidth(743e-6, 986.5e6),
        inter=Link.from_bandwidth(584e-6, 95e6),
        nodes=2,
        ranks_per_node=2,
        rails=1,
        backend="gloo",
        intra_reduce_scatter=Link.from_bandwidth(1814e-6, 276.1e6),
        intra_all_gather=Link.from_bandwidth(1110e-6, 466.7e6),
        intra_broadcast=Link.from_bandwidth(681e-6, 2278e6),
        copy_gbps=1.4,
        name="emulated",
        source=(
            "emulated testbed, calibrated (docs/costmodel.md, 'Against the testbed'): gloo intra all-reduce "
            "743 us + 986.5 MB/s, reduce-scatter 276.1 MB/s, all-gather 466.7 MB/s and shard broadcast 2278 MB/s "
            "(effective); inter 584 us and 95 MB/s per NIC (the tbf 800 Mbit/s payload rate, measured as raw TCP; "
            "the fit's 111.5 MB/s follows tbf's bursts at small sizes); copies at 1.4 GB/s measured (a 100 MB "
            "torch.cat took 71 ms on the loaded 2-core box)"
        ),
    ),
}


DEFAULT_COPY_GBPS = {"nccl": 1000.0, "other": 5.0}
"""Copy speed assumed when a profile does not state one: an A100-class GPU under NCCL (half
of ~2 TB/s of HBM), a CPU memcpy (~5 GB/s) otherwise. Assumptions, printed by the planner."""


def default_copy_gbps(backend: str) -> float:
    """The copy speed (GB/s) assumed on ``backend`` when a profile does not state one."""
    return DEFAULT_COPY_GBPS["nccl" if "nccl" in str(backend).lower() else "other"]


def get_preset(name: str) -> Profile:
    """The preset :class:`Profile` called ``name`` (see :data:`PRESETS`)."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; valid: {', '.join(PRESETS)}") from None


def preset_for_backend(backend: str) -> str:
    """Name of the preset that stands in for an uncalibrated cluster on ``backend``.

    ``"nccl"`` (or any backend string naming NCCL, e.g. ``"cpu:gloo,cuda:nccl"``) gives
    ``"h100-8rail"``; ``"gloo"`` gives ``"emulated"``. Others log a warning and get
    ``"emulated"``: calibrate (``python -m hiersync calibrate``) for real numbers.
    """
    name = str(backend).lower()
    if "nccl" in name:
        return "h100-8rail"
    if "gloo" not in name:
        logger.warning("hiersync: no preset for backend %r; using 'emulated' (calibrate for real numbers)", backend)
    return "emulated"
