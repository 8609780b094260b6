"""The simulator's entry points: a plan, or a schedule with its stages' times -> SimResult.

The simulator (``cost.simulator``) times what it is given and builds nothing. What it is given
is built here, by the passes that build it: a plan's schedule (``passes.schedules
.plan_schedule``), the older versions of its weights a stale-weight schedule keeps
(``passes.weight_versions.weight_delays``), and a schedule's lowered program
(``passes.lowering.lower_schedule``) wherever the devices-only pass over the schedule's lanes
(``cost.simulator.simulate_lanes``) does not apply: a host issuing the program, cores shared,
channels shared, stages sharing devices, or lanes that deadlock (the lowering names the
deadlock). Planners, the training program and the runtime predict plans through these:

  simulate(plan, layer_graph, cluster, ...)  times, transfers and memory from the cost model;
  simulate_on_host(plan, layer_graph, cluster, host, ...)  the one prediction of a plan on the
      machine ``host`` measured;
  simulate_times(schedule, times, host)  a schedule timed with its stages' times
      (``StageTimes``: explicit per-stage or per-action times, so measured times can be
      replayed and compared with predictions action by action) on a host (``HostSide``).

The typed times (``cost.stage_times``), the results (``SimResult``), the timing of a lowered
program (``simulate_program``) and the Chrome / Perfetto traces stay in ``cost``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import networkx as nx

from gpp_jax.cost.cluster import Cluster
from gpp_jax.cost.cost_model import CostModel, LayerCosts
from gpp_jax.cost.simulator import (
  SimResult,
  fused_times,
  plan_times,
  predict_fused,
  simulate_lanes,
  simulate_lowered,
  simulate_step,
)
from gpp_jax.cost.stage_times import HostSide, StageMemory, StageTimes  # noqa: F401
from gpp_jax.ir.program import Op, Program
from gpp_jax.ir.schedule import Schedule
from gpp_jax.passes.lowering import lower_schedule
from gpp_jax.passes.schedules import plan_schedule
from gpp_jax.passes.weight_versions import weight_delays


@functools.lru_cache(maxsize=512)
def lowered_schedule(schedule: Schedule) -> Program:
  """``passes.lowering.lower_schedule``, kept for the schedules simulated again and again."""
  return lower_schedule(schedule)


def simulate_times(
  schedule: Schedule, times: StageTimes, host: HostSide | None = None, *, timeline: bool = True
) -> SimResult:
  """Schedule + its stages' times (``StageTimes``) + the host side (``HostSide``; None: the
  devices-only model) -> SimResult: the schedule's lowered program
  (``passes.lowering.lower_schedule``: one activation and one cotangent per stage edge and
  micro-batch) timed by ``cost.simulator.simulate_program`` (``simulate_lowered``). Without a
  host issuing it, cores or shared channels (``HostSide.devices_only``: the model the
  planners search with) the same times come from the schedule itself, without lowering it
  (``cost.simulator.simulate_lanes``, held equal to the program's by the tests).

  ``schedule``: the schedule to execute (validated by the caller or by its generator).
  ``timeline=False`` leaves the result's ``actions`` and ``transfers`` empty (the times,
  bubbles and memory are the same): what a planner needs of each of its candidates, without
  building thousands of records it does not read.
  """
  if (host is None or host.devices_only) and not schedule.shares_devices:
    res = simulate_lanes(schedule, times, timeline=timeline)
    if res is not None:  # else a deadlock: the program's lowering names it
      return res
  return simulate_lowered(schedule, lowered_schedule(schedule), times, host, timeline=timeline)


def simulate(
  plan,
  layer_graph: nx.DiGraph,
  cluster: Cluster,
  *,
  schedule: Schedule | None = None,
  cost_model: CostModel | None = None,
  costs: LayerCosts | None = None,
  shared_nic: bool = False,
  program: Program | None = None,
  host_cost: Mapping[Op, float] | None = None,
  cores: int | None = None,
  host: Any = None,
  timeline: bool = True,
) -> SimResult:
  """Plan + LayerGraph + Cluster -> SimResult, with times and memory from the cost model.

  ``program``: the lowered program of the compiled step (``GraphPipeline.program``, the one the
  executor runs) to time instead of the schedule's own lowering; each of its transfers between
  stages costs its bytes over the link between their devices, ``host_cost`` (the host's
  seconds per op) and ``cores`` (its compute servers) as ``simulate_program`` takes them in
  its ``HostSide``; memory is then the program's own (``cost.memory``: its
  buffers' sizes and lifetimes, without the executables' temporaries; ``cost.simulator
  .simulate_step``). ``host``: the machine's ``cost.host.HostCosts`` (per-op issue costs,
  compute servers, the time outside the program, added to the iteration time; a stage over k
  devices computes 1/k of its one-device time times the SPMD factor for k, ``spmd_factor``, or
  in its layers' times measured over k devices where the graph has them,
  ``measured_width_times``; the gradients' all-reduce and the update as ``_host_updates``
  prices them, all in ``cost.simulator.plan_times``; a fractional ``parallel`` interpolates the
  iteration time between its two whole neighbours); without a program the schedule's
  lowering is timed with them.

  ``schedule`` defaults to the plan's named schedule generator over its stage graph
  (``passes.schedules.plan_schedule``). When the schedule has W actions, each stage's backward
  is split into B and W by the cost model's ``weight_fraction``. Stages with their own
  micro-batch sizes take their action times and transfers at those sizes (``plan_costs``; the
  schedule's ``counts``). Under a stale-weight schedule (PipeDream async, 2BW) a stage's static
  memory includes the ``d(s)`` older versions of its weights it keeps
  (``passes.weight_versions.weight_delays``). By default every stage pair has a link of its
  own; ``shared_nic=True`` makes the transfers that cross nodes into one node (by the
  receiving stage's first device) queue on that node's one inbound interface
  (``nic_channels``). ``timeline=False`` leaves out the result's actions and transfers, as
  ``simulate_times`` does (without a program).
  """
  if schedule is None:
    schedule = plan_schedule(plan)
  times = plan_times(
    plan,
    layer_graph,
    cluster,
    schedule,
    weight_delays(schedule),
    cost_model=cost_model,
    costs=costs,
    shared_nic=shared_nic,
    step=program is not None,
    host_cost=host_cost,
    host=host,
  )

  def run(cores: int | None) -> SimResult:
    """The plan simulated with ``cores`` compute servers (``HostSide.cores``)."""
    on = (
      times
      if cores is None
      else dataclasses.replace(times, host=dataclasses.replace(times.host, cores=cores))
    )
    if program is not None:
      return simulate_step(program, plan, cluster, on, num_microbatches=schedule.num_microbatches)
    res = simulate_times(schedule, on.stages, on.host, timeline=timeline)
    if times.outside:
      res = dataclasses.replace(res, iteration_time=res.iteration_time + times.outside)
    return res

  if host is None:
    return run(cores)
  if host.parallel is not None:
    # A fractional number of computations at full speed at once (1.5: a second one runs
    # beside the first at about half speed) is between its two whole neighbours: the
    # iteration time is interpolated between them, the rest is the nearer one's. Rounding it
    # instead put a pipeline on one server or on two as probes measured 1.47 or 1.52.
    lo = math.floor(host.parallel)
    w = host.parallel - lo
    if lo >= 1 and w > 1e-9:
      below, above = run(lo), run(lo + 1)
      near = below if w < 0.5 else above
      t = (1 - w) * below.iteration_time + w * above.iteration_time
      return dataclasses.replace(near, iteration_time=t)
  return run(host.compute_servers())


def simulate_on_host(
  plan,
  layer_graph: nx.DiGraph,
  cluster: Cluster,
  host: Any,
  *,
  schedule: Schedule | None = None,
  cost_model: CostModel | None = None,
  costs: LayerCosts | None = None,
) -> SimResult:
  """The one prediction of ``plan`` on the machine ``host`` measured (``cost.host.HostCosts``):
  a pipeline is its schedule's program issued by the host (``simulate(host=)``), a one-stage
  plan runs as one jitted step (``cost.simulator.predict_fused``, its layer times scaled by the
  measured ``fusion``, ``fused_times``), whose time replaces the simulated iteration time;
  memory and bubbles are the simulation's. What the training program chooses among its
  candidates by, and what planners given a host (``PlanningProblem.host``) search with."""
  res = simulate(
    plan,
    layer_graph,
    cluster,
    schedule=schedule,
    cost_model=cost_model,
    costs=costs,
    host=host,
    timeline=False,
  )
  if plan.num_stages != 1:
    return res
  seconds = predict_fused(plan, fused_times(layer_graph, host), cluster, host, cost_model)
  return dataclasses.replace(res, iteration_time=seconds)
