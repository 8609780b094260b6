"""Cost model: LayerGraph costs + Cluster -> seconds per stage and bytes per device.

Time of one layer for a micro-batch of ``s`` samples on one device:

* measured, when the layer has ``time_f`` (and maybe ``time_b``) taken at the graph's
  ``batch_size`` B on one device: ``time_f * (s / B) * eff(r B) / eff(r s)``, where ``eff`` is
  the device's efficiency curve (so a small micro-batch is relatively slower) and ``r`` the
  layer's ``rows``: the rows its matrix products see per sample (the tokens of a sequence
  model, 1 by default), so the curve is keyed on rows, not samples (a Transformer layer at
  one sample of 256 tokens multiplies 256-row matrices);
* otherwise the roofline ``max(flops(s) / (peak * eff(r s)), bytes(s) / bandwidth)``, where
  ``flops(s) = flops * s / B`` and ``bytes(s) = W + (bytes - W) * s / B`` with W the parameter
  bytes read once per micro-batch whatever its size: the layer's ``param_read_bytes`` if set,
  else ``param_bytes`` when ``bytes >= param_bytes`` (a dense layer reads all its weights),
  else 0 (a sparse gather such as an embedding bag reads a few rows);
  plus the device's fixed ``kernel_overhead`` per layer and pass (a measured time already
  holds it: each layer was timed as a call of its own).

Backward is ``time_b`` scaled the same way when measured, else ``backward_factor`` (2) times
forward. A stage that is data parallel over ``d`` devices runs ``microbatch / d`` samples per
device. Transfers cost ``alpha + bytes / beta`` on the link between the two stages' devices.
Gradients of a stage with ``d > 1`` devices are all-reduced once per iteration with a ring:
``2 (d - 1) alpha + 2 (d - 1) / d * param_bytes / beta``. (The executor all-reduces them in
every backward; the host-aware model charges that where the host measured it,
``cost.host.HostCosts.allreduce``.)

Memory per device of a stage:
``param_bytes * (1 + gradient_factor + optimizer_state_factor)``   (weights, grads, Adam m, v)
``+ saved_bytes_per_sample * microbatch / d * in_flight``          (stashed activations)
with ``in_flight`` the micro-batches the stage holds at once (its 1F1B warm-up).

A graph captured from a train step carries what the step itself holds per layer (the graph
attribute ``step_memory``, ``runtime.layer_memory``); there a stage's memory per device is
what its program holds (``step_memory_terms``): during the pipeline its parameters (and, on
one device, the packed copy its forward and backward read), gradient sums, the optimizer's
own state, the step's batch not yet consumed, the executables' temporaries, and per
micro-batch in flight its vjp residuals (on several devices with a copy of the parameters);
during the optimizer update, which keeps the old parameters and state until the new ones are
written, twice the parameters and state plus the gradients. The saved bytes per sample the
planners' searches read are then the residuals too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import networkx as nx
import numpy as np

from gpp_jax.cost.cluster import Cluster, DeviceSpec, Link
from gpp_jax.cost.fsdp import fsdp_gathered_bytes, fsdp_stage_times, overlapped_time  # noqa: F401
from gpp_jax.cost.step_memory import (
  HeldStage,
  _held_memory,
  _one_call,
  _row_width,
  step_memory_terms,
)
from gpp_jax.ir.layer_graph import topo_layers
from gpp_jax.ir.plan import has_mixed_microbatches

# Bytes of one stage (float) or of many candidate stages at once (array), for the planners.
_Bytes = TypeVar("_Bytes", float, np.ndarray)


@dataclasses.dataclass(frozen=True)
class CostModel:
  """Knobs of the cost model; the defaults model Adam in fp32.

  Attributes:
    gradient_factor: gradient bytes per parameter byte.
    optimizer_state_factor: optimizer-state bytes per parameter byte (Adam: 2, SGD: 0).
    backward_factor: backward time / forward time when no measured ``time_b`` exists.
    update_traffic: parameter-sized arrays the optimizer update reads and writes.
    tps_formula: how planners combine a stage's compute and its transfers into a time per
      sample: "sum" (no overlap, conservative, as PipeDream's planner) or "max" (full overlap).
    fsdp_backward_gathers: how many times an FSDP (ZeRO-3) backward all-gathers a layer's
      parameters: 1 where one gather serves the recomputed forward and the backward (XLA's,
      the gather inside a ``jax.checkpoint``'d layer), 2 where the recomputation gathers
      them for itself and releases them before the backward gathers them again (DeepSpeed's
      ZeRO-3 hooks with activation checkpointing: ``fsdp_stage_times``).
  """

  gradient_factor: float = 1.0
  optimizer_state_factor: float = 2.0
  backward_factor: float = 2.0
  update_traffic: float = 7.0
  tps_formula: str = "sum"
  fsdp_backward_gathers: int = 1

  def __post_init__(self):
    if self.tps_formula not in ("sum", "max"):
      raise ValueError(f"tps_formula must be 'sum' or 'max', got {self.tps_formula!r}")
    if self.fsdp_backward_gathers not in (1, 2):
      raise ValueError(f"fsdp_backward_gathers must be 1 or 2, got {self.fsdp_backward_gathers!r}")

  # -- per-layer and per-stage times -------------------------------------------------------
  def layer_times(
    self, costs: LayerCosts, device: DeviceSpec, samples: float
  ) -> tuple[np.ndarray, np.ndarray]:
    """Forward and backward seconds of every layer (``costs.layers`` order) for ``samples``
    samples on one device."""
    return _layer_times(self, costs, device, float(samples))

  def planner_layer_times(
    self, costs: LayerCosts, cluster: Any, samples: float
  ) -> tuple[np.ndarray, np.ndarray]:
    """``layer_times`` on one device of ``cluster`` with the model's tensor parallelism
    (``LayerCosts.tp_degree``): a layer split over n devices computes 1/n of its work and
    all-reduces its output in the forward and its input cotangent in the backward over the
    node's link, as ``plan_costs`` prices a stage of such layers. The planners' searches read
    these, so that they price what the simulator prices."""
    tf, tb = self.layer_times(costs, cluster.device, samples)
    if costs.tp_degree is None:
      return tf, tb
    key = ("tp", self, cluster.device, cluster.intra_link, float(samples))
    hit = costs._times.get(key)
    if hit is not None:
      return hit
    n = costs.tp_degree
    assert costs.tp_out_ps is not None and costs.tp_in_ps is not None  # set with tp_degree
    split = n > 1
    link = cluster.intra_link
    ar_f = np.array(
      [self.allreduce_time(b * samples, int(k), link) for b, k in zip(costs.tp_out_ps, n)]
    )
    ar_b = np.array(
      [self.allreduce_time(b * samples, int(k), link) for b, k in zip(costs.tp_in_ps, n)]
    )
    tf = np.where(split, tf / n + ar_f, tf)
    tb = np.where(split, tb / n + ar_b, tb)
    tf.setflags(write=False)
    tb.setflags(write=False)
    costs._times[key] = (tf, tb)
    return tf, tb

  def stage_time(
    self,
    costs: LayerCosts,
    layers: Sequence[int],
    device: DeviceSpec,
    microbatch: float,
    dp: int = 1,
  ) -> tuple[float, float]:
    """(forward, backward) seconds of one micro-batch of a stage made of ``layers`` (indices)
    that is data parallel over ``dp`` devices."""
    tf, tb = self.layer_times(costs, device, microbatch / dp)
    idx = np.asarray(layers, dtype=int)
    return float(tf[idx].sum()), float(tb[idx].sum())

  def transfer_time(self, nbytes: float, link: Link) -> float:
    return link.time(nbytes)

  def allreduce_time(self, nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce of ``nbytes`` over ``n`` devices."""
    if n <= 1 or nbytes <= 0:
      return 0.0
    return 2 * (n - 1) * link.alpha + 2 * (n - 1) / n * nbytes / link.beta

  def allgather_time(self, nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather (or reduce-scatter) of ``nbytes`` in all over ``n`` devices."""
    if n <= 1 or nbytes <= 0:
      return 0.0
    return (n - 1) * link.alpha + (n - 1) / n * nbytes / link.beta

  def update_time(
    self,
    param_bytes: float,
    device: DeviceSpec,
    n: int,
    link: Link,
    per_byte: float | None = None,
  ) -> float:
    """Gradient all-reduce over the stage's ``n`` devices plus the optimizer update: its
    ``update_traffic`` at the device's memory bandwidth, or ``per_byte`` seconds per
    parameter byte where measured (``passes.calibrate.measure_update``)."""
    if per_byte is None:
      step = self.update_traffic * param_bytes / device.memory_bandwidth
    else:
      step = per_byte * param_bytes
    return self.allreduce_time(param_bytes, n, link) + step

  # -- memory -------------------------------------------------------------------------------
  def static_memory(self, param_bytes: _Bytes) -> _Bytes:
    """Weights, gradients and optimizer state, replicated on every device of a stage."""
    return param_bytes * (1.0 + self.gradient_factor + self.optimizer_state_factor)

  def activation_memory(
    self, saved_bytes_per_sample: float, microbatch: float, dp: int, in_flight: float
  ) -> float:
    """Stashed activations per device: ``in_flight`` micro-batches split over ``dp`` devices."""
    return saved_bytes_per_sample * microbatch / dp * in_flight

  def stage_memory(
    self,
    param_bytes: float,
    saved_bytes_per_sample: float,
    microbatch: float,
    dp: int,
    in_flight: float,
  ) -> float:
    return self.static_memory(param_bytes) + self.activation_memory(
      saved_bytes_per_sample, microbatch, dp, in_flight
    )

  def memory_rules_out(
    self,
    param_bytes: np.ndarray,
    saved_bytes_per_sample: np.ndarray,
    microbatch: float,
    dps: Sequence[int],
    num_devices: int,
    memory_per_device: float,
  ) -> bool:
    """True where no plan of stages on ``dps`` devices each (layers' weights replicated in a
    stage, ``stage_memory``) can fit ``num_devices`` devices at ``microbatch``: a bound that
    planners check before a search which would find none. Some layer (per-layer byte arrays)
    does not fit alone on the most devices, or the stages together need more than all
    devices hold: a stage of d devices holds its weights on each and at least one
    micro-batch's stash split over them, d x static + microbatch x saved bytes, and d is no
    less than the fewest of ``dps``."""
    static = self.static_memory(np.asarray(param_bytes, dtype=float))
    saved = np.asarray(saved_bytes_per_sample, dtype=float)
    alone = static + self.activation_memory(saved, microbatch, max(dps), 1)  # type: ignore[arg-type]
    if np.any(alone > memory_per_device):
      return True
    need = min(dps) * float(static.sum()) + microbatch * float(saved.sum())
    return need > num_devices * memory_per_device

  def combine(self, compute: float, comm: float) -> float:
    """A stage's busy time per micro-batch from its compute and transfer times."""
    return compute + comm if self.tps_formula == "sum" else max(compute, comm)


DEFAULT_COST_MODEL = CostModel()


def _layer_times(cm: CostModel, costs: LayerCosts, device: DeviceSpec, samples: float):
  key = (cm, device, samples)
  hit = costs._times.get(key)
  if hit is not None:
    return hit
  B = costs.batch_size
  eff = np.array([device.efficiency_at(samples * r) for r in costs.rows_ps])
  if device.width_half > 0 and costs.width is not None:  # narrow products: less of the peak
    w = costs.width
    eff = np.where(w > 0, eff * w / (w + device.width_half), eff)
  flops = costs.flops_ps * samples
  nbytes = costs.param_read_bytes + costs.act_bytes_ps * samples
  roof = np.maximum(flops / (device.peak_flops * eff), nbytes / device.memory_bandwidth)
  scale = samples * np.array([device.efficiency_at(B * r) for r in costs.rows_ps]) / eff
  # A measured time already holds the launch and framework overhead the roofline leaves out.
  over = device.kernel_overhead
  tf = np.where(np.isnan(costs.time_f_ps), roof + over, costs.time_f_ps * scale)
  tb = np.where(
    np.isnan(costs.time_b_ps), cm.backward_factor * roof + over, costs.time_b_ps * scale
  )
  tf.setflags(write=False)
  tb.setflags(write=False)
  costs._times[key] = (tf, tb)
  return tf, tb


@dataclasses.dataclass(frozen=True, eq=False)
class StepMemoryCosts:
  """What a captured step holds per layer besides its parameters (the graph attribute
  ``step_memory``, ``runtime.layer_memory``), as arrays in ``LayerCosts.layers`` order.

  Attributes:
    residual_ps: vjp residual bytes per sample (its parameters left out, its inputs in).
    packed_residual_ps: of those, the bytes per sample a stage on one device packs into one
      buffer in its forward (built in the executable's temporaries).
    kept_inputs: (layer, the layer it reads from, bytes per sample) of the small inputs the
      layer keeps, which such a stage packs too where both layers are in it.
    state: bytes of the step's other non-batch arguments living with the layer (optimizer
      state).
    batch_ps: batch bytes per sample the layer is the first to read.
    one_call: a plan of one stage runs as one call of the whole step, unless its schedule is
      one of ``stale_schedules`` (they keep older weights: the executor runs them).
  """

  residual_ps: np.ndarray
  packed_residual_ps: np.ndarray
  state: np.ndarray
  batch_ps: np.ndarray
  kept_inputs: tuple[tuple[int, int, float], ...] = ()
  one_call: bool = False
  stale_schedules: tuple[str, ...] = ()


def _step_memory_costs(g: nx.DiGraph, layers: Sequence[str]) -> StepMemoryCosts | None:
  """The graph's ``step_memory`` attribute as ``StepMemoryCosts`` (None without one)."""
  mem = g.graph.get("step_memory")
  if not mem:
    return None
  per = float(mem["batch_size"])
  index = {l: i for i, l in enumerate(layers)}

  def arr(key: str, scale: float = 1.0) -> np.ndarray:
    d = mem.get(key) or {}
    return np.array([float(d.get(l, 0.0)) / scale for l in layers])

  return StepMemoryCosts(
    residual_ps=arr("residuals", per),
    packed_residual_ps=arr("packed_residuals", per),
    state=arr("state"),
    batch_ps=arr("batch", per),
    kept_inputs=tuple(
      (index[l], index[src], float(n) / per)
      for l, srcs in (mem.get("kept_inputs") or {}).items()
      for src, n in srcs.items()
      if l in index and src in index
    ),
    one_call=bool(mem.get("one_call", False)),
    stale_schedules=tuple(mem.get("stale_schedules", ())),
  )


@dataclasses.dataclass(frozen=True, eq=False)
class LayerCosts:
  """Per-layer costs of a LayerGraph as arrays, per sample, in topological order.

  Built once per graph by ``layer_costs``; planners index it with layer positions.

  Attributes:
    layers: layer names in ``topo_layers`` order; ``index`` maps name -> position.
    batch_size: the graph's batch size (what measured times were taken at).
    flops_ps, act_bytes_ps, saved_ps: forward FLOPs, bytes moved that scale with the
      micro-batch, and saved activation bytes, per sample.
    param_bytes: parameter bytes per layer.
    param_read_bytes: parameter bytes each forward reads whatever the micro-batch size.
    time_f_ps, time_b_ps: measured seconds per sample at ``batch_size`` (NaN if not measured).
    rows_ps: rows the layer's matrix products see per sample (the layer attribute ``rows``,
      default 1): the efficiency curve is read at samples x rows.
    width: the width of the layer's matrix products (the layer attribute ``width``, 0 where
      not given), for devices whose efficiency depends on it (``DeviceSpec.width_half``).
    tp_degree, tp_out_ps, tp_in_ps: the model's tensor parallelism (graph attribute
      ``tensor_parallel``: per layer, over how many devices, and the bytes per sample its
      forward and backward all-reduce), None without; ``CostModel.planner_layer_times``.
    param_held: parameter bytes per layer each device holds under the model's partition
      specs (graph attribute ``param_shards``), None without; ``held_param_bytes``.
    memory: what the step holds per layer besides its parameters (graph attribute
      ``step_memory``), None without; ``StepMemoryCosts``, ``step_memory_terms``.
    edges: (u, v, bytes per sample) with u, v positions.
    edge_arrays: the arrays each edge carries (the edge attribute ``arrays``, default 1), in
      the order of ``edges``.
    time_at: per width k > 1 at which layers were timed as a stage over k devices runs them
      (``time_f_at`` / ``time_b_at``): (which were, every layer's forward and backward
      seconds per sample at k where timed, else its one-device times); ``at_width``.

  Planners price thousands of candidate plans whose stages recur (a polish moves a few
  layers, a sweep tries every micro-batch size on one partition), so ``plan_costs`` keeps
  what it derives from the layers in dicts held here, for as long as these costs (a planning
  problem's): per stage's layer names, their positions, parameter bytes, saved bytes per
  sample and weight fraction (``_stages``); per (cost model, device), a stage's (forward,
  backward) seconds per (layer names, micro-batch, data-parallel degree) (``_stage_times``,
  as ``_times`` keeps the per-layer times); per partition (each stage's layer names, in stage
  order), the bytes per sample and arrays crossing each stage edge (``_stage_edges``). Each
  value is a function of its key and of these immutable costs, so a hit is what recomputing
  would give, to the last bit.
  """

  layers: tuple[str, ...]
  index: Mapping[str, int]
  batch_size: int
  flops_ps: np.ndarray
  act_bytes_ps: np.ndarray
  param_bytes: np.ndarray
  param_read_bytes: np.ndarray
  saved_ps: np.ndarray
  time_f_ps: np.ndarray
  time_b_ps: np.ndarray
  edges: tuple[tuple[int, int, float], ...]
  rows_ps: np.ndarray
  edge_arrays: tuple[int, ...] = ()
  width: np.ndarray | None = None
  tp_degree: np.ndarray | None = None
  tp_out_ps: np.ndarray | None = None
  tp_in_ps: np.ndarray | None = None
  param_held: np.ndarray | None = None
  memory: StepMemoryCosts | None = None
  time_at: Mapping[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = dataclasses.field(
    default_factory=dict, repr=False
  )
  _times: dict = dataclasses.field(default_factory=dict, repr=False)

  @property
  def held_param_bytes(self) -> np.ndarray:
    """Parameter bytes per layer on each device of a stage (its shard where the model's specs
    split it, ``param_held``), what the planners count for memory and gradient reduction."""
    return self.param_bytes if self.param_held is None else self.param_held

  _stages: dict = dataclasses.field(default_factory=dict, repr=False)
  _memory: dict = dataclasses.field(default_factory=dict, repr=False)
  _stage_times: dict = dataclasses.field(default_factory=dict, repr=False)
  _stage_edges: dict = dataclasses.field(default_factory=dict, repr=False)
  _widths: dict = dataclasses.field(default_factory=dict, repr=False)

  def __len__(self) -> int:
    return len(self.layers)

  def timed_at(self, k: int, idx: Sequence[int]) -> bool:
    """Whether every layer at positions ``idx`` was timed as a stage over ``k`` devices runs
    it (``time_at``; ``ir.layer_graph.widths_measured``)."""
    return k in self.time_at and bool(self.time_at[k][0][idx].all())

  def at_width(self, k: int) -> LayerCosts:
    """These costs with each layer's times as measured over ``k`` devices where they were
    (``time_at``; ``layer_costs`` of ``ir.layer_graph.at_width``), kept for as long as these
    costs; what depends on the layers alone is shared with them."""
    hit = self._widths.get(k)
    if hit is None:
      _, tf, tb = self.time_at[k]
      hit = self._widths[k] = dataclasses.replace(
        self,
        time_f_ps=tf,
        time_b_ps=np.where(np.isnan(tf), math.nan, tb),
        time_at={},
        _times={},
        _stage_times={},
        _widths={},
      )
    return hit


def layer_costs(g: nx.DiGraph) -> LayerCosts:
  """LayerGraph -> LayerCosts (per-sample arrays in topological order)."""
  layers = tuple(topo_layers(g))
  index = {l: i for i, l in enumerate(layers)}
  B = float(g.graph["batch_size"])
  nd = [g.nodes[l] for l in layers]
  arr = lambda f: np.array([f(d) for d in nd], dtype=float)
  tf = arr(lambda d: d["time_f"] / B if d.get("time_f") is not None else math.nan)
  tb = arr(lambda d: d["time_b"] / B if d.get("time_b") is not None else math.nan)

  def fixed(d):
    if d.get("param_read_bytes") is not None:
      return float(d["param_read_bytes"])
    return d["param_bytes"] if d["bytes"] >= d["param_bytes"] else 0.0

  W = arr(fixed)
  memory = _step_memory_costs(g, layers)
  # A captured step's stashed activations are its layers' vjp residuals.
  saved = memory.residual_ps if memory is not None else arr(lambda d: d["saved_bytes"] / B)
  rows = arr(lambda d: d.get("rows", 1.0))
  if (rows <= 0).any():
    bad = [l for l, r in zip(layers, rows, strict=True) if r <= 0]
    raise ValueError(
      f"layers {bad}: 'rows' (rows per sample the layer's matrix products see) must be "
      "positive; set it to the tokens per sample of a sequence layer, or leave it out (1)"
    )
  return LayerCosts(
    layers=layers,
    index=index,
    batch_size=int(B),
    flops_ps=arr(lambda d: d["flops"] / B),
    act_bytes_ps=np.maximum(arr(lambda d: d["bytes"]) - W, 0.0) / B,
    param_bytes=arr(lambda d: d["param_bytes"]),
    param_read_bytes=W,
    saved_ps=saved,
    time_f_ps=tf,
    time_b_ps=np.where(np.isnan(tf), math.nan, tb),
    rows_ps=rows,
    width=arr(lambda d: d.get("width", 0.0)),
    **_sharding_arrays(g, layers),
    memory=memory,
    edges=tuple((index[u], index[v], d["bytes"] / B) for u, v, d in g.edges(data=True)),
    edge_arrays=tuple(int(d.get("arrays", 1)) for _, _, d in g.edges(data=True)),
    time_at=_times_at_widths(nd, B, tf, tb),
  )


def _sharding_arrays(g: nx.DiGraph, layers: Sequence[str]) -> dict[str, Any]:
  """``LayerCosts``' tensor-parallel and shard arrays from the graph's ``tensor_parallel``
  and ``param_shards`` attributes (none where the graph has neither)."""
  out: dict[str, Any] = {}
  tp = g.graph.get("tensor_parallel")
  if tp:
    out["tp_degree"] = np.array([float(tp[l][0]) if l in tp else 1.0 for l in layers])
    out["tp_out_ps"] = np.array([float(tp[l][1]) if l in tp else 0.0 for l in layers])
    out["tp_in_ps"] = np.array([float(tp[l][2]) if l in tp else 0.0 for l in layers])
  shards = g.graph.get("param_shards")
  if shards:
    held = [
      float(shards[l][1] + shards[l][2]) if l in shards else float(g.nodes[l]["param_bytes"])
      for l in layers
    ]
    out["param_held"] = np.array(held)
  return out


def _times_at_widths(
  nd: Sequence[Mapping[str, Any]], B: float, tf: np.ndarray, tb: np.ndarray
) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
  """Per width k > 1 at which some layer was timed as a stage over k devices runs it
  (``time_f_at`` and ``time_b_at``): which layers were (a mask), and every layer's seconds
  per sample forward and backward, those measured over k where they were, else ``tf`` /
  ``tb`` (the one-device times)."""
  keys = {k for d in nd for k in d.get("time_f_at", {}) if k in d.get("time_b_at", {})}
  out = {}
  for key in sorted(keys, key=int):
    timed = np.array([key in d.get("time_f_at", {}) and key in d.get("time_b_at", {}) for d in nd])
    f, b = tf.copy(), tb.copy()
    for i in np.flatnonzero(timed).tolist():
      f[i] = nd[i]["time_f_at"][key] / B
      b[i] = nd[i]["time_b_at"][key] / B
    out[int(key)] = (timed, f, b)
  return out


@dataclasses.dataclass(frozen=True)
class PlanCosts:
  """What the simulator needs about a plan, from the cost model.

  Attributes:
    forward, backward: seconds per micro-batch, per stage.
    update: seconds of the UPDATE action (gradient all-reduce + optimizer), per stage.
    activation_transfer: seconds to move one micro-batch (of stage i) of activations along
      stage edge (i, j).
    cotangent_transfer: seconds to move one micro-batch (of stage j) of cotangents back along
      (i, j) (the same as activation_transfer when i and j share a micro-batch size).
    static_memory: bytes per device of weights, gradients and optimizer state, per stage.
    activation_memory: bytes per device stashed for one micro-batch, per stage.
    microbatch: samples per micro-batch, per stage.
    weight_fraction: the share of each stage's backward that computes parameter gradients (the
      W action when a schedule splits the backward): half of the backward of the layers with
      parameters (the weight-gradient product costs what the input-gradient product does),
      weighted by forward FLOPs; 0 for a stage without parameters.
    param_bytes: parameter bytes per device of each stage (one copy of its weights).
    edge_arrays: arrays crossing each stage edge (i, j) (each a transfer of its own for the
      host to issue, both ways).
  """

  forward: tuple[float, ...]
  backward: tuple[float, ...]
  update: tuple[float, ...]
  activation_transfer: Mapping[tuple[int, int], float]
  cotangent_transfer: Mapping[tuple[int, int], float]
  static_memory: tuple[float, ...]
  activation_memory: tuple[float, ...]
  microbatch: tuple[float, ...]
  weight_fraction: tuple[float, ...] = ()
  param_bytes: tuple[float, ...] = ()
  edge_arrays: Mapping[tuple[int, int], int] = dataclasses.field(default_factory=dict)


def plan_microbatch(plan, stage, uniform: bool | None = None) -> float:
  """Samples per micro-batch of ``stage`` in ``plan``, as the runtime runs it
  (``ir.plan.stage_microbatch_sizes``): in a plan with a ``batch_size`` whose stages all name
  one size (``uniform``; None: worked out here), batch / num_microbatches whatever size they
  name, so that a plan given another number of micro-batches is priced at the size it runs;
  otherwise the stage's own size."""
  if uniform is None:
    uniform = not has_mixed_microbatches(plan)
  if plan.batch_size and uniform:
    return plan.batch_size / plan.num_microbatches
  if stage.microbatch_size:
    return float(stage.microbatch_size)
  if plan.batch_size:
    return plan.batch_size / plan.num_microbatches
  raise ValueError(
    f"stage {stage.index} has no microbatch_size and the plan no batch_size; "
    "set one of them so costs can be scaled to a micro-batch"
  )


def stage_edge_bytes(costs: LayerCosts, stage_of: Sequence[int]) -> dict[tuple[int, int], float]:
  """Bytes per sample crossing each stage edge; a layer output read by several layers of one
  stage is sent once (the largest edge counts)."""
  return stage_edges(costs, stage_of)[0]


def stage_edges(
  costs: LayerCosts, stage_of: Sequence[int]
) -> tuple[dict[tuple[int, int], float], dict[tuple[int, int], int]]:
  """(bytes per sample, arrays) crossing each stage edge; what a layer sends to several layers
  of one stage is sent once (its largest edge counts, bytes and arrays apart)."""
  arrays = costs.edge_arrays or (1,) * len(costs.edges)
  per_src: dict[tuple[int, int, int], tuple[float, int]] = {}
  for (u, v, b), a in zip(costs.edges, arrays):
    su, sv = stage_of[u], stage_of[v]
    if su != sv:
      key = (u, su, sv)
      b0, a0 = per_src.get(key, (0.0, 0))
      per_src[key] = (max(b0, b), max(a0, a))
  nbytes: dict[tuple[int, int], float] = {}
  count: dict[tuple[int, int], int] = {}
  for (_, su, sv), (b, a) in per_src.items():
    nbytes[(su, sv)] = nbytes.get((su, sv), 0.0) + b
    count[(su, sv)] = count.get((su, sv), 0) + a
  return nbytes, count


def _stage_terms(
  costs: LayerCosts, layers: tuple[str, ...]
) -> tuple[list[int], float, float, float]:
  """A stage's layer positions, parameter bytes, saved bytes per sample and weight fraction
  (``PlanCosts``), remembered per layer names (``LayerCosts._stages``)."""
  hit = costs._stages.get(layers)
  if hit is not None:
    return hit
  idx = [costs.index[l] for l in layers]
  params = float(costs.param_bytes[idx].sum())
  saved = float(costs.saved_ps[idx].sum())
  flops = costs.flops_ps[idx]
  with_params = costs.param_bytes[idx] > 0
  total = float(flops.sum())
  share = float(flops[with_params].sum()) / total if total > 0 else float(with_params.any())
  terms = (idx, params, saved, 0.5 * share)
  costs._stages[layers] = terms
  return terms


def plan_costs(
  plan,
  layer_graph: nx.DiGraph,
  cluster: Cluster,
  cost_model: CostModel | None = None,
  costs: LayerCosts | None = None,
) -> PlanCosts:
  """Plan + LayerGraph + Cluster -> PlanCosts (per-stage times, transfers, memory terms).

  What depends on a stage's layers alone, a stage's times, and a partition's edge bytes are
  remembered in ``costs`` (see ``LayerCosts``)."""
  cm = cost_model or DEFAULT_COST_MODEL
  costs = costs or layer_costs(layer_graph)
  device = cluster.device
  times = costs._stage_times.get((cm, device))
  if times is None:
    times = costs._stage_times[(cm, device)] = {}
  fw, bw, up, stat, act, mbs, wfrac, pbytes = [], [], [], [], [], [], [], []
  how = getattr(plan, "param_sharding", "model")
  fsdp = how == "fsdp"
  # The model's own partition specs (``runtime.compile.param_shards``): per layer, the bytes
  # of its sharded parameters, per device apart from the rows, and the part the rows split.
  shards = layer_graph.graph.get("param_shards") if how == "model" else None
  # Tensor parallelism by the model's specs (``runtime.compile.tensor_parallel``): a layer
  # split over n devices of the stage's row computes 1/n of its work on each, and all-reduces
  # its output in the forward (row-parallel) or its input cotangent in the backward
  # (column-parallel) over the row's link.
  tp = layer_graph.graph.get("tensor_parallel") if how == "model" else None
  uniform = not has_mixed_microbatches(plan)
  for s in plan.stages:
    idx, params, saved, frac = _stage_terms(costs, s.layers)
    mb = plan_microbatch(plan, s, uniform)
    # A stage that narrows the mesh (``Stage.inner``) runs each row as q rows of its own: q
    # times the data parallelism, 1/q of the tensor parallelism (``stage_narrowing``).
    q = stage_narrowing(layer_graph, s)
    dp = len(s.devices) * q
    if shards:
      held = [shards[l] for l in s.layers if l in shards]
      params = (
        params
        - sum(h[0] for h in held)
        + sum(min(h[0], h[1] * q) + h[2] / len(s.devices) for h in held)
      )
    key = (s.layers, mb, dp)
    tt = times.get(key)
    if tt is None:
      tt = times[key] = cm.stage_time(costs, idx, device, mb, dp)
    if fsdp and dp > 1:
      # FSDP (ZeRO-3): layer by layer, each micro-batch's forward and backward gather the
      # layer's parameters in the dtype it computes in, the next layer's while this one
      # computes, and the backward reduce-scatters each layer's gradients while the layers
      # before it compute (``fsdp_stage_times``); each device updates and keeps 1/dp.
      link = cluster.group_link(s.devices)
      fkey = ("fsdp", s.layers, mb, dp, link)
      ft = times.get(fkey)
      if ft is None:
        ft = times[fkey] = fsdp_stage_times(cm, costs, device, idx, mb / dp, dp, link)
      fw.append(ft[0])
      bw.append(ft[1])
      up.append(cm.update_time(params / dp, device, 1, link))
      stat.append(cm.static_memory(params) / dp)
    else:
      f, b = tt
      if tp and any(l in tp for l in s.layers):
        f, b = _tensor_parallel_times(
          cm, costs, device, tp, s.layers, mb / dp, cluster, (f, b), narrowing=q
        )
      fw.append(f)
      bw.append(b)
      up.append(cm.update_time(params, device, dp, cluster.group_link(s.devices)))
      stat.append(cm.static_memory(params))
    if costs.memory is not None and not (fsdp and dp > 1):
      # A captured step: what its program holds (``step_memory_terms``).
      one = len(s.devices) == 1 and _row_width(layer_graph, s) == 1
      total = float(plan.batch_size) if plan.batch_size else mb * plan.num_microbatches
      call = _one_call(costs, plan)
      flight = float(s.in_flight or 1)
      holding = HeldStage(s.layers, params, mb, dp, one, total, call, flight)
      fixed, per_mb = _held_memory(cm, costs, holding)
      stat[-1] = fixed
      act.append(per_mb)
    else:
      act.append(cm.activation_memory(saved, mb, dp, 1))
    mbs.append(mb)
    wfrac.append(frac)
    pbytes.append(params)
  partition = tuple(s.layers for s in plan.stages)
  edges = costs._stage_edges.get(partition)
  if edges is None:
    stage_of = [0] * len(costs)
    for s in plan.stages:
      for l in s.layers:
        stage_of[costs.index[l]] = s.index
    edges = costs._stage_edges[partition] = stage_edges(costs, stage_of)
  edge_bytes, edge_arrays = edges
  xfer, back = {}, {}
  for i, j in plan.edges:
    link = cluster.link_between(plan.stages[i].devices, plan.stages[j].devices)
    # An activation moves per micro-batch of its producer, a cotangent per one of its consumer.
    xfer[(i, j)] = cm.transfer_time(edge_bytes.get((i, j), 0.0) * mbs[i], link)
    back[(i, j)] = cm.transfer_time(edge_bytes.get((i, j), 0.0) * mbs[j], link)
  return PlanCosts(
    forward=tuple(fw),
    backward=tuple(bw),
    update=tuple(up),
    activation_transfer=xfer,
    cotangent_transfer=back,
    static_memory=tuple(stat),
    activation_memory=tuple(act),
    microbatch=tuple(mbs),
    weight_fraction=tuple(wfrac),
    param_bytes=tuple(pbytes),
    edge_arrays={e: edge_arrays.get(e, 1) for e in plan.edges},
  )


def memory_terms(
  plan,
  layer_graph: nx.DiGraph,
  cluster: Cluster,
  cost_model: CostModel | None = None,
  costs: LayerCosts | None = None,
) -> list[tuple[dict[str, float], dict[str, float]]]:
  """Per stage, the cost model's memory per device by term: (what it holds for the whole step,
  what it holds per micro-batch in flight); their sums are ``plan_costs``' static and
  activation memory, and the simulator's stage memory is the first plus the micro-batches it
  holds at once times the second."""
  cm = cost_model or DEFAULT_COST_MODEL
  costs = costs or layer_costs(layer_graph)
  pc = plan_costs(plan, layer_graph, cluster, cm, costs)
  fsdp = getattr(plan, "param_sharding", "model") == "fsdp"
  out = []
  for s in range(plan.num_stages):
    stage = plan.stages[s]
    p = pc.param_bytes[s]
    dp = len(stage.devices) * stage_narrowing(layer_graph, stage)
    if costs.memory is not None and not (fsdp and dp > 1):
      one = len(stage.devices) == 1 and _row_width(layer_graph, stage) == 1
      mb = pc.microbatch[s]
      total = float(plan.batch_size) if plan.batch_size else mb * plan.num_microbatches
      call = _one_call(costs, plan)
      flight = float(stage.in_flight or 1)
      holding = HeldStage(stage.layers, p, mb, dp, one, total, call, flight)
      out.append(step_memory_terms(cm, costs, holding))
      continue
    fixed = {
      "parameters": p,
      "gradients": cm.gradient_factor * p,
      "optimizer state": cm.optimizer_state_factor * p,
    }
    total = sum(fixed.values())
    if total > 0:  # FSDP keeps 1/dp of them
      fixed = {k: v * pc.static_memory[s] / total for k, v in fixed.items()}
    out.append((fixed, {"stashed activations": pc.activation_memory[s]}))
  return out


def stage_narrowing(layer_graph: nx.DiGraph, stage: Any) -> int:
  """How many rows of its own each mesh row becomes in ``stage``: the product of the mesh's
  axes after the first (the layer graph's ``mesh`` attribute, ``runtime.sharding.mesh_facts``)
  over the stage's (``Stage.inner``); 1 where the stage keeps the mesh's shape. A tensor-
  parallel layer then splits over 1/q as many devices (exact for one axis after the first,
  as (data, model) meshes have; an estimate with several)."""
  inner = getattr(stage, "inner", None)
  mesh = layer_graph.graph.get("mesh")
  if inner is None or not mesh:
    return 1
  return max(1, math.prod(mesh["inner"]) // math.prod(inner))


def _tensor_parallel_times(
  cm: CostModel,
  costs: LayerCosts,
  device: DeviceSpec,
  tp: Mapping[str, tuple[int, float, float]],
  layers: Sequence[str],
  samples: float,
  cluster: Any,
  times: tuple[float, float],
  narrowing: int = 1,
) -> tuple[float, float]:
  """A stage's (forward, backward) seconds with its tensor-parallel layers split (``tp``),
  over 1/``narrowing`` of the devices the mesh splits them over (``stage_narrowing``)."""
  tf, tb = cm.layer_times(costs, device, samples)
  f, b = times
  link = cluster.intra_link
  for l in layers:
    t = tp.get(l)
    if t is None:
      continue
    n, out_ps, in_ps = t
    n = max(1, n // narrowing)
    if n == 1:
      continue
    i = costs.index[l]
    f -= float(tf[i]) * (1 - 1 / n)
    b -= float(tb[i]) * (1 - 1 / n)
    f += cm.allreduce_time(out_ps * samples, n, link)
    b += cm.allreduce_time(in_ps * samples, n, link)
  return f, b


def describe_costs(pc: PlanCosts) -> str:
  """A readable table of a PlanCosts."""
  rows = [
    f"{'stage':>5s} {'mb':>6s} {'fwd ms':>9s} {'bwd ms':>9s} {'upd ms':>9s} "
    f"{'static MiB':>11s} {'act/mb MiB':>11s}"
  ]
  for i in range(len(pc.forward)):
    rows.append(
      f"{i:5d} {pc.microbatch[i]:6g} {pc.forward[i] * 1e3:9.3f} "
      f"{pc.backward[i] * 1e3:9.3f} {pc.update[i] * 1e3:9.3f} "
      f"{pc.static_memory[i] / 2**20:11.1f} {pc.activation_memory[i] / 2**20:11.2f}"
    )
  for (i, j), t in sorted(pc.activation_transfer.items()):
    rows.append(f"  edge {i}->{j}: {t * 1e3:.3f} ms per micro-batch each way")
  return "\n".join(rows)
