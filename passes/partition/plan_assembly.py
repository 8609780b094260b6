"""Turning a planner's choice into a Plan, and the pieces every planner shares.

A planner decides which layers form each stage, how many devices each stage gets and the
micro-batch size. ``assemble_plan`` turns that into a Plan: stages in topological order, each
with a contiguous range of device indices, stage edges induced by the layer graph (plus any
ordering edges the planner asks for), in-flight counts from the stage DAG, and the cost
model's prediction (``predict``: simulated iteration time, throughput, per-stage memory) in
``plan.predicted``. Both take the ``PlanningProblem`` the plan is made for: the prediction is
the devices-only simulation (every device computes on its own, the host costs nothing), or,
where the problem has the machine's measured host (``cost.host.HostCosts``, its ``host``),
the prediction for that machine (``passes.simulation.simulate_on_host``), which every planner's
comparisons then go by.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, overload

import networkx as nx

from gpp_jax.cost.cluster import Cluster, as_cluster
from gpp_jax.cost.cost_model import (
  DEFAULT_COST_MODEL,
  CostModel,
  LayerCosts,
  layer_costs,
  plan_costs,
)
from gpp_jax.cost.memory import format_bytes
from gpp_jax.cost.simulator import SimResult
from gpp_jax.errors import PlanError
from gpp_jax.ir.layer_graph import validate_layer_graph
from gpp_jax.ir.plan import Plan, Stage, has_mixed_microbatches, stage_edges
from gpp_jax.ir.schedule import Schedule, trusted_generators
from gpp_jax.passes.inflight import inflight_counts
from gpp_jax.passes.schedules import make_schedule, plan_schedule
from gpp_jax.passes.simulation import simulate, simulate_on_host

if TYPE_CHECKING:
  from gpp_jax.passes.partition.problem import PlanningProblem

# Sweeps skip micro-batch sizes that need more micro-batches than this (none of the
# benchmark optima comes near it; it bounds simulation cost).
MAX_MICROBATCHES = 256


def microbatch_sizes(
  batch_size: int,
  num_microbatches: int | None = None,
  max_microbatches: int | None = MAX_MICROBATCHES,
  num_devices: int | None = None,
) -> list[int]:
  """Micro-batch sizes to try: ``batch_size / num_microbatches`` when given, else every power
  of two dividing ``batch_size`` (GraphPipe's sweep) with at most ``max_microbatches``
  micro-batches (None: no limit). Over ``num_devices`` with an odd factor, those powers times
  each odd divisor that factor shares with the batch too: a stage's devices each take a whole
  number of its micro-batch's samples, so a stage over 24 of 192 devices (or all 315) needs
  a micro-batch that 3 (or 315's divisors) divide, which no power of two is (Megatron-LM's
  GPT layouts run 24, 15, 9 and 6 replicas: ``benchmarks/published_interleaved.py``)."""
  if batch_size < 1:
    raise PlanError(f"batch_size must be positive, got {batch_size}")
  if num_microbatches is not None:
    if num_microbatches < 1 or batch_size % num_microbatches:
      raise PlanError(
        f"num_microbatches={num_microbatches} does not divide batch_size="
        f"{batch_size}; pick a divisor of the batch size"
      )
    return [batch_size // num_microbatches]
  odd = math.gcd(batch_size, num_devices or 1)
  while odd % 2 == 0:
    odd //= 2
  out = set()
  for d in (k for k in range(1, odd + 1, 2) if odd % k == 0):
    b = d
    while b <= batch_size:
      if batch_size % b == 0 and (max_microbatches is None or batch_size // b <= max_microbatches):
        out.add(b)
      b *= 2
  return sorted(out) or [batch_size]


def data_parallel_degrees(
  microbatch: int, max_devices: int, powers_of_two: bool = False
) -> list[int]:
  """Data-parallel degrees a stage may use: divisors of the micro-batch (each device gets a whole
  number of samples), at most ``max_devices``."""
  out = [d for d in range(1, max_devices + 1) if microbatch % d == 0]
  if powers_of_two:
    out = [d for d in out if d & (d - 1) == 0]
  return out


def planner_inputs(
  layer_graph: nx.DiGraph,
  cluster: Cluster | int | None,
  batch_size: int | None,
  cost_model: CostModel | None,
) -> tuple[Cluster, CostModel, int, LayerCosts]:
  """What every cost-model planner starts from: the validated LayerGraph's costs, the Cluster
  (a device count becomes a ``cpu_cluster``), the cost model and the mini-batch size (default:
  the LayerGraph's ``batch_size``)."""
  validate_layer_graph(layer_graph)
  return (
    as_cluster(cluster),
    cost_model or DEFAULT_COST_MODEL,
    int(batch_size or layer_graph.graph["batch_size"]),
    layer_costs(layer_graph),
  )


@dataclasses.dataclass(frozen=True)
class StageLayout:
  """How ``assemble_plan`` orders a planner's stages, links them and hands out devices.

  Attributes:
    extra_edges: ordering edges between stages (indices into the stages as given).
    keep_order: keep the given stage order (else sort stages topologically by first layer).
    sequential: the stages form a chain in the given order (a sequential pipeline): implies
      ``keep_order``, adds an ordering edge between consecutive stages, and sets
      ``Plan.sequential``.
    device_order: the order in which device indices are handed out, stage by stage (default:
      ``place_stages``).
  """

  extra_edges: Sequence[tuple[int, int]] = ()
  keep_order: bool = False
  sequential: bool = False
  device_order: Sequence[int] | None = None


def assemble_plan(
  problem: PlanningProblem,
  stages: Sequence[tuple[Iterable[str], int]],
  *,
  microbatch: int,
  planner: str,
  schedule: str | None = None,
  layout: StageLayout = StageLayout(),
  info: dict[str, Any] | None = None,
) -> Plan:
  """Stage choice -> Plan with devices, edges, in-flight counts and predictions.

  Args:
    problem: the ``PlanningProblem`` (its layer graph, cluster, mini-batch size, cost model,
      layer costs and host costs); the plan is predicted for it (``predict``, which shares
      the problem's simulations).
    stages: (layers, device count) per stage.
    microbatch: samples per micro-batch (uniform across stages).
    planner: the planner's name, recorded in the plan.
    schedule: the schedule generator the plan names (default: the problem's).
    layout: the stages' order, ordering edges and device order (``StageLayout``).
    info: extra entries for ``plan.predicted``.
  """
  layer_graph, cluster, costs = problem.layer_graph, problem.cluster, problem.costs
  batch_size = problem.batch_size
  extra_edges, keep_order = layout.extra_edges, layout.keep_order
  raw = [(sorted(ls, key=costs.index.__getitem__), int(k)) for ls, k in stages]
  if any(not ls for ls, _ in raw):
    raise PlanError("a planner produced an empty stage; every stage needs at least one layer")
  if layout.sequential:
    keep_order = True
    extra_edges = list(extra_edges) + [(k, k + 1) for k in range(len(stages) - 1)]
  order = (
    list(range(len(raw)))
    if keep_order
    else sorted(range(len(raw)), key=lambda i: costs.index[raw[i][0][0]])
  )
  rank = {old: new for new, old in enumerate(order)}
  used = sum(k for _, k in raw)
  if used > cluster.num_devices:
    raise PlanError(f"the stages need {used} devices but the cluster has {cluster.num_devices}")
  if layout.device_order is not None:
    devs = list(layout.device_order)
    ranges, nxt = [], 0
    for old in order:
      ranges.append(tuple(devs[nxt : nxt + raw[old][1]]))
      nxt += raw[old][1]
    idle = devs[nxt:]
  else:
    ranges = place_stages(cluster, [raw[old][1] for old in order])
    taken = {d for r in ranges for d in r}
    idle = [d for d in range(cluster.num_devices) if d not in taken]
  if batch_size % microbatch:
    raise PlanError(f"micro-batch {microbatch} does not divide the batch {batch_size}")
  M = batch_size // microbatch
  where = {}
  stage_list = []
  for new, old in enumerate(order):
    ls, _k = raw[old]
    for l in ls:
      where[l] = new
    stage_list.append((tuple(ls), ranges[new]))
  edge_set = set(stage_edges(layer_graph, where))
  edge_set |= {(rank[a], rank[b]) for a, b in extra_edges}
  edges = tuple(sorted(edge_set))
  fl = inflight_counts(len(stage_list), edges, num_microbatches=M).microbatches
  plan = Plan(
    stages=tuple(
      Stage(index=i, layers=ls, devices=ds, microbatch_size=microbatch, in_flight=fl[i])
      for i, (ls, ds) in enumerate(stage_list)
    ),
    edges=edges,
    num_microbatches=M,
    schedule=problem.schedule if schedule is None else schedule,
    planner=planner,
    batch_size=batch_size,
    sequential=layout.sequential,
  )
  return predict(problem, plan, idle=idle, info=info)


def place_stages(cluster: Cluster, counts: Sequence[int]) -> list[tuple[int, ...]]:
  """Contiguous device ranges for stages needing ``counts`` devices (in stage order).

  On a two-level cluster a stage that fits in a node is kept inside one node and a larger one
  gets whole nodes, so data-parallel groups all-reduce over the fast link where they can:
  stages are placed largest first, each at the lowest free position that does not straddle a
  node boundary needlessly (first fit decreasing). Stages with equal counts keep their order,
  so neighbours in the stage order tend to be neighbours on the machine.
  """
  K = cluster.num_devices
  n = cluster.devices_per_node or K
  free = bytearray(b"\x01") * K  # 1: free
  out: list[tuple[int, ...] | None] = [None] * len(counts)

  def fits(start: int, k: int) -> bool:
    return start + k <= K and all(free[start : start + k])

  for i in sorted(range(len(counts)), key=lambda i: (-counts[i], i)):
    k = counts[i]
    run = b"\x01" * k
    pick = None
    if k >= n:  # whole nodes: the first node start followed by k free devices
      pick = next((st for st in range(0, K, n) if free.startswith(run, st)), None)
    elif k > 0:  # inside one node: the first node with k free devices in a row, its first
      for st in range(0, K, n):
        at = free.find(run, st, min(st + n, K))
        if at >= 0:
          pick = at
          break
    else:
      pick = next((st for st in range(K) if fits(st, k) and st // n == (st + k - 1) // n), None)
    if pick is None and k > 0:
      at = free.find(run)
      pick = at if at >= 0 else None
    elif pick is None:
      pick = next((st for st in range(K) if fits(st, k)), None)
    if pick is None:  # node-aligned picks left the free devices in pieces: pack in order
      return _packed(K, counts)
    free[pick : pick + k] = bytes(k)  # pick + k <= K: every branch found k free devices there
    out[i] = tuple(range(pick, pick + k))
  return out  # type: ignore[return-value]


def _packed(num_devices: int, counts: Sequence[int]) -> list[tuple[int, ...]]:
  """Contiguous device ranges for ``counts`` one after another in stage order, where keeping
  stages inside nodes does not place them all (8 stages of 10 of 80 devices in nodes of 8: each
  at a node's start left 6 devices of every pair of nodes apart)."""
  if sum(counts) > num_devices:
    raise PlanError(
      f"cannot place stages needing {list(counts)} devices contiguously on "
      f"{num_devices} devices; use fewer devices per stage"
    )
  out, at = [], 0
  for k in counts:
    out.append(tuple(range(at, at + k)))
    at += k
  return out


@functools.lru_cache(maxsize=512)
def _schedule(
  name: str, num_stages: int, edges: tuple, num_microbatches: int, bound: tuple | None = None
) -> Schedule:
  with trusted_generators():  # the generators' own output; the runtime validates its schedule
    return make_schedule(name, num_stages, edges, num_microbatches, memory_bound=bound)


def memory_bound(
  plan: Plan,
  layer_graph: nx.DiGraph,
  cluster: Cluster,
  *,
  cost_model: CostModel | None = None,
  costs: LayerCosts | None = None,
) -> tuple[int, ...]:
  """Per stage, the most micro-batches whose activations fit in a device's memory next to
  the stage's weights and optimizer state (at least 1, at most M): the bound a zero-bubble
  schedule is generated under."""
  pc = plan_costs(plan, layer_graph, cluster, cost_model, costs)
  M = plan.num_microbatches
  out = []
  for static, act in zip(pc.static_memory, pc.activation_memory):
    room = cluster.memory_per_device - static
    n = M if act <= 0 else int(room // act)
    out.append(max(1, min(M, n)))
  return tuple(out)


def predict(
  problem: PlanningProblem,
  plan: Plan,
  *,
  idle: Sequence[int] = (),
  info: dict[str, Any] | None = None,
) -> Plan:
  """Plan -> the same Plan with ``predicted`` filled in from a simulation on ``problem``'s
  layer graph, cluster, cost model and layer costs: the devices-only one, or, where the
  problem has ``host`` (the machine's ``cost.host.HostCosts``), the prediction for that
  machine (``passes.simulation.simulate_on_host``: the host issuing the program, the cores the
  devices share, a one-stage plan as one jitted step), recorded as ``predicted["host_aware"]``.
  ``idle``: the devices the plan leaves idle (``predicted["idle_devices"]``); ``info``: extra
  entries for ``predicted``. A caller with a layer graph and a cluster builds the problem once
  (``PlanningProblem.build``) and predicts any number of plans with it
  (``PlanningProblem.predict``).

  A zero-bubble plan gets its memory bound (``memory_bound``) as the stages' ``in_flight``,
  which is what its schedule is generated under (``passes.schedules.plan_schedule``).
  The problem's simulations (``PlanningProblem.simulations``; None: none kept) keep the
  simulation of every plan they have seen: the planners' searches meet the same plan more
  than once (a polish revisits its neighbours, a seed is simulated by its planner and again
  as a candidate), and the simulation is a function of the plan alone once the graph, cluster
  and costs are fixed.
  """
  layer_graph, cluster = problem.layer_graph, problem.cluster
  cost_model, costs, host = problem.cost_model, problem.costs, problem.host
  bound = None
  if plan.schedule == "zero-bubble":
    bound = memory_bound(plan, layer_graph, cluster, cost_model=cost_model, costs=costs)
    plan = plan.replace(
      stages=tuple(dataclasses.replace(s, in_flight=n) for s, n in zip(plan.stages, bound))
    )
  key = (
    id(layer_graph),
    id(cluster),
    id(cost_model),
    id(costs),
    id(host),
    plan.replace(planner=""),
  )
  memo = problem.simulations()
  res = None if memo is None else memo.get(key)
  if res is None:
    res = _simulate(problem, plan, bound)
    if memo is not None:
      memo[key] = res
  if host is not None:
    info = {**(info or {}), "host_aware": True}
  return plan.replace(predicted=prediction(res, plan, cluster, info=info, idle=idle))


def _simulate(problem: PlanningProblem, plan: Plan, bound: tuple[int, ...] | None) -> SimResult:
  """The plan's simulation on ``problem`` under its schedule (generated under ``bound`` if
  given); where the problem has ``host``, the prediction for that machine
  (``simulate_on_host``)."""
  if has_mixed_microbatches(plan):
    sched = plan_schedule(plan)  # per-stage counts from the stages' own sizes
  else:
    sched = _schedule(
      plan.schedule, plan.num_stages, tuple(plan.edges), plan.num_microbatches, bound
    )
  layer_graph, cluster = problem.layer_graph, problem.cluster
  if problem.host is not None:
    return simulate_on_host(
      plan,
      layer_graph,
      cluster,
      problem.host,
      schedule=sched,
      cost_model=problem.cost_model,
      costs=problem.costs,
    )
  return simulate(
    plan,
    layer_graph,
    cluster,
    schedule=sched,
    cost_model=problem.cost_model,
    costs=problem.costs,
    timeline=False,
  )


def prediction(
  res: SimResult,
  plan: Plan,
  cluster: Cluster,
  *,
  info: dict[str, Any] | None = None,
  idle: Sequence[int] = (),
) -> dict[str, Any]:
  """The ``plan.predicted`` entries for a simulation result (JSON-friendly)."""
  B = plan.batch_size or 0
  mem = {str(s): float(m) for s, m in enumerate(res.stage_memory)}
  p = {
    "iteration_time": res.iteration_time,
    "throughput": B / res.iteration_time if res.iteration_time > 0 and B else None,
    "stage_memory": mem,
    "max_memory": max(res.stage_memory),
    "memory_limit": float(cluster.memory_per_device),
    "memory_ok": bool(max(res.stage_memory) <= cluster.memory_per_device),
    "bubble": [round(b, 6) for b in res.bubble],
    "depth": plan.depth(),
    "cluster": cluster.name,
    "idle_devices": list(idle),
  }
  if info:
    p.update(info)
  return p


def check_memory(plan: Plan, cluster: Cluster) -> None:
  """Raises PlanError when a stage's predicted memory exceeds the device memory."""
  for s, m in plan.predicted.get("stage_memory", {}).items():
    if m > cluster.memory_per_device:
      raise PlanError(
        f"stage {s} needs {m / 2**30:.2f} GiB per device but devices have "
        f"{cluster.memory_per_device / 2**30:.2f} GiB; use more devices, a smaller "
        "micro-batch or a smaller model"
      )


@overload
def better(a: Plan, b: Plan | None) -> Plan: ...
@overload
def better(a: Plan | None, b: Plan) -> Plan: ...
@overload
def better(a: Plan | None, b: Plan | None) -> Plan | None: ...


def better(a: Plan | None, b: Plan | None) -> Plan | None:
  """The plan with the lower predicted iteration time among those within memory."""

  def key(p: Plan):
    ok = p.predicted.get("memory_ok", True)
    return (not ok, p.predicted.get("iteration_time", math.inf), p.num_stages)

  if a is None:
    return b
  if b is None:
    return a
  return b if key(b) < key(a) else a


def shortlist(found: Sequence[tuple], top: int, host: Any) -> list[tuple]:
  """Which of ``found`` (candidate tuples ``(estimate, micro-batch, replication, stages,
  ...)``, best estimate first) a planner simulates: the first ``top``; where it searches with
  the host (``PlanningProblem.host``), also the best estimate of every other (replication,
  stage count). The estimate prices the devices only, so its best are the widest and deepest
  plans, which issue the most instructions and share the host's cores most; the host-aware
  simulation that ranks them would otherwise never see a shallower one (medium MMT over 8
  forced CPU devices: BaPipe's best 8 by its estimate were all stages over 2-4 devices)."""
  out = list(found[:top])
  if host is None:
    return out
  seen = {(c[2], c[3]) for c in out}
  for c in found[top:]:
    if (c[2], c[3]) not in seen:
      seen.add((c[2], c[3]))
      out.append(c)
  return out


def no_plan_error(
  planner: str, layer_graph: nx.DiGraph, cluster: Cluster, batch_size: int, why: str = ""
) -> PlanError:
  return PlanError(
    f"{planner}: no plan fits {layer_graph.graph.get('name', 'the model')} (batch "
    f"{batch_size}) on {cluster.num_devices} devices with "
    f"{format_bytes(cluster.memory_per_device)} each{': ' + why if why else ''}; "
    "use more devices, a smaller batch, or devices with more memory"
  )


def schedule_for(plan: Plan):
  """The Schedule the runtime will execute for ``plan``."""
  return plan_schedule(plan)
