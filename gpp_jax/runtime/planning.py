"""Planner runs (the plan phase's, ``runtime.choice``): the plan for a layer graph (a given
Plan, a manual plan resolved, or a planner's, held to the memory budget), the machine the
planners are given and its memory per device, the bisection for the smallest budget that fits
when no plan does (``budget_error``), and the seconds the cost model predicts for a plan on
this machine (``predict_seconds``)."""

from __future__ import annotations

from typing import Any

import jax
import networkx as nx

from gpp_jax.cost.calibration import MachineCalibration
from gpp_jax.cost.cluster import as_cluster, devices_cluster
from gpp_jax.cost.cost_model import plan_costs
from gpp_jax.cost.host import HostCosts
from gpp_jax.errors import PlanError
from gpp_jax.ir import layer_graph as lg
from gpp_jax.ir.plan import Plan, has_mixed_microbatches, validate_plan
from gpp_jax.passes.partition import KeywordPlanner, get_planner
from gpp_jax.passes.partition.manual import ManualPlan
from gpp_jax.passes.partition.problem import ProblemPlanner, planner_name, too_few_stages_error
from gpp_jax.passes.partition.shared import default_stages_per_device
from gpp_jax.passes.simulation import simulate, simulate_on_host
from gpp_jax.runtime.options import Options
from gpp_jax.runtime.sharding import check_rows

# What a user would run instead of a pipeline: the step in one call on one device, and over
# all devices as one SPMD program with the parameters replicated (data parallel), sharded
# FSDP-style, or by the model's own partition specs over the user's mesh.
BASELINES = ("plain jit", "jit data parallel", "jit fsdp", "jit sharded")

# The machine a prediction is for: its host's measured costs, or those with the trials' fits
# on top (``cost.calibration``).
Machine = HostCosts | MachineCalibration


def predict_seconds(
  plan: Plan, graph: nx.DiGraph, cluster: Any, host: Machine | None
) -> tuple[float, bool]:
  """(seconds per step on this machine, whether its predicted memory fits the cluster's
  memory per device): ``simulate_on_host`` (a one-stage plan runs as one jitted step,
  ``predict_fused``, a pipeline as its schedule's program issued by the host; the fusion a
  ``MachineCalibration`` carries, where the trials fitted it, scales a one-stage plan's
  compute)."""
  if not plan.batch_size:  # a plan given without its batch: the graph's
    plan = plan.replace(batch_size=graph.graph["batch_size"])
  res = simulate_on_host(plan, graph, cluster, host)
  return res.iteration_time, max(res.stage_memory, default=0.0) <= cluster.memory_per_device


def planner_cluster(opts: Options) -> Any:
  """What planners are given as the machine: the user's Cluster (else the devices'), with the
  memory per device the budget (``memory_limit``)."""
  if opts.cluster is not None:
    cluster = as_cluster(opts.cluster)
  else:
    cluster = devices_cluster(list(opts.devices))
  return cluster.replace(memory_per_device=float(memory_limit(opts, cluster)))


def memory_limit(opts: Options, cluster: Any = None) -> int:
  """Bytes per device a plan may use: ``memory_limit=``, else the smallest ``bytes_limit`` the
  pipeline's devices report (GPU, TPU), else the cluster preset's memory per device."""
  if opts.memory_limit is not None:
    return int(opts.memory_limit)
  reported = []
  for d in opts.devices:
    stats = d.memory_stats() if d.process_index == jax.process_index() else None
    if stats and stats.get("bytes_limit"):
      reported.append(int(stats["bytes_limit"]))
  if reported:
    return min(reported)
  if cluster is None:
    cluster = (
      as_cluster(opts.cluster) if opts.cluster is not None else devices_cluster(opts.devices)
    )
  return int(cluster.memory_per_device)


def run_planner(
  graph: nx.DiGraph, cluster: Any, batch_size: int, opts: Options, host: Machine | None = None
) -> Plan:
  """``opts.planner``'s plan (a named planner's or a callable's) for ``graph`` on ``cluster``,
  which fits its memory per device as the simulator predicts it (a planner that does not look
  at memory is held to it here: ``PlanError`` when over). With ``host`` (the machine's
  measured costs, or a ``MachineCalibration``) the planner searches with the prediction for
  this machine (``PlanningProblem.host``); a callable gets it where its signature takes
  ``host``. ``opts.min_stages`` above one is the planner's
  too: a named planner searches plans of at least that many stages
  (``PlanningProblem.min_stages``), a callable gets it where its signature takes
  ``min_stages``, and a plan of fewer stages is a ``PlanError`` naming the planner (no other
  planner runs in its place)."""
  M = opts.num_microbatches
  k = opts.min_stages
  p = opts.planner
  if isinstance(p, (str, ProblemPlanner)):  # a built-in planner, by name or itself
    fn = get_planner(p) if isinstance(p, str) else p
    with_host = {} if host is None else {"host": host}
    with_stages: dict[str, Any] = {"min_stages": k} if k > 1 else {}
    # Stages per device by prediction on accelerators, one on CPU devices, unless given.
    if isinstance(fn, ProblemPlanner):
      with_stages["stages_per_device"] = default_stages_per_device(cluster)
    plan = fn(
      lg.scaled(graph, batch_size),
      cluster,
      batch_size,
      num_microbatches=M,
      **{**with_host, **with_stages, **opts.planner_options},
    )
  else:
    named = KeywordPlanner(planner_name(p), p)
    takes = named.accepts()
    extra: dict[str, Any] = {}
    if host is not None and (takes is None or "host" in takes):
      extra["host"] = host
    if k > 1 and (takes is None or "min_stages" in takes):
      extra["min_stages"] = k
    plan = p(graph, cluster, batch_size, num_microbatches=M, **extra)
    if plan.num_stages < k:
      name = plan.planner or named.name
      raise too_few_stages_error(name, plan, k, keyword="min_stages" in extra)
  if plan.num_microbatches != M:
    plan = plan.replace(num_microbatches=M)
  if opts.schedule is not None:
    plan = plan.replace(schedule=opts.schedule)
  # Per device: a device running several stages holds all of their memory.
  peak = max(
    simulate(plan, lg.scaled(graph, batch_size), cluster).peak_memory.values(), default=0.0
  )
  if peak > cluster.memory_per_device:
    raise PlanError(
      f"the plan needs {peak / 2**20:.3f} MiB on a device, more than "
      f"{cluster.memory_per_device / 2**20:.3f} MiB"
    )
  return plan


BUDGET_ROUNDS = 8  # planner runs of the bisection for the smallest budget (``budget_error``)


def budget_error(
  error: PlanError, graph: nx.DiGraph, cluster: Any, batch_size: int, opts: Options
) -> PlanError:
  """The planner found no plan under the memory budget: when one exists with unlimited memory,
  an error naming the smallest budget found to fit (bisected over ``BUDGET_ROUNDS`` planner
  runs) and what takes the most memory in that plan; else ``error`` itself."""
  from gpp_jax.cost.memory import format_bytes as fmt

  limit = cluster.memory_per_device

  def attempt(budget: float) -> Plan | None:
    try:
      sized = cluster.replace(memory_per_device=budget)
      return run_planner(graph, sized, batch_size, opts)
    except PlanError:
      return None

  hi = 1e18
  fitting = attempt(hi)
  if fitting is None:
    return error
  res = simulate(fitting, lg.scaled(graph, batch_size), cluster)
  lo, hi = float(limit), max(float(max(res.stage_memory, default=limit)), float(limit))
  for _ in range(BUDGET_ROUNDS):
    if hi <= lo * 1.05:
      break
    mid = (lo + hi) / 2
    got = attempt(mid)
    if got is None:
      lo = mid
    else:
      hi, fitting = mid, got
  pc = plan_costs(fitting, lg.scaled(graph, batch_size), cluster)
  worst = max(
    range(fitting.num_stages), key=lambda i: pc.static_memory[i] + pc.activation_memory[i]
  )
  stage = fitting.stages[worst]
  static, act = pc.static_memory[worst], pc.activation_memory[worst]
  flight = stage.in_flight or fitting.num_microbatches
  what = (
    f"its parameters, gradients and optimizer state ({fmt(static)} per device)"
    if static >= act * flight
    else f"activations stashed for the micro-batches in flight (up to {flight} x {fmt(act)})"
  )
  name = opts.planner if isinstance(opts.planner, str) else "the planner"
  return PlanError(
    f"{name}: no plan fits memory_limit={fmt(limit)} per device on {len(opts.devices)} devices "
    f"(batch {batch_size}, {opts.num_microbatches} micro-batches); the smallest budget found "
    f"that fits is about {fmt(hi)} ({fitting.num_stages} stages), where stage {worst} "
    f"({len(stage.layers)} layers from {stage.layers[0]!r}) holds the most: {what}. Raise "
    "memory_limit, use more devices, more micro-batches (smaller ones) or remat=True"
  )


def make_plan(
  graph: nx.DiGraph, batch_size: int, opts: Options, host: Machine | None = None
) -> Plan:
  """The plan for ``graph``: the given Plan, a resolved manual plan, or a planner's (searched
  with ``host``, the machine's measured costs, where given: ``run_planner``)."""
  M = opts.num_microbatches
  p = opts.planner
  nd = len(opts.devices)
  if isinstance(p, Plan):
    if p.planner in BASELINES:  # the whole batch at once, as it was chosen
      M = p.num_microbatches
    plan = p if p.num_microbatches == M else p.replace(num_microbatches=M)
    if has_mixed_microbatches(plan) and plan.batch_size != batch_size:
      plan = plan.replace(batch_size=batch_size)  # per-stage sizes are checked against it
  elif isinstance(p, ManualPlan):
    if opts.layout is not None:  # stages take rows of the mesh: say so before resolving
      named = [*p.rules.values(), *([] if p.default_stage is None else [p.default_stage])]
      where = [(p.devices or {}).get(s, s) for s in range(max(named, default=0) + 1)]
      check_rows(
        opts.layout, len({(d,) if isinstance(d, int) else tuple(sorted(d)) for d in where})
      )
    return p.resolve(graph, M, opts.schedule or "1f1b", nd, batch_size)
  elif isinstance(p, str) or callable(p):
    cluster = planner_cluster(opts)
    try:
      plan = run_planner(graph, cluster, batch_size, opts, host)
    except PlanError as e:
      raise budget_error(e, graph, cluster, batch_size, opts) from e
  else:
    raise TypeError(
      f"planner must be a name, a Plan, a gpp_jax.manual_plan or a callable; got {type(p).__name__}"
    )
  if plan.num_microbatches != M:
    plan = plan.replace(num_microbatches=M)
  if opts.schedule is not None:
    plan = plan.replace(schedule=opts.schedule)
  validate_plan(plan, graph, nd, batch_size)
  return plan
