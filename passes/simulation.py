"""The simulator's entry points: a plan, or a schedule with explicit times -> SimResult.

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
  simulate_times(schedule, forward, backward, ...)  explicit per-stage (or per-action) times,
      so measured times can be replayed and compared with predictions action by action.

The results (``SimResult``), the timing of a lowered program (``simulate_program``) and the
Chrome / Perfetto traces stay in ``cost.simulator``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import networkx as nx

from gpp_jax.cost.cluster import Cluster
from gpp_jax.cost.cost_model import CostModel, LayerCosts
from gpp_jax.cost.simulator import (
  SimResult,
  Times,
  fused_times,
  plan_times,
  predict_fused,
  simulate_lanes,
  simulate_lowered,
  simulate_step,
)
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
  schedule: Schedule,
  forward: Sequence[Times],
  backward: Sequence[Times],
  *,
  weight: Sequence[Times] | None = None,
  update: Sequence[float] | None = None,
  activation_transfer: Mapping[tuple[int, int], float] | None = None,
  cotangent_transfer: Mapping[tuple[int, int], float] | None = None,
  static_memory: Sequence[float] | None = None,
  activation_memory: Sequence[float] | None = None,
  stage_devices: Sequence[Sequence[int]] | None = None,
  host_dispatch: float | Mapping[Op, float] | Sequence[Mapping[Op, float]] | None = None,
  send_factors: Mapping[tuple[int, int], float] | None = None,
  cores: int | None = None,
  channels: Mapping[tuple[str, int, int], Any] | None = None,
  timeline: bool = True,
  processes: Sequence[Sequence[int]] | None = None,
) -> SimResult:
  """Schedule + explicit times -> SimResult: the schedule's lowered program
  (``passes.lowering.lower_schedule``: one activation and one cotangent per stage edge and
  micro-batch) timed by ``cost.simulator.simulate_program`` (``simulate_lowered``). Without a
  host, cores or shared channels (the devices-only model the planners search with) the same
  times come from the schedule itself, without lowering it (``cost.simulator.simulate_lanes``,
  held equal to the program's by the tests).

  Args:
    schedule: the schedule to execute (validated by the caller or by its generator).
    forward, backward, weight: per stage, seconds of one F / B / W action: a float, or a
      sequence (or mapping) indexed by micro-batch for per-action (e.g. measured) times.
    update: per stage, seconds of the UPDATE action (0 if None).
    activation_transfer: seconds to move one micro-batch's activations along edge (i, j)
      (missing edges: 0; a micro-batch of the producer i); cotangent_transfer likewise for the
      way back (a micro-batch of the consumer j; default: the same as activation_transfer).
    static_memory, activation_memory: bytes per device for weights/optimizer state, and for
      one stashed micro-batch, per stage (0 if None).
    stage_devices: devices of each stage, to report peak memory per device.
    host_dispatch: seconds the driver's single host thread spends issuing one action (F, B,
      W, UPDATE), or seconds per op of the lowered program (``cost.host.HostCosts``), or
      such a mapping per lane (``HostCosts.lane_costs``); when set, no instruction starts
      before the host has issued it, in program order.
    send_factors: per stage edge (i, j), what a SEND along it (either way) costs to issue
      in lone SENDs (``HostCosts.send_factors``: an edge carries several arrays, put
      together; default one).
    cores: the host has this many cores, shared by the computing actions (forced CPU
      devices share them) and by the issuing thread while it issues an action; None for
      independent devices.
    channels: maps a transfer (kind, src, dst) to the channel it queues on; transfers
      mapped to the same key share it one after another (a node's network interface).
      Unmapped transfers (the default for all) each have their own channel.
    timeline: False leaves the result's ``actions`` and ``transfers`` empty (the times,
      bubbles and memory are the same): what a planner needs of each of its candidates,
      without building thousands of records it does not read.
    processes: per lane (the stages', then the host lane), the processes that issue its
      instructions, each with its own issuing thread and cores (``simulate_program``).
  """
  if host_dispatch is None and cores is None and not channels and not schedule.shares_devices:
    res = simulate_lanes(
      schedule,
      forward,
      backward,
      weight=weight,
      update=update,
      activation_transfer=activation_transfer,
      cotangent_transfer=cotangent_transfer,
      static_memory=static_memory,
      activation_memory=activation_memory,
      stage_devices=stage_devices,
      timeline=timeline,
    )
    if res is not None:  # else a deadlock: the program's lowering names it
      return res
  return simulate_lowered(
    schedule,
    lowered_schedule(schedule),
    forward,
    backward,
    weight=weight,
    update=update,
    activation_transfer=activation_transfer,
    cotangent_transfer=cotangent_transfer,
    static_memory=static_memory,
    activation_memory=activation_memory,
    stage_devices=stage_devices,
    host_dispatch=host_dispatch,
    send_factors=send_factors,
    cores=cores,
    channels=channels,
    timeline=timeline,
    processes=processes,
  )


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
  stages costs its bytes over the link between their devices, ``host_cost`` and ``cores`` as
  ``simulate_program`` takes them; memory is then the program's own (``cost.memory``: its
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
    """The plan simulated with ``cores`` compute servers (``simulate_times(cores=)``)."""
    if program is not None:
      return simulate_step(
        program, plan, cluster, times, num_microbatches=schedule.num_microbatches, cores=cores
      )
    pc = times.costs
    res = simulate_times(
      schedule,
      pc.forward,
      times.backward,
      weight=times.weight,
      update=pc.update,
      activation_transfer=pc.activation_transfer,
      cotangent_transfer=pc.cotangent_transfer,
      static_memory=times.static_memory,
      activation_memory=pc.activation_memory,
      stage_devices=times.stage_devices,
      channels=times.channels,
      host_dispatch=times.host_cost,
      send_factors=times.send_factors,
      cores=cores,
      timeline=timeline,
      processes=times.processes,
    )
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
  seconds = predict_fused(plan, fused_times(layer_graph), cluster, host, cost_model)
  return dataclasses.replace(res, iteration_time=seconds)
