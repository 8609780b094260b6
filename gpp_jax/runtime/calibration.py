"""Calibration (``calibrate=True``): this machine measured, and the cost model fitted to it.

Measured: the layers and the step's update on a device (``calibrate``), the layers at each
width a stage may take (``calibrate_widths``), the host's costs of driving the devices
(``probe_host``). Fitted to the timing trials of one-stage steps (which ``runtime.choice``
takes, ``Timed``) by the predictions for this machine (``Predictor``): the fusion of the whole
step in one program (``calibrate_fusion``) and the model's own SPMD factor
(``calibrate_spmd``), each with the fixed seconds a micro-batch pays where two trials tell
them apart (``_fitted_apart``), into the machine's ``cost.calibration.MachineCalibration``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import networkx as nx
import numpy as np
from absl import logging

from gpp_jax.cost.calibration import MachineCalibration
from gpp_jax.cost.cluster import Link, process_blocks
from gpp_jax.cost.host import HostCosts
from gpp_jax.ir import layer_graph as lg
from gpp_jax.ir.plan import Plan
from gpp_jax.passes.calibrate import Calibration, measure_layers, measure_update
from gpp_jax.runtime.captured import Captured
from gpp_jax.runtime.options import Options
from gpp_jax.runtime.placement import StagePlacement
from gpp_jax.runtime.planning import planner_cluster, predict_seconds
from gpp_jax.runtime.processes import exchange


def calibrate(captured: Captured, opts: Options) -> Calibration:
  """Times the layers, and the step's work after them (the optimizer update, ``measure_update``),
  on this process's first device of the pipeline; with several processes, every process takes
  process 0's numbers so that all plan alike."""
  here = jax.process_index()
  device = next((d for d in opts.devices if d.process_index == here), jax.local_devices()[0])
  lay = captured.layering
  cal = measure_layers(captured.loss, lay, device)
  param_bytes = sum(d["param_bytes"] for _, d in lay.graph.nodes(data=True))
  if param_bytes > 0:  # the step's own optimizer update, per parameter byte
    try:
      update = measure_update(captured.step, captured.marker_index, device) / param_bytes
    except Exception as e:  # the cost model's guess then; the step itself is not at stake
      logging.warning("graph_pipeline: the step's update could not be timed (%s)", e)
    else:
      cal = dataclasses.replace(cal, settings={**cal.settings, "update_per_byte": update})
  if jax.process_count() == 1:
    return cal
  first = Calibration.from_json(exchange("calibration", cal.to_json(), opts.timeout_s)[0])
  return dataclasses.replace(first, device=f"{first.device} on process 0")


def calibrate_widths(
  captured: Captured,
  graph: nx.DiGraph,
  host: HostCosts | MachineCalibration | None,
  groups: Iterable[Sequence[Any]],
) -> nx.DiGraph:
  """``graph`` with its layers also timed as a stage over k devices runs them, for the width
  k > 1 of each of ``groups`` (devices: ``width_groups``) not yet measured (``measure_layers
  (placement=)``, on the first group of that width; ``Calibration.apply(width=)``): the
  simulator then takes those times for such stages (``cost.simulator.measured_width_times``)
  instead of the host's SPMD factor. Only on CPU devices of one process, where the host
  measured the factor: devices that share a host's cores pay per op, per device and per
  collective what no small probe tells (medium MMT's stages over 4 of 8 forced CPU devices
  measured 2.3-2.7x the factor's time, the layers timed this way added up to within 10% of
  them: BUILD_NOTES.md, "The simulator and the cost model"). A width that does not divide
  the micro-batch is left out. ``captured`` must be the capture ``graph`` was made from (its
  micro-batch is the graph's batch: the times are kept as measured)."""
  if host is None or not host.spmd or jax.process_count() > 1:
    return graph
  mb = captured.microbatch_size
  by_width: dict[int, tuple[Any, ...]] = {}
  for group in groups:
    devs = tuple(group)
    if len(devs) > 1 and mb % len(devs) == 0 and devs[0].platform == "cpu":
      by_width.setdefault(len(devs), devs)
  lay = captured.layering
  for k, devs in sorted(by_width.items()):
    if k in lg.widths_measured(graph, graph.nodes):
      continue
    if mb != graph.graph["batch_size"]:
      raise ValueError(
        f"calibrate_widths: the step was captured at micro-batch {mb} but the layer graph "
        f"is at {graph.graph['batch_size']}; pass the capture the graph was made from"
      )
    cal = measure_layers(captured.loss, lay, devs[0], placement=StagePlacement(devs, mb))
    graph = cal.apply(graph, width=k)
  return graph


def width_groups(
  devices: Sequence[Any], plans: Iterable[Plan] = (), widths: Iterable[int] = ()
) -> list[tuple[Any, ...]]:
  """The groups of ``devices`` whose widths ``calibrate_widths`` times: the devices of each
  stage of a pipeline among ``plans`` (``devices``: what the plans' device numbers index),
  then the first k of ``devices`` for each k of ``widths`` (those there are)."""
  stages = [tuple(s.devices) for p in plans if p.num_stages > 1 for s in p.stages]
  firsts = [tuple(range(k)) for k in widths if k <= len(devices)]
  return [tuple(devices[d] for d in ds) for ds in stages + firsts]


def stage_widths(num_devices: int, microbatch: int) -> list[int]:
  """The widths a stage of a pipeline over ``num_devices`` devices may take beyond one
  device: those that leave a device for another stage and split the micro-batch evenly."""
  return [k for k in range(2, num_devices) if microbatch % k == 0]


def probe_host(opts: Options) -> HostCosts | None:
  """The host's costs of driving ``opts.devices`` (``opts.host_probe``). With several
  processes, each holding an equal block of the devices in order, each probes its own block
  (its issuing thread's costs) and all take process 0's numbers, so that all plan alike
  (``HostCosts.processes``); how many device computations run at full speed at once is
  measured across the processes (``runtime.host.measure_parallel_across``: processes on one
  machine share its cores). Devices spread over the processes otherwise leave the host out
  (None: the planner's plan is kept)."""
  assert opts.host_probe is not None
  P, here = jax.process_count(), jax.process_index()
  if P == 1:
    return opts.host_probe(opts.devices)
  owners = [d.process_index for d in opts.devices]
  per = process_blocks(owners)
  if per is None or owners[::per] != list(range(P)):  # block k: process k's devices
    logging.info(
      "graph_pipeline: the devices are not in equal blocks per process (process of each: "
      "%s), so the host's costs are left out of the choice of plan",
      owners,
    )
    return None
  from gpp_jax.runtime.host import measure_link_across, measure_parallel_across

  mine = opts.host_probe([d for d in opts.devices if d.process_index == here])
  first = HostCosts.from_json(exchange("host", mine.to_json(), opts.timeout_s)[0])
  parallel = first.parallel
  if parallel is not None:  # CPU devices
    parallel = measure_parallel_across(opts.devices, opts.timeout_s)
  # Measured where every process can send to the others (JAX's cross-host transfers need a
  # socket address per process: ``initialize(transfer_address=)``); else the cluster's link.
  address = getattr(jax.config, "values", {}).get("jax_cross_host_transfer_socket_address")
  can = exchange("transfers", "1" if address else "0", opts.timeout_s)
  link = measure_link_across(opts.devices, opts.timeout_s) if "0" not in can else None
  return dataclasses.replace(first, processes=P, parallel=parallel, cross_link=link)


def with_measured_link(opts: Options, host: HostCosts | None) -> Options:
  """``opts`` whose cluster's link between nodes (processes) is the one measured
  (``HostCosts.cross_link``), where there is both."""
  if host is None or host.cross_link is None:
    return opts
  cluster = planner_cluster(opts)
  if cluster.inter_link is None:
    return opts
  alpha, beta = host.cross_link
  link = Link(alpha=alpha, beta=beta, name="cross-process, measured")
  return dataclasses.replace(opts, cluster=cluster.replace(inter_link=link))


@dataclasses.dataclass(frozen=True)
class Timed:
  """A one-stage plan's step, compiled and timed by a trial (``runtime.choice``).

  Attributes:
    plan: the plan timed.
    seconds: seconds per call of its compiled step (the host's time outside it not included).
  """

  plan: Plan
  seconds: float


@dataclasses.dataclass(frozen=True)
class Predictor:
  """What the fits match the trials with: a plan's seconds per step on a machine
  (``predict_seconds``) over ``graph``, the layer graph at the step's batch, on ``cluster``."""

  graph: nx.DiGraph
  cluster: Any

  def seconds(self, plan: Plan, machine: MachineCalibration) -> float:
    """``plan``'s predicted seconds per step on ``machine``."""
    return predict_seconds(plan, self.graph, self.cluster, machine)[0]


FUSION_FLOOR = 0.05  # the smallest fusion fitted: the compute keeps 5% of the layers' sum


def calibrate_fusion(
  predictor: Predictor,
  machine: MachineCalibration,
  plain: Timed,
  pieces: Timed | None = None,
) -> MachineCalibration:
  """``machine`` with its ``fusion``: the factor by which the layer times scale so that
  plain jit's prediction (``plain.plan``) equals its measured ``plain.seconds`` per call of its
  compiled step plus the host's time outside the step, which the trial leaves out
  (``predict_seconds`` applies it to one-stage plans; the host's issue and the update are not
  scaled). The compute keeps at least 5% of the layers' sum.

  ``pieces``: the same step on the same device in M > 1 micro-batches (gradient
  accumulation), timed too. A micro-batch of the step's loop pays what does not shrink with
  it (each backward's gradients of the whole parameters, added to the sum; the loop's own
  work): plain jit's fusion alone priced medium CANDLE-Uno's step in 4 micro-batches at -43%
  of its measurement. The two timings fit the fusion and those fixed seconds per micro-batch
  (``MachineCalibration.model_call[1]``, ``cost.simulator.spmd_call`` of one device) each on
  its own (``_fitted_apart``; where the seconds come out negative, the fusion alone, as
  without ``pieces``)."""
  if pieces is not None:

    def set_both(m: MachineCalibration, factor: float, call: float) -> MachineCalibration:
      return m.with_fusion(factor, call)

    both = _fitted_apart(predictor, machine, (plain, pieces), set_both, FUSION_FLOOR)
    if both is not None:
      return both

  def set_fusion(m: MachineCalibration, f: float) -> MachineCalibration:
    return m.with_fusion(f)

  return _calibrated(predictor, machine, plain, set_fusion, FUSION_FLOOR)


SPMD_FLOOR = 0.25  # the smallest SPMD factor fitted: a quarter of perfect division


def calibrate_spmd(
  predictor: Predictor,
  machine: MachineCalibration,
  timed: Timed,
  pieces: Timed | None = None,
) -> MachineCalibration:
  """``machine`` with the model's own step over k devices (the one-stage ``timed.plan``,
  timed: ``timed.seconds`` per call, to which the host's time outside the step adds):
  ``MachineCalibration.model_spmd[k]`` and ``model_call[k]``, the SPMD factor and the fixed
  seconds of one computation over k devices (``cost.simulator.spmd_factor`` and
  ``spmd_call``), both the host's probe's times one ratio r, the r at which the plan's
  prediction is the measurement. One timing cannot tell a fixed cost from a proportional one;
  the probe's split holds for the model roughly: tiny DLRM and MMT on 4 forced CPU devices,
  whose steps there measured 3x and 5.5x what the probe's fit says, paid 3x and 5.7x the
  probe's fixed seconds for each further micro-batch of a step. Where the probe has no factor
  for k, the factor alone is fitted (the probe's seconds as they are). The factor is at least
  a quarter (a quarter of perfect division is beyond any machine's).

  ``pieces``: the same step over the same devices in M > 1 micro-batches, timed too. Two
  timings tell the two apart: the factor and the fixed seconds are fitted each on its own so
  that both predictions are their measurements (the ratio above put tiny DLRM's step in 4
  micro-batches at +57% of its measurement, MMT's at -31%), ``_fitted_apart`` (where the
  seconds come out negative, the ratio, as without ``pieces``)."""
  k = len(timed.plan.stages[0].devices)
  probe, call = machine.spmd_factor(k), machine.spmd_call_seconds(k)
  if pieces is not None:

    def set_both(m: MachineCalibration, factor: float, seconds: float) -> MachineCalibration:
      return m.with_width(k, factor, seconds)

    both = _fitted_apart(predictor, machine, (timed, pieces), set_both, SPMD_FLOOR)
    if both is not None:
      return both

  def set_spmd(m: MachineCalibration, r: float) -> MachineCalibration:
    return m.with_width(k, r * probe if probe else r, r * call if probe else None)

  floor = SPMD_FLOOR / probe if probe else SPMD_FLOOR
  return _calibrated(predictor, machine, timed, set_spmd, floor)


def _fitted_apart(
  predictor: Predictor,
  machine: MachineCalibration,
  timed: Sequence[Timed],
  set_both: Callable[[MachineCalibration, float, float], MachineCalibration],
  floor: float,
) -> MachineCalibration | None:
  """``machine`` with a factor and the fixed seconds per computation (``set_both``: the SPMD
  factor over k devices, or the fusion on one) at which the predictions of the two one-stage
  plans ``timed`` (over the same devices, different micro-batch counts) are their seconds
  plus the host's time outside the step. A prediction is linear in both, so three
  predictions of each plan solve it. Where that takes a factor under ``floor`` or negative
  seconds, the first plan's prediction (the one-call step, which ``choose_plan`` prices a
  faster step in micro-batches by) stays its measurement, and the second misses its own by
  the least that allows: a factor under the floor takes the floor and the fixed seconds that
  fit the first (the first's fit alone prices the second at about the first's time). None
  where the seconds come out negative (the caller then fits the first alone) or the two
  plans have the same micro-batch count."""
  rows, rhs = [], []
  for t in timed:
    at = [
      predictor.seconds(t.plan, set_both(machine, f, c))
      for f, c in ((0.0, 0.0), (1.0, 0.0), (0.0, 1.0))
    ]
    rows.append([at[1] - at[0], at[2] - at[0]])
    rhs.append(t.seconds + machine.outside - at[0])
  try:
    factor, call = np.linalg.solve(np.array(rows), np.array(rhs))
  except np.linalg.LinAlgError:  # the same micro-batch count twice
    return None
  if call < 0.0:
    return None
  if factor < floor:
    # Along the fits that keep the first prediction its measurement, the second's miss grows
    # with the distance from the exact fit: the nearest within the floor.
    (a, b), r = rows[0], rhs[0]
    factor, call = floor, (r - a * floor) / b if b > 0 else -1.0
    if call < 0.0:
      return None
  return set_both(machine, float(factor), float(call))


def _calibrated(
  predictor: Predictor,
  machine: MachineCalibration,
  timed: Timed,
  set_factor: Callable[[MachineCalibration, float], MachineCalibration],
  floor: float,
) -> MachineCalibration:
  """``machine`` with the factor ``f >= floor`` (``set_factor``) at which ``timed.plan``'s
  prediction is ``timed.seconds`` plus the host's time outside the step. The prediction is
  linear in the factor: two points solve it (``floor`` where it does not move with the
  factor)."""
  p0, p1 = (predictor.seconds(timed.plan, set_factor(machine, f)) for f in (0.0, 1.0))
  target = timed.seconds + machine.outside
  return set_factor(machine, max((target - p0) / (p1 - p0), floor) if p1 > p0 else floor)
