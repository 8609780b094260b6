"""Cluster IR: the devices a plan runs on, their speed and memory, and the links between them.

A Cluster is what planners and the simulator read to turn layer costs into seconds and bytes.
It describes ``num_devices`` identical devices (a ``DeviceSpec``), the memory of each, and the
links between them, optionally on two levels: ``devices_per_node`` devices share a node and
talk over ``intra_link``; devices on different nodes talk over ``inter_link``. Device ``d``
lives on node ``d // devices_per_node``.

Links are affine: moving ``n`` bytes takes ``alpha + n / beta`` seconds.

Presets:
  v100_cluster(n): the GraphPipe paper's cluster, 4 V100 16 GB per node, NVLink inside a node,
                   100 Gb/s InfiniBand between nodes.
  cuda_cluster(n): NVIDIA H100 SXM 80 GB GPUs, 8 per node on NVLink 4 (or PCIe Gen5 with
                   ``link="pcie"``), 400 Gb/s InfiniBand between nodes; the peak FLOP/s is
                   the one of the training dtype (``H100_PEAK_FLOPS``).
  cpu_cluster(n):  the forced host-platform CPU devices the tests run on (rough numbers).
The presets are starting points; ``Cluster.replace`` (or a calibration pass that measures the
real machine) swaps any number for a measured one.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
  """Speed of one device.

  Attributes:
    name: a label ("V100-SXM2-16GB").
    peak_flops: peak arithmetic throughput, FLOP/s.
    memory_bandwidth: device-memory bandwidth, bytes/s.
    efficiency: points ``(rows_per_device, fraction_of_peak)``, increasing in rows; the
      fraction of ``peak_flops`` a layer reaches when its matrix products see that many rows
      on one device (samples per device x the layer's ``rows`` per sample, which is 1 unless
      the layer says otherwise, e.g. the tokens of a Transformer layer). Between points it is
      interpolated linearly in log2(rows); outside it is clamped.
    kernel_overhead: fixed seconds per layer per pass (launch and framework overhead).
    width_half: where set, a layer's fraction of peak is also scaled by w / (w + width_half),
      w its matrix products' width (the layer attribute ``width``, e.g. a Transformer's hidden
      size): a GEMM of a small inner dimension reaches less of the tensor cores' peak than a
      wide one of as many rows. 0: no such term (rows alone, ``efficiency``).
  """

  name: str
  peak_flops: float
  memory_bandwidth: float
  efficiency: tuple[tuple[float, float], ...] = ((1, 1.0),)
  kernel_overhead: float = 0.0
  width_half: float = 0.0

  def __post_init__(self):
    if self.peak_flops <= 0 or self.memory_bandwidth <= 0:
      raise ValueError(f"device {self.name!r}: peak_flops and memory_bandwidth must be positive")
    pts = tuple((float(s), float(f)) for s, f in self.efficiency)
    if not pts or any(s <= 0 or not 0 < f <= 1 for s, f in pts):
      raise ValueError(
        f"device {self.name!r}: efficiency points must be (samples > 0, "
        f"0 < fraction <= 1), got {self.efficiency}"
      )
    if any(a[0] >= b[0] for a, b in itertools.pairwise(pts)):
      raise ValueError(f"device {self.name!r}: efficiency samples must increase, got {pts}")
    object.__setattr__(self, "efficiency", pts)

  def efficiency_at(self, samples: float) -> float:
    """Fraction of peak FLOP/s reached with ``samples`` rows per device (samples x rows per
    sample)."""
    pts = self.efficiency
    if samples <= pts[0][0]:
      return pts[0][1]
    if samples >= pts[-1][0]:
      return pts[-1][1]
    i = bisect.bisect_right([s for s, _ in pts], samples)
    (s0, f0), (s1, f1) = pts[i - 1], pts[i]
    w = (math.log2(samples) - math.log2(s0)) / (math.log2(s1) - math.log2(s0))
    return f0 + w * (f1 - f0)


@dataclasses.dataclass(frozen=True)
class Link:
  """An affine link: ``bytes`` take ``alpha + bytes / beta`` seconds."""

  alpha: float
  beta: float
  name: str = ""

  def __post_init__(self):
    if self.alpha < 0 or self.beta <= 0:
      raise ValueError(
        f"link {self.name!r}: need alpha >= 0 and beta > 0, got "
        f"alpha={self.alpha}, beta={self.beta}"
      )

  def time(self, nbytes: float) -> float:
    return 0.0 if nbytes <= 0 else self.alpha + nbytes / self.beta


@dataclasses.dataclass(frozen=True)
class Cluster:
  """Identical devices with a memory budget each, on one or two link levels.

  Attributes:
    num_devices: number of devices; they are numbered 0..num_devices-1.
    device: the DeviceSpec of every device.
    memory_per_device: bytes a stage may use on each of its devices.
    intra_link: the link between devices of one node (of all devices if one level).
    inter_link: the link between nodes (None: one level).
    devices_per_node: devices per node (None: one level, all devices on one node).
    name: a label.
  """

  num_devices: int
  device: DeviceSpec
  memory_per_device: float
  intra_link: Link
  inter_link: Link | None = None
  devices_per_node: int | None = None
  name: str = "cluster"

  def __post_init__(self):
    if self.num_devices < 1:
      raise ValueError(f"a cluster needs at least one device, got num_devices={self.num_devices}")
    if self.memory_per_device <= 0:
      raise ValueError(f"memory_per_device must be positive, got {self.memory_per_device}")
    if (self.inter_link is None) != (self.devices_per_node is None):
      raise ValueError(
        "give both inter_link and devices_per_node for a two-level cluster, "
        "or neither for a single level"
      )
    if self.devices_per_node is not None and self.devices_per_node < 1:
      raise ValueError(f"devices_per_node must be >= 1, got {self.devices_per_node}")

  @property
  def devices(self) -> tuple[int, ...]:
    """Device indices 0..num_devices-1 (``len(cluster.devices)`` is the device count)."""
    return tuple(range(self.num_devices))

  @property
  def num_nodes(self) -> int:
    if self.devices_per_node is None:
      return 1
    return -(-self.num_devices // self.devices_per_node)

  def node_of(self, device: int) -> int:
    return 0 if self.devices_per_node is None else device // self.devices_per_node

  def link(self, a: int, b: int) -> Link:
    """The link between devices ``a`` and ``b``."""
    if self.inter_link is None or self.node_of(a) == self.node_of(b):
      return self.intra_link
    return self.inter_link

  def link_between(self, src: Sequence[int], dst: Sequence[int]) -> Link:
    """The slowest link between any device of ``src`` and any of ``dst``."""
    if self.inter_link is None:
      return self.intra_link
    devices = (*src, *dst)
    if not devices:  # no node at all
      return self.inter_link
    n = self.devices_per_node
    if n is None:  # one node
      return self.intra_link
    # Nodes number the devices in order: one node iff the lowest and highest device share it.
    return self.intra_link if min(devices) // n == max(devices) // n else self.inter_link

  def group_link(self, devices: Sequence[int]) -> Link:
    """The link an all-reduce over ``devices`` is limited by."""
    return self.link_between(devices, devices)

  def slowest_link(self) -> Link:
    """The inter-node link if the cluster spans nodes, else the intra-node link."""
    if self.inter_link is not None and self.num_nodes > 1:
      return self.inter_link
    return self.intra_link

  def replace(self, **kw) -> Cluster:
    return dataclasses.replace(self, **kw)

  def with_devices(self, num_devices: int) -> Cluster:
    return dataclasses.replace(self, num_devices=int(num_devices))

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> Cluster:
    dev = dict(d["device"])
    dev["efficiency"] = tuple(tuple(p) for p in dev.get("efficiency", ((1, 1.0),)))
    inter = d.get("inter_link")
    return cls(
      num_devices=int(d["num_devices"]),
      device=DeviceSpec(**dev),
      memory_per_device=float(d["memory_per_device"]),
      intra_link=Link(**d["intra_link"]),
      inter_link=None if inter is None else Link(**inter),
      devices_per_node=d.get("devices_per_node"),
      name=d.get("name", "cluster"),
    )

  def to_json(self, indent: int | None = 1) -> str:
    return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

  @classmethod
  def from_json(cls, s: str) -> Cluster:
    return cls.from_dict(json.loads(s))

  def __str__(self) -> str:
    d = self.device
    lines = [
      f"Cluster {self.name}: {self.num_devices} x {d.name}, "
      f"{self.memory_per_device / GiB:.1f} GiB each",
      f"  device: {d.peak_flops / 1e12:.2f} TFLOP/s peak, "
      f"{d.memory_bandwidth / 1e9:.0f} GB/s memory, "
      f"{d.kernel_overhead * 1e6:.1f} us per layer pass, efficiency "
      + ", ".join(f"{s:g}:{f:.2f}" for s, f in d.efficiency),
      f"  intra-node link: alpha {self.intra_link.alpha * 1e6:.1f} us, "
      f"beta {self.intra_link.beta / 1e9:.1f} GB/s",
    ]
    if self.inter_link is not None:
      lines.append(
        f"  inter-node link: alpha {self.inter_link.alpha * 1e6:.1f} us, "
        f"beta {self.inter_link.beta / 1e9:.2f} GB/s; {self.devices_per_node} "
        f"devices per node, {self.num_nodes} nodes"
      )
    return "\n".join(lines)


V100 = DeviceSpec(
  name="V100-SXM2-16GB",
  peak_flops=15.7e12,  # FP32 peak
  memory_bandwidth=900e9,  # HBM2
  # Fraction of peak reached by dense layers at a given per-device micro-batch; the
  # roofline's weight-read term adds the small-batch penalty on top of this.
  efficiency=((1, 0.45), (4, 0.6), (16, 0.72), (64, 0.8)),
  kernel_overhead=20e-6,
)

CPU = DeviceSpec(
  name="host-cpu",
  peak_flops=20e9,
  memory_bandwidth=10e9,
  efficiency=((1, 0.5), (16, 0.8)),
  kernel_overhead=50e-6,
)


# NVIDIA H100 SXM5 80 GB, dense (no sparsity) tensor-core peaks from NVIDIA's datasheet, per
# training dtype. float32 matrix products run on the TF32 tensor cores at JAX's default
# precision; "float32-highest" is the non-tensor-core FP32 peak (precision="highest").
H100_PEAK_FLOPS = {
  "bfloat16": 989.4e12,
  "float16": 989.4e12,
  "float32": 494.7e12,
  "float32-highest": 66.9e12,
}
H100_HBM_BANDWIDTH = 3.35e12  # HBM3, bytes/s
H100_MEMORY = 80e9  # bytes on the card
# NVLink 4: 18 links, 900 GB/s both directions together, 450 GB/s each way. PCIe Gen5 x16:
# 64 GB/s each way (about 55 GB/s reached). InfiniBand NDR, one 400 Gb/s port per GPU.
H100_LINKS = {
  "nvlink": Link(alpha=10e-6, beta=450e9, name="nvlink4"),
  "pcie": Link(alpha=15e-6, beta=55e9, name="pcie-gen5-x16"),
  "infiniband": Link(alpha=15e-6, beta=400e9 / 8, name="infiniband-ndr"),
}


def h100(dtype: str = "float32") -> DeviceSpec:
  """One H100 SXM at the peak of ``dtype`` (a key of ``H100_PEAK_FLOPS``)."""
  key = str(dtype)
  if key not in H100_PEAK_FLOPS:
    raise ValueError(f"no H100 peak for dtype {key!r}; choose one of {sorted(H100_PEAK_FLOPS)}")
  # Small per-device batches reach a small fraction of the tensor-core peak (launch-bound
  # kernels, weight reads); the roofline's weight-read term adds to this. Rough: calibration
  # (``calibrate=True``) replaces layer times with measured ones.
  return DeviceSpec(
    name=f"H100-SXM5-80GB ({key})",
    peak_flops=H100_PEAK_FLOPS[key],
    memory_bandwidth=H100_HBM_BANDWIDTH,
    efficiency=((1, 0.02), (8, 0.1), (64, 0.35), (512, 0.6)),
    kernel_overhead=8e-6,
  )


# NVIDIA A100 SXM4 80 GB (NVIDIA A100 datasheet): 312 TFLOP/s dense bfloat16/float16 tensor
# cores, 2,039 GB/s HBM2e. Selene as Narayanan et al. (SC'21, section 5) describe it: DGX
# A100 nodes of 8 GPUs on NVLink 3 / NVSwitch (600 GB/s both directions together per GPU,
# 300 GB/s each way; DGX A100 user guide), 8 InfiniBand HDR adapters per node (200 Gb/s each,
# one per GPU). Latencies: a few microseconds per hop (NCCL's typical NVLink and IB latencies).
A100_PEAK_FLOPS = 312e12
A100_HBM_BANDWIDTH = 2.039e12
A100_LINKS = {
  "nvlink": Link(alpha=5e-6, beta=300e9, name="nvlink3"),
  "infiniband": Link(alpha=8e-6, beta=200e9 / 8, name="infiniband-hdr"),
}
# The A100's and H100's fraction of tensor-core peak by GEMM rows (tokens per device) and
# width (``DeviceSpec.width_half``): fitted once, on the four Megatron-LM rows named in
# docs/results/megatron.md ("Megatron-LM's GPT runs, predicted"), not per row.
GPU_GEMM_EFFICIENCY = ((1, 0.0175), (64, 0.22), (512, 0.48), (2048, 0.63), (16384, 0.7))
GPU_GEMM_WIDTH_HALF = 400.0


def a100(name: str = "A100-SXM4-80GB (bf16)") -> DeviceSpec:
  """One A100 SXM4 80 GB at its dense bfloat16 peak, GEMM efficiency by rows and width."""
  return DeviceSpec(
    name=name,
    peak_flops=A100_PEAK_FLOPS,
    memory_bandwidth=A100_HBM_BANDWIDTH,
    efficiency=GPU_GEMM_EFFICIENCY,
    kernel_overhead=5e-6,
    width_half=GPU_GEMM_WIDTH_HALF,
  )


def a100_cluster(num_devices: int) -> Cluster:
  """Selene (Narayanan et al., SC'21): DGX A100 80 GB nodes of 8 GPUs on NVSwitch, 8 HDR
  InfiniBand adapters per node (one per GPU)."""
  return Cluster(
    num_devices=num_devices,
    device=a100(),
    memory_per_device=80 * GiB,
    intra_link=A100_LINKS["nvlink"],
    inter_link=A100_LINKS["infiniband"],
    devices_per_node=8,
    name=f"a100x{num_devices}",
  )


def h100_cluster(num_devices: int) -> Cluster:
  """A DGX H100 cluster (DGX H100 user guide): nodes of 8 H100 SXM5 80 GB on NVLink 4 /
  NVSwitch (450 GB/s each way per GPU), one 400 Gb/s InfiniBand NDR port per GPU; the H100's
  dense bfloat16 peak (``H100_PEAK_FLOPS``) with the same GEMM efficiency model as the A100."""
  device = dataclasses.replace(
    a100("H100-SXM5-80GB (bf16)"),
    peak_flops=H100_PEAK_FLOPS["bfloat16"],
    memory_bandwidth=H100_HBM_BANDWIDTH,
  )
  return Cluster(
    num_devices=num_devices,
    device=device,
    memory_per_device=80 * GiB,
    intra_link=H100_LINKS["nvlink"],
    inter_link=H100_LINKS["infiniband"],
    devices_per_node=8,
    name=f"h100x{num_devices}",
  )


def cuda_cluster(
  num_devices: int,
  dtype: str = "float32",
  link: str = "nvlink",
  devices_per_node: int = 8,
  memory_fraction: float = 0.75,
) -> Cluster:
  """H100 GPUs, ``devices_per_node`` per node over NVLink (``link="pcie"``: PCIe Gen5),
  InfiniBand NDR between nodes.

  ``memory_fraction`` of the 80 GB is what a stage may use: JAX preallocates 75% of the GPU's
  memory by default (``XLA_PYTHON_CLIENT_MEM_FRACTION``).
  """
  if link not in ("nvlink", "pcie"):
    raise ValueError(f"link must be 'nvlink' or 'pcie', got {link!r}")
  if not 0 < memory_fraction <= 1:
    raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
  two_level = num_devices > devices_per_node
  return Cluster(
    num_devices=num_devices,
    device=h100(dtype),
    memory_per_device=H100_MEMORY * memory_fraction,
    intra_link=H100_LINKS[link],
    inter_link=H100_LINKS["infiniband"] if two_level else None,
    devices_per_node=devices_per_node if two_level else None,
    name=f"h100x{num_devices}",
  )


def v100_cluster(num_devices: int) -> Cluster:
  """The GraphPipe paper's cluster: nodes of 4 V100 16 GB (NVLink), 100 Gb/s between nodes."""
  return Cluster(
    num_devices=num_devices,
    device=V100,
    memory_per_device=16 * GiB,
    intra_link=Link(alpha=5e-6, beta=50e9, name="nvlink"),
    inter_link=Link(alpha=10e-6, beta=100e9 / 8, name="infiniband-edr"),
    devices_per_node=4,
    name=f"v100x{num_devices}",
  )


def cpu_cluster(num_devices: int, memory_per_device: float = 4 * GiB) -> Cluster:
  """Forced host-platform CPU devices (``--xla_force_host_platform_device_count``).

  The numbers are rough: the devices share the host's cores and memory; a calibration pass
  can replace them with measured ones.
  """
  return Cluster(
    num_devices=num_devices,
    device=CPU,
    memory_per_device=memory_per_device,
    intra_link=Link(alpha=20e-6, beta=5e9, name="host-memcpy"),
    name=f"cpux{num_devices}",
  )


def process_blocks(procs: Sequence[int]) -> int | None:
  """Devices per process where the devices (their processes ``procs``, in order) come in
  equal blocks, each of one process; else None."""
  n = len(procs)
  if not n:
    return None
  per = procs.count(procs[0])
  if n % per or any(procs[i] != procs[(i // per) * per] for i in range(n)):
    return None
  return per


def process_cluster(devices: Sequence[Any], memory_per_device: float = 4 * GiB) -> Cluster:
  """The cluster of the given JAX devices as a planner sees it: forced CPU devices, one node
  per process (cross-process transfers go over the loopback socket JAX's cross-host
  ``device_put`` uses, measured at about 2 ms per MiB), so planners keep stages inside one
  process where they fit. A single process gives a one-level ``cpu_cluster``."""
  procs = [d.process_index for d in devices]
  n = len(devices)
  if len(set(procs)) <= 1:
    return cpu_cluster(n, memory_per_device)
  per = process_blocks(procs)
  if per is None:
    return cpu_cluster(n, memory_per_device)
  return cpu_cluster(n, memory_per_device).replace(
    devices_per_node=per,
    inter_link=Link(alpha=1e-3, beta=0.5e9, name="cross-process"),
    name=f"cpux{n} ({n // per} processes)",
  )


def devices_cluster(devices: Sequence[Any]) -> Cluster:
  """The cluster preset of the given JAX devices: GPUs the ``cuda`` preset (H100s), anything
  else ``process_cluster`` (forced CPU devices, one node per process). Layer times are
  replaced by measured ones when calibrating; the preset still prices the optimizer update
  and the transfers, so a GPU priced as a CPU would look a hundred times slower at both."""
  if devices and all(getattr(d, "platform", None) == "gpu" for d in devices):
    return cuda_cluster(len(devices))
  return process_cluster(devices)


CLUSTER_PRESETS = ("cpu", "cuda", "v100", "a100", "h100")
"""The cluster presets by name: forced CPU devices, H100 GPUs, the GraphPipe paper's V100s,
Selene's DGX A100s (Megatron-LM's SC'21 runs), DGX H100s."""


def make_cluster(name: str, num_devices: int, dtype: str = "float32") -> Cluster:
  """The cluster preset ``name`` with ``num_devices`` devices (``cuda``: at the peak of
  ``dtype``)."""
  if name == "cpu":
    return cpu_cluster(num_devices)
  if name == "cuda":
    return cuda_cluster(num_devices, dtype=dtype)
  if name == "v100":
    return v100_cluster(num_devices)
  if name == "a100":
    return a100_cluster(num_devices)
  if name == "h100":
    return h100_cluster(num_devices)
  raise ValueError(f"unknown cluster {name!r}; choose one of {list(CLUSTER_PRESETS)}")


def as_cluster(cluster: Cluster | int | None, default_devices: int = 1) -> Cluster:
  """Accepts a Cluster, a device count (a ``cpu_cluster``) or None (``default_devices``)."""
  if isinstance(cluster, Cluster):
    return cluster
  if cluster is None:
    return cpu_cluster(default_devices)
  if isinstance(cluster, int):
    return cpu_cluster(cluster)
  raise TypeError(
    f"expected a Cluster or a device count, got {type(cluster).__name__}; "
    "build one with gpp_jax.cost.cluster.cuda_cluster(n), v100_cluster(n) or "
    "cpu_cluster(n)"
  )
