"""A plan's times as the simulator takes them (``plan_times``, ``PlanTimes``): its costs under
the cost model, or under the host-aware one (a stage over several devices at the SPMD factor,
``spmd_factor`` and ``spmd_call``, or at its layers' times measured over its width,
``measured_width_times``; the gradients' all-reduce and the update as the host prices them).
Also the seconds of each instruction of a compiled step's program (``step_durations``), the
channels transfers across nodes queue on (``nic_channels``), and a one-stage plan's step run
as one jitted function (``predict_fused``, ``fused_times``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import networkx as nx

from gpp_jax.cost.calibration import as_calibration
from gpp_jax.cost.cluster import Cluster
from gpp_jax.cost.cost_model import (
  DEFAULT_COST_MODEL,
  CostModel,
  LayerCosts,
  PlanCosts,
  layer_costs,
  plan_costs,
)
from gpp_jax.cost.stage_times import HostSide, StageTimes
from gpp_jax.ir.program import Op, Program
from gpp_jax.ir.schedule import Schedule


def split_backward(
  schedule: Schedule, backward: Sequence[float], weight_fraction: Sequence[float]
) -> tuple[list[float], list[float] | None]:
  """Per-stage (B, W) seconds: the whole backward and no W unless the schedule has W actions;
  then W is ``weight_fraction`` of the backward and B the rest."""
  if not schedule.splits_backward:
    return list(backward), None
  weight = [b * f for b, f in zip(backward, weight_fraction)]
  return [b - w for b, w in zip(backward, weight)], weight


@dataclasses.dataclass(frozen=True)
class PlanTimes:
  """A plan's times, transfers and memory as the simulator takes them (``plan_times``): what
  ``passes.simulation.simulate`` times the plan's schedule (``simulate_times``) or its
  compiled step's program (``simulate_step``) with.

  Attributes:
    costs: the plan's costs (``plan_costs``); under the host-aware model with each stage's
      forward and backward seconds over its devices and its UPDATE seconds as the host prices
      them (``_spmd_times``, ``_host_updates``).
    stages: each stage's times, transfers and memory (``StageTimes``): the forward, update,
      transfers and stashed bytes of ``costs``; the backward and weight seconds of a B and of
      a W (``split_backward``: no W unless the schedule splits the backward), under the
      host-aware model with the gradients' all-reduce where each backward pays it; the static
      memory with the older versions of its weights a stale-weight schedule keeps; the
      devices of each stage.
    host: the host side (``HostSide``, without cores: the caller's): the channel each
      transfer between nodes queues on (``nic_channels``; None: each its own); the host's
      seconds per op (``HostCosts.lane_costs``, or what the caller gave; None: nothing issues
      the program); for a schedule's lowering, what a SEND along each stage edge costs to
      issue (``HostCosts.send_factors``), for a compiled step's program, its puts together
      (``HostCosts.send_extra``); the processes that issue each lane
      (``HostCosts.lane_processes``).
    outside: the host's seconds outside the program, added to the iteration time.
  """

  costs: PlanCosts
  stages: StageTimes
  host: HostSide
  outside: float


def plan_times(
  plan,
  layer_graph: nx.DiGraph,
  cluster: Cluster,
  schedule: Schedule,
  delays: Sequence[int] | None,
  *,
  cost_model: CostModel | None = None,
  costs: LayerCosts | None = None,
  shared_nic: bool = False,
  step: bool = False,
  host_cost: Mapping[Op, float] | None = None,
  host: Any = None,
) -> PlanTimes:
  """Plan + LayerGraph + Cluster + the plan's schedule -> the plan's ``PlanTimes``: its costs
  under the cost model, or under the host-aware one (``host``, the machine's ``cost.host
  .HostCosts``: a stage over k devices computes 1/k of its one-device time times the SPMD
  factor for k, ``spmd_factor``, or in its layers' times measured over k devices where the
  graph has them, ``measured_width_times``; the gradients' all-reduce and the update as
  ``_host_updates`` prices them; the host's issue costs per op, for the schedule's lowering or,
  with ``step``, for a compiled step's program, and its time outside the program).

  When the schedule has W actions, each stage's backward is split into B and W by the cost
  model's ``weight_fraction``. ``delays``: per stage, the older versions of its weights the
  schedule keeps (a stale-weight schedule's ``passes.weight_versions.weight_delays``; None
  for a synchronous one), counted in its static memory. ``shared_nic=True`` makes the
  transfers that cross nodes into one node queue on that node's one inbound interface
  (``nic_channels``). ``host_cost``: the host's seconds per op without a ``host``."""
  if schedule.num_stages != plan.num_stages:
    raise ValueError(
      f"the schedule has {schedule.num_stages} stages but the plan "
      f"{plan.num_stages}; build the schedule from this plan"
    )
  costs = costs or layer_costs(layer_graph)
  pc = plan_costs(plan, layer_graph, cluster, cost_model, costs)
  outside = 0.0
  processes = None
  wide: dict[int, tuple[float, float]] = {}
  if host is not None:
    processes = host.lane_processes([s.devices for s in plan.stages], cluster.num_devices)
    host_cost = host.lane_costs([len(s.devices) for s in plan.stages], schedule=not step)
    outside = host.outside
    wide = measured_width_times(plan, layer_graph, cluster, cost_model, costs)
    priced = PricedPlan(plan, layer_graph, cluster, cost_model, costs)
    fw, bw = _spmd_times(priced, pc, host, wide=wide)
    pc = dataclasses.replace(pc, forward=fw, backward=bw)
  backward, weight = split_backward(schedule, pc.backward, pc.weight_fraction)
  if host is not None:  # the gradients' all-reduce in each backward; the step's own update
    # Stages whose rows sum their own gradients reduce them once, in the UPDATE
    # (``passes.staging.row_local_functions``; not where the backward is split).
    once = bool(layer_graph.graph.get("reduce_once")) and weight is None
    per_call, update = _host_updates(priced, pc, host, wide, reduce_once=once)
    grads = weight if weight is not None else backward
    for i, t in enumerate(per_call):
      grads[i] += t
    pc = dataclasses.replace(pc, update=update)
  static = list(pc.static_memory)
  if delays is not None:
    static = [m + d * p for m, d, p in zip(static, delays, pc.param_bytes)]
  stages = StageTimes(
    forward=pc.forward,
    backward=backward,
    weight=weight,
    update=pc.update,
    activation_transfer=pc.activation_transfer,
    cotangent_transfer=pc.cotangent_transfer,
    static_memory=static,
    activation_memory=pc.activation_memory,
    stage_devices=[s.devices for s in plan.stages],
  )
  issue = HostSide(
    dispatch=host_cost,
    send_factors=host.send_factors(pc.edge_arrays) if host is not None and not step else None,
    send_extra=host.send_extra if host is not None and step else None,
    channels=nic_channels(plan, cluster) if shared_nic else None,
    processes=processes,
  )
  return PlanTimes(costs=pc, stages=stages, host=issue, outside=outside)


def _model_or_probe(
  timed: Mapping[int, float],
  k: int,
  probe_at: Callable[[int], float | None],
  like_model: bool,
  floor: float,
) -> float | None:
  """What a computation over ``k`` devices costs by a measure the trials fitted per width
  (``timed``: ``MachineCalibration.model_spmd`` or ``model_call``): the model's own where the
  trial timed its step over ``k`` devices, else the host's probe (``probe_at(k)``); with
  ``like_model``, at a width the trial did not time, the probe's value times the model's own
  over the probe's at the widest width the trial timed (at least ``floor``)."""
  own = timed.get(k)
  if own is not None:
    return float(own)
  probe = probe_at(k)
  wide = [x for x in timed if x > 1]  # one device's is no SPMD measure
  if not like_model or probe is None or not wide:
    return probe
  w = max(wide)
  at_w = probe_at(w)
  return max(floor, probe * float(timed[w]) / at_w) if at_w else probe


def spmd_factor(host: Any, k: int, like_model: bool = False) -> float | None:
  """The SPMD factor of a computation over ``k`` devices on the machine ``host`` (a
  ``HostCosts``, or a ``MachineCalibration``: ``cost.calibration``): the model's own where its
  step over ``k`` devices was timed (``MachineCalibration.model_spmd``, fitted to the training
  program's trial of jit data parallel), else the host's probe (``HostCosts.spmd_factor``);
  None where neither says. ``like_model`` (a whole step over k devices, as the trial's): at a
  width the trial did not time, the probe's factor times the model's own over the probe's at
  the widest width the trial timed, at least 1 (tiny MMT on 4 forced CPU devices: 7.1 against
  the probe's 2.2, so its step over 2 devices, which the probe puts at 1.4, measured twice
  plain jit's time)."""
  if host is None:
    return None
  own = as_calibration(host).model_spmd
  return _model_or_probe(own, k, host.spmd_factor, like_model, 1.0)


def spmd_call(host: Any, k: int, like_model: bool = False) -> float:
  """The fixed seconds of one computation over ``k`` devices, whatever its size, on the
  machine ``host`` (as ``spmd_factor`` takes it): the model's own where its step over ``k``
  devices was timed (``MachineCalibration.model_call``, fitted with its factor to the trial of
  jit data parallel, and for one device with the fusion to the trials of plain jit and the
  step in micro-batches, ``runtime.calibration.calibrate_fusion``), else the host's probe
  (``HostCosts.spmd_call_seconds``; 0 for one device, without a host or where not measured);
  ``like_model`` as ``spmd_factor`` takes it."""
  if host is None:
    return 0.0
  own = as_calibration(host).model_call
  if k <= 1:
    return float(own.get(1, 0.0))
  v = _model_or_probe(own, k, host.spmd_call_seconds, like_model, 0.0)
  return 0.0 if v is None else v


def _narrow(plan):
  """``plan`` with every stage on its first device only."""
  return plan.replace(
    stages=tuple(dataclasses.replace(s, devices=s.devices[:1]) for s in plan.stages)
  )


def measured_width_times(
  plan,
  layer_graph: nx.DiGraph,
  cluster: Cluster,
  cost_model: Any = None,
  costs: LayerCosts | None = None,
) -> dict[int, tuple[float, float]]:
  """Per stage over k > 1 devices whose layers were all timed as a stage over k devices runs
  them (``ir.layer_graph.widths_measured``, ``runtime.compile.calibrate_widths``): its
  (forward, backward) seconds per micro-batch, those times summed and scaled to its
  micro-batch as one-device times are (``plan_costs`` of ``LayerCosts.at_width``; ``costs``,
  the graph's, keeps them between calls). They hold what the layers pay over k devices (the
  split work, the devices' sharing of the host's cores, each op's cost on every device, the
  gradients' all-reduce in the backward), which the SPMD factor only guesses. A layer timed
  alone paid an all-reduce of its own; the times leave its fixed seconds out, and a stage with
  parameters pays them once per backward (``graph.graph["allreduce_call_at"]``, measured with
  the layers: XLA combines a stage's all-reduces into one)."""
  costs = costs or layer_costs(layer_graph)
  if not costs.time_at:
    return {}
  by_width: dict[int, list[int]] = {}
  for s in plan.stages:
    k = len(s.devices)
    if k > 1 and costs.timed_at(k, [costs.index[n] for n in s.layers]):
      by_width.setdefault(k, []).append(s.index)
  out: dict[int, tuple[float, float]] = {}
  allreduce = layer_graph.graph.get("allreduce_call_at", {})
  for k, stages in by_width.items():
    pc = plan_costs(_narrow(plan), layer_graph, cluster, cost_model, costs.at_width(k))
    once = float(allreduce.get(str(k), 0.0))
    for i in stages:
      out[i] = (float(pc.forward[i]), float(pc.backward[i]) + (once if pc.param_bytes[i] else 0.0))
  return out


@dataclasses.dataclass(frozen=True)
class PricedPlan:
  """A plan and what the cost model prices it with (``plan_costs``' arguments).

  Attributes:
    plan: the plan.
    layer_graph: the LayerGraph it cuts, at its batch.
    cluster: the machine's devices and links.
    cost_model: the cost model (None: the default one).
    costs: the graph's layer costs (``layer_costs``), kept between calls; None: the graph's.
  """

  plan: Any
  layer_graph: nx.DiGraph
  cluster: Cluster
  cost_model: CostModel | None = None
  costs: LayerCosts | None = None

  def price(self, narrow: bool = False) -> PlanCosts:
    """The plan's costs (``plan_costs``); ``narrow``: with every stage on its first device
    only (``_narrow``)."""
    plan = _narrow(self.plan) if narrow else self.plan
    return plan_costs(plan, self.layer_graph, self.cluster, self.cost_model, self.costs)


def _spmd_times(
  priced: PricedPlan,
  pc: Any,
  host: Any,
  wide: Mapping[int, tuple[float, float]] | None = None,
  fused: bool = False,
) -> tuple[tuple[float, ...], tuple[float, ...]]:
  """Per stage (forward, backward) seconds under the host-aware model: a stage in ``wide``
  (``measured_width_times``) takes its measured times; another stage over k > 1 devices
  computes 1/k of its micro-batch's one-device time times the SPMD factor for k
  (``spmd_factor``, measured against that same 1/k: it includes the devices' smaller shares
  and their sharing of the cores), and each of its forwards and backwards, one sharded call
  each, pays the host's fixed seconds per call over k devices (``HostCosts
  .spmd_call_seconds``); other stages, and widths not measured, as ``pc`` has them (the cost
  model's time of each device's share). ``fused``: the plan's one stage is a whole step like
  the trial's (``predict_fused``): the SPMD factor ``like_model`` (``spmd_factor``), and the
  fixed seconds left out (the caller pays them per micro-batch)."""
  plan = priced.plan
  wide = wide or {}
  factors = {
    s.index: spmd_factor(host, len(s.devices), like_model=fused)
    for s in plan.stages
    if len(s.devices) > 1 and s.index not in wide
  }
  factors = {i: f for i, f in factors.items() if f is not None}
  if not factors and not wide:
    return tuple(pc.forward), tuple(pc.backward)
  fw, bw = list(pc.forward), list(pc.backward)
  for i, (tf, tb) in wide.items():
    fw[i], bw[i] = tf, tb
  if not factors:
    return tuple(fw), tuple(bw)
  one = priced.price(narrow=True)
  for i, f in factors.items():
    k = len(plan.stages[i].devices)
    call = 0.0 if fused else host.spmd_call_seconds(k)
    fw[i] = one.forward[i] / k * f + call
    bw[i] = one.backward[i] / k * f + call
  return tuple(fw), tuple(bw)


def _host_updates(
  priced: PricedPlan,
  pc: Any,
  host: Any,
  inside: Collection[int] = (),
  reduce_once: bool = False,
) -> tuple[list[float], tuple[float, ...]]:
  """Per stage, under the host-aware model: the seconds each of its backward calls pays for
  all-reducing its gradients, and its UPDATE seconds.

  Where the host measured what the all-reduce costs (``HostCosts.allreduce``), a stage over
  k > 1 devices pays it in every backward (the executor's stage all-reduces its gradients in
  each, ``runtime.placement.StagePlacement``) and its UPDATE leaves out the cost model's
  all-reduce once per step; a stage in ``inside`` (its backward's measured time holds the
  all-reduce, ``measured_width_times``) pays nothing more in the backward and none in the
  UPDATE either; other stages keep the all-reduce in the UPDATE. The update itself is the
  step's own, timed (``layer_graph.graph["update_per_byte"]``, ``passes.calibrate
  .measure_update``), where measured, else the cost model's. Without either measurement these
  are ``pc``'s UPDATE seconds and no all-reduce in the backward. Zeroing the stage's gradient
  sums, once per step (the program's ZERO), is paid with the UPDATE where the layers' timing
  measured it (``layer_graph.graph["zero_per_byte"]``, seconds per parameter byte).
  ``reduce_once``: stages whose rows sum their own gradients pay the all-reduce once, with
  the UPDATE."""
  cm = priced.cost_model or DEFAULT_COST_MODEL
  cluster, graph = priced.cluster, priced.layer_graph.graph
  per_byte = graph.get("update_per_byte")
  zero = float(graph.get("zero_per_byte", 0.0))
  per_call: list[float] = []
  update: list[float] = []
  for s in priced.plan.stages:
    i, k, nbytes = s.index, len(s.devices), pc.param_bytes[s.index]
    if i in inside:
      t: float | None = 0.0
    else:
      t = host.allreduce_seconds(k, nbytes) if k > 1 and host.allreduce else None
    if t is not None and reduce_once and i not in inside:  # paid once, with the UPDATE
      link = cluster.group_link(s.devices)
      update.append(cm.update_time(nbytes, cluster.device, 1, link, per_byte) + t + zero * nbytes)
      per_call.append(0.0)
      continue
    per_call.append(0.0 if t is None else float(t))
    if t is None and per_byte is None:
      update.append(pc.update[i] + zero * nbytes)
      continue
    n = k if t is None else 1  # the all-reduce stays in the UPDATE, or is paid elsewhere
    link = cluster.group_link(s.devices)
    update.append(cm.update_time(nbytes, cluster.device, n, link, per_byte) + zero * nbytes)
  return per_call, tuple(update)


def predict_fused(
  plan,
  layer_graph: nx.DiGraph,
  cluster: Cluster,
  host: Any = None,
  cost_model: CostModel | None = None,
) -> float:
  """Seconds of a one-stage plan's step, run as one jitted function (``runtime.fused``): its M
  micro-batches' forwards and backwards (on k devices each computes 1/k of a micro-batch; with
  ``host``, 1/k of the one-device time times the SPMD factor for k, ``spmd_factor`` with
  ``like_model``: a step like the trial's, plus the fixed seconds of a computation over k
  devices, ``spmd_call`` with ``like_model``, per micro-batch: each micro-batch of the step's
  loop is a sharded computation of its own, with its collectives; where no factor is
  measured, the share's time times k over the devices that compute at once), the gradient
  all-reduce and update (where the host measured the all-reduce, ``HostCosts.allreduce``, it
  is paid by every micro-batch's backward instead; the update is the step's own where timed,
  ``_host_updates``), and the host's issue and time outside the step."""
  if plan.num_stages != 1:
    raise ValueError(f"predict_fused takes a one-stage plan, not {plan.num_stages} stages")
  priced = PricedPlan(plan, layer_graph, cluster, cost_model)
  pc = priced.price()
  k = len(plan.stages[0].devices)
  fw, bw, slowdown, call = pc.forward, pc.backward, 1.0, 0.0
  if host is not None and spmd_factor(host, k) is not None:
    fw, bw = _spmd_times(priced, pc, host, fused=True)
    call = spmd_call(host, k, like_model=True)
  elif host is not None and host.compute_servers():  # not measured: k over the servers
    slowdown = k / min(host.compute_servers(), k)
  update = pc.update[0]
  if host is not None:  # each micro-batch's backward all-reduces the gradients
    per_call, updates = _host_updates(priced, pc, host)
    call += per_call[0]
    update = updates[0]
  compute = plan.num_microbatches * ((fw[0] + bw[0]) * slowdown + call)
  issue = host.per_op.get("STEP", host.per_op.get("F", 0.0)) + host.outside if host else 0.0
  return compute + update + issue


def fused_times(layer_graph: nx.DiGraph, host: Any = None) -> nx.DiGraph:
  """``layer_graph`` with its layer times scaled by what XLA makes of the whole step where it
  was measured on the machine ``host`` (``MachineCalibration.fusion``, fitted by
  ``runtime.calibration.calibrate_fusion``): the times of a one-stage plan compiled as one
  program. Layers' times measured over several devices (``time_f_at`` / ``time_b_at``) are
  left as measured. The graph itself where none (no host, or a ``HostCosts`` alone)."""
  factor = as_calibration(host).fusion if host is not None else None
  if factor is None:
    return layer_graph
  out = layer_graph.copy()
  for n in out:
    for k in ("time_f", "time_b"):
      if out.nodes[n].get(k) is not None:
        out.nodes[n][k] = out.nodes[n][k] * factor
  return out


def step_durations(program: Program, plan, cluster: Cluster, times: PlanTimes) -> list[float]:
  """Seconds of each instruction of a compiled step's program under the cost model, from the
  plan's ``times`` (``plan_times``): F, B, W and UPDATE as for the schedule (the stages' B and
  W seconds, ``PlanTimes.stages``; the rest, ``PlanTimes.costs``); a SEND between stages its
  buffer's bytes over their link (nothing from the host lane, whose puts the device-only
  model leaves out); a fused step M forwards and backwards and the update (the plan's costs);
  the rest nothing."""
  pc = times.costs
  # Per stage, seconds of a B and of a W (``plan_times`` gives floats, one per stage).
  backward: Sequence[Any] = times.stages.backward
  weight: Sequence[Any] | None = times.stages.weight
  S = program.num_stages
  devs = [plan.stages[s].devices for s in range(min(S, plan.num_stages))]
  out = []
  for i in program.instrs:
    op = i.op
    if op is Op.F:
      out.append(float(pc.forward[i.stage]))
    elif op is Op.B:
      out.append(float(backward[i.stage]))
    elif op is Op.W:
      out.append(float(weight[i.stage]) if weight is not None else 0.0)
    elif op is Op.UPDATE:
      out.append(float(pc.update[i.stage]))
    elif op is Op.STEP:
      M = plan.num_microbatches
      out.append(M * float(pc.forward[0] + pc.backward[0]) + float(pc.update[0]))
    elif op is Op.SEND and i.lane < S and i.peer < S:
      nbytes = max(program.buffers[i.writes[0]].nbytes, 0)
      link = cluster.link_between(devs[i.lane], devs[i.peer])
      out.append(link.time(nbytes) if set(devs[i.lane]) != set(devs[i.peer]) else 0.0)
    else:
      out.append(0.0)
  return out


def nic_channels(plan, cluster: Cluster) -> dict[tuple[str, int, int], Any]:
  """Transfers between stages on different nodes -> the inbound interface of the receiving
  stage's node (its first device's), for ``cost.stage_times.HostSide.channels``."""
  out: dict[tuple[str, int, int], Any] = {}
  node = [cluster.node_of(s.devices[0]) if s.devices else 0 for s in plan.stages]
  for i, j in plan.edges:
    devs_i, devs_j = plan.stages[i].devices, plan.stages[j].devices
    if cluster.link_between(devs_i, devs_j) is cluster.intra_link:
      continue
    out[("activation", i, j)] = ("nic-in", node[j])
    out[("cotangent", j, i)] = ("nic-in", node[i])
  return out
