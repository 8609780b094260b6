"""Local search on a finished plan against the simulator.

A planner's search optimises a proxy (time per sample of the bottleneck, entry depth); the
simulator sees what the proxy cannot: the pipeline fill and drain, a stage's gradient
all-reduce at the end of the iteration, transfers on the links the placement picked. This
module polishes a plan by steepest descent on the simulated iteration time over small moves:

* device moves: give idle devices to a stage, or shift devices to one of the busiest stages
  from another (device counts stay divisors of the micro-batch);
* partition moves (``partition=True``), each touching one of the busiest stages:
  move one layer across a stage edge, split a stage in two (a prefix and a suffix of its
  layers in topological order, devices shared out, idle ones included), merge two stages
  joined by an edge.

A DAG plan keeps only moves whose stage graph stays acyclic (which keeps every stage convex).
A sequential plan (``Plan.sequential``) stays a chain: its stages are cuts of one
topological order, and moves shift, add or remove a cut. Under ``min_stages`` (the planning
problem's fewest stages) no move merges a plan below that many stages. The search stops when
no move gains more than ``1e-4`` of the iteration time, or after ``max_evals`` simulations (or
``max_rounds`` moves); ``polish`` records either of those of the refinement its plan comes
from in ``predicted["polish_stopped"]``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from gpp_jax.cost.cluster import Cluster
from gpp_jax.cost.cost_model import CostModel
from gpp_jax.ir.plan import Plan
from gpp_jax.ir.schedule import trusted_generators
from gpp_jax.passes.inflight import topological_order
from gpp_jax.passes.partition.plan_assembly import (
  StageLayout,
  assemble_plan,
  better,
  data_parallel_degrees,
  schedule_for,
)

if TYPE_CHECKING:
  from gpp_jax.passes.partition.problem import PlanningProblem

# ``plan.predicted`` entries that describe the prediction itself (recomputed on every move);
# the rest (search statistics, the planner's own notes) is carried over.
_PREDICTION_KEYS = (
  "iteration_time",
  "throughput",
  "stage_memory",
  "max_memory",
  "memory_limit",
  "memory_ok",
  "bubble",
  "depth",
  "cluster",
  "idle_devices",
  "host_aware",
  "idle_reason",
  "polish_stopped",
)

Stages = tuple[tuple[tuple[str, ...], int], ...]


@dataclasses.dataclass(frozen=True)
class RefineOptions:
  """How far ``refine_plan`` searches.

  Attributes:
    partition: also move layers between stages (else device counts only, same stages).
    max_rounds: at most this many improving moves.
    max_takers: moves touch one of this many busiest stages (smallest bubble).
    max_evals: at most this many simulated candidates in all (unless a shared budget is
      given to ``refine_plan``).
  """

  partition: bool = True
  max_rounds: int = 16
  max_takers: int = 3
  max_evals: int = 200


@dataclasses.dataclass(frozen=True)
class MoveSpace:
  """What the move generators need of a plan's setting: the device counts a stage may have
  (divisors of the micro-batch, ``data_parallel_degrees``) and the layer graph's edges."""

  ok: tuple[int, ...]
  edges: tuple[tuple[str, str], ...]

  @functools.cached_property
  def ok_set(self) -> frozenset[int]:
    return frozenset(self.ok)

  def splits(self, d: int, spare: int) -> Iterator[tuple[int, int]]:
    """Device counts (d1, d2) for the two halves of a stage on d devices."""
    for total in sorted({d, d + spare}):
      for d1 in self.ok:
        if total - d1 in self.ok_set:
          yield d1, total - d1

  def merged_count(self, total: int) -> int:
    return max(x for x in self.ok if x <= total)


def device_moves(
  space: MoveSpace, stages: Stages, takers: Sequence[int], idle: int
) -> Iterator[Stages]:
  """Give idle devices to a stage, or shift devices between one of the busiest stages
  (``takers``) and another."""
  counts = [d for _, d in stages]
  for i in range(len(counts)):
    for d in space.ok:
      if counts[i] < d <= counts[i] + idle:
        yield tuple((ls, d if x == i else c) for x, (ls, c) in enumerate(stages))
  for i in takers:
    for j in range(len(counts)):
      total = counts[i] + counts[j]
      if i == j:
        continue
      for d in space.ok:
        if d != counts[i] and total - d in space.ok_set:
          yield tuple(
            (ls, d if x == i else total - d if x == j else c) for x, (ls, c) in enumerate(stages)
          )


def chain_moves(
  space: MoveSpace, stages: Stages, takers: Sequence[int], idle: int
) -> Iterator[Stages]:
  """A sequential plan's moves: shift a cut next to a busy stage, merge two neighbours,
  split a busy stage, or relocate a cut into a busy stage (the plan stays a chain)."""
  n = len(stages)
  near = {j for i in takers for j in (i - 1, i, i + 1) if 0 <= j < n}
  for k in range(n - 1):  # shift the cut between k and k + 1
    if k not in near and k + 1 not in near:
      continue
    (a, da), (b, db) = stages[k], stages[k + 1]
    head, tail = stages[:k], stages[k + 2 :]
    if len(a) > 1:
      yield head + ((a[:-1], da), ((a[-1],) + b, db)) + tail
    if len(b) > 1:
      yield head + ((a + (b[0],), da), (b[1:], db)) + tail
    yield head + ((a + b, space.merged_count(da + db + idle)),) + tail
  for i in takers:  # split a busy stage
    ls, d = stages[i]
    for cut in range(1, len(ls)):
      for d1, d2 in space.splits(d, idle):
        yield stages[:i] + ((ls[:cut], d1), (ls[cut:], d2)) + stages[i + 1 :]
  for i in takers:  # relocate a cut into a busy stage
    ls, d = stages[i]
    for k in range(n - 1):
      if i in (k, k + 1):
        continue
      (a, da), (b, db) = stages[k], stages[k + 1]
      for cut in range(1, len(ls)):
        new = list(stages)
        new[i : i + 1] = [(ls[:cut], d), (ls[cut:], min(da, db))]
        at = k if k < i else k + 1
        new[at : at + 2] = [(a + b, max(da, db))]
        yield tuple(new)


def dag_moves(
  space: MoveSpace, stages: Stages, takers: Sequence[int], idle: int
) -> Iterator[Stages]:
  """A DAG plan's moves: move one layer across a stage edge touching a busy stage, merge two
  stages joined by such an edge, split a busy stage, or relocate a stage (merge two joined
  stages and split a busy one)."""
  where = {l: i for i, (ls, _) in enumerate(stages) for l in ls}
  busy = set(takers)
  pairs = set()
  stage_pairs = []
  for u, v in space.edges:
    su, sv = where[u], where[v]
    if su != sv:
      stage_pairs.append((su, sv))
    if su == sv or (su not in busy and sv not in busy):
      continue
    pairs.add((su, sv))
    for l, src, dst in ((u, su, sv), (v, sv, su)):
      if len(stages[src][0]) > 1:
        yield tuple(
          (tuple(x for x in ls if x != l), d)
          if i == src
          else (ls + (l,), d)
          if i == dst
          else (ls, d)
          for i, (ls, d) in enumerate(stages)
        )
  for a, b in sorted(pairs):
    rest = tuple(s for i, s in enumerate(stages) if i not in (a, b))
    ls = stages[a][0] + stages[b][0]
    yield rest + ((ls, space.merged_count(stages[a][1] + stages[b][1] + idle)),)
  for i in takers:
    ls, d = stages[i]
    rest = stages[:i] + stages[i + 1 :]
    for cut in range(1, len(ls)):
      for d1, d2 in space.splits(d, idle):
        yield rest + ((ls[:cut], d1), (ls[cut:], d2))
  # Relocate a stage: merge two stages joined by an edge and split a busy one.
  for a, b in sorted(set(stage_pairs)):
    for i in takers:
      if i in (a, b):
        continue
      ls, d = stages[i]
      rest = tuple(s for j, s in enumerate(stages) if j not in (a, b, i))
      (la, da), (lb, db) = stages[a], stages[b]
      for cut in range(1, len(ls)):
        yield rest + ((la + lb, max(da, db)), (ls[:cut], d), (ls[cut:], min(da, db)))


class _Search:
  """One refinement's setting: how a candidate becomes a priced Plan (``build``), its stage
  graph (``stage_order``), the simulation-free lower bound that skips it (``bound``), and the
  key under which it counts as seen."""

  def __init__(self, problem: PlanningProblem, plan: Plan, partition: bool):
    self.problem = problem
    self.plan = plan
    self.partition = partition
    self.costs = problem.costs
    self.info = {k: v for k, v in plan.predicted.items() if k not in _PREDICTION_KEYS}
    self.sequential = plan.sequential
    B = plan.batch_size
    if B is None:
      raise ValueError("refine_plan needs a plan with its batch_size")
    self.mb = plan.stages[0].microbatch_size or B // plan.num_microbatches
    self.M = B // self.mb
    self.space = MoveSpace(
      tuple(data_parallel_degrees(self.mb, problem.cluster.num_devices)),
      tuple(problem.layer_graph.edges),  # walked for every candidate: a tuple walks faster
    )
    # Without partition moves: same stages, same order and edges, only device counts change.
    self.layout = StageLayout(
      extra_edges=tuple(plan.edges) if not partition else (),
      keep_order=self.sequential or not partition,
      sequential=self.sequential and partition,
    )
    self.per_layer: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # devices -> layer times
    # F, B seconds and the fastest update (all-reduce on the fastest link, placement unknown).
    self.stage_times: dict[tuple[tuple[str, ...], int], tuple[float, float, float]] = {}
    # Whether a stage's last backward is followed by its predecessors' whole backwards (not
    # so when the schedule splits W off the backward: the way back is B alone).
    with trusted_generators():
      self.drains = not schedule_for(plan).splits_backward

  def build(self, stages: Stages) -> Plan:
    return assemble_plan(
      self.problem,
      stages,
      microbatch=self.mb,
      planner=self.plan.planner,
      schedule=self.plan.schedule,
      layout=self.layout,
      info=self.info,
    )

  def stage_order(self, stages: Stages) -> tuple[list[int], list[list[int]]] | None:
    """A topological order of the stage graph and each stage's predecessors, None if it has
    a cycle (a sequential plan is a chain in its own order)."""
    n = len(stages)
    if self.sequential:
      return list(range(n)), [[i - 1] if i else [] for i in range(n)]
    where = {l: i for i, (ls, _) in enumerate(stages) for l in ls}
    preds: list[set[int]] = [set() for _ in range(n)]
    for u, v in self.space.edges:
      su, sv = where[u], where[v]
      if su != sv:
        preds[sv].add(su)
    order = topological_order(preds)
    return (order, [list(ps) for ps in preds]) if order is not None else None

  def times(self, stage: tuple[tuple[str, ...], int]) -> tuple[float, float, float]:
    """The stage's forward and backward seconds per micro-batch and its fastest update."""
    fbu = self.stage_times.get(stage)
    if fbu is None:
      ls, d = stage
      p = self.problem
      t = self.per_layer.get(d)
      if t is None:
        t = self.per_layer[d] = p.cost_model.planner_layer_times(self.costs, p.cluster, self.mb / d)
      idx = [self.costs.index[l] for l in ls]
      fbu = stage_bound_times(p, t, idx, d)
      self.stage_times[stage] = fbu
    return fbu

  def bound(self, stages: Stages, order: list[int], preds: list[list[int]]) -> float:
    """``pipeline_lower_bound`` of the stages at their device counts with their updates, less
    1e-9 of it, so that summing in another order than the simulator cannot lift a bound that
    the updates make tight above the time."""
    times = BoundTimes.of(self.times(stage) for stage in stages)
    return pipeline_lower_bound(times, order, preds, self.M, self.drains) * (1 - 1e-9)

  def key(self, stages: Stages) -> Any:
    return tuple(stages) if self.sequential or not self.partition else frozenset(stages)

  def canon(self, stages: Stages) -> Stages:
    return tuple((tuple(sorted(ls, key=self.costs.index.__getitem__)), d) for ls, d in stages)

  def moves(self, stages: Stages, takers: Sequence[int], idle: int) -> list[Stages]:
    out = list(device_moves(self.space, stages, takers, idle))
    if self.partition:
      out += list((chain_moves if self.sequential else dag_moves)(self.space, stages, takers, idle))
    return out


def refine_plan(
  problem: PlanningProblem,
  plan: Plan,
  options: RefineOptions = RefineOptions(),
  *,
  budget: list[int] | None = None,
  outcome: dict | None = None,
) -> Plan:
  """Plan -> a plan at least as fast (see the module docstring).

  Args:
    problem: the ``PlanningProblem`` the plan was made for (its layer graph, cluster, cost
      model, costs and simulations; with its ``host``, moves are judged by the prediction for
      that machine, ``plan_assembly.predict``, and the devices-only lower bound that skips
      moves without simulating them is kept for pipelines only: a one-stage plan runs as one
      jitted step, which can be faster than its layers' times add up to). Moves to plans of
      fewer than its ``min_stages`` stages are not made.
    plan: a plan with uniform micro-batch size and ``predicted`` filled in.
    options: how far to search (``RefineOptions``).
    budget: a one-element list holding a simulation budget shared between calls (it is
      decremented; ``options.max_evals`` is ignored when given).
    outcome: a dict given gets ``"stopped"``: why the search ended short of a local optimum
      ("budget": the simulation budget ran out; "rounds": ``max_rounds`` moves were made), or
      None where no move gained.
  """
  search = _Search(problem, plan, options.partition)
  K = problem.cluster.num_devices
  current = search.canon(tuple((tuple(s.layers), len(s.devices)) for s in plan.stages))
  seen = {search.key(current)}
  budget = budget if budget is not None else [options.max_evals]
  stopped: str | None = None  # why the search ended short of a local optimum, if it did
  for _ in range(options.max_rounds):
    stopped = None
    # The busiest stages (smallest bubble), in ``current``'s indexing: the plan may list its
    # stages in another order.
    bubble = plan.predicted.get("bubble") or [0.0] * plan.num_stages
    index_of = {ls: i for i, (ls, _) in enumerate(current)}
    takers = [
      index_of[search.canon(((s.layers, 0),))[0][0]]
      for s in sorted(plan.stages, key=lambda s: bubble[s.index])[: options.max_takers]
    ]
    idle = K - sum(d for _, d in current)
    best: Plan | None = None
    best_stages: Stages | None = None
    for cand in search.moves(current, takers, idle):
      cand = search.canon(cand)
      k = search.key(cand)
      if k in seen or sum(d for _, d in cand) > K or len(cand) < problem.min_stages:
        continue
      seen.add(k)
      graph = search.stage_order(cand)
      if graph is None:  # a cycle between stages
        continue
      target = (best or plan).predicted["iteration_time"] * (1 - 1e-4)
      # The budget counts simulations: a candidate the bound rules out costs none of it.
      if (problem.host is None or len(cand) > 1) and search.bound(cand, *graph) >= target:
        continue
      if budget[0] <= 0:
        stopped = "budget"
        break
      budget[0] -= 1
      p = search.build(cand)
      if p.predicted["memory_ok"] and p.predicted["iteration_time"] < target:
        best, best_stages = p, cand
    if best is None:
      break
    assert best_stages is not None  # set together with best
    plan, current = best, best_stages
  else:
    stopped = "rounds"
  if outcome is not None:
    outcome["stopped"] = stopped
  return plan


def _stopped(plan: Plan, why: str | None) -> Plan:
  """``plan`` with ``predicted["polish_stopped"]``: why the refinement that returned it ended
  before no move gained (``refine_plan``'s ``outcome``), absent where it ended there
  (``idle.idle_reason`` reads it)."""
  if why is None and "polish_stopped" not in plan.predicted:
    return plan
  pred = {k: v for k, v in plan.predicted.items() if k != "polish_stopped"}
  if why is not None:
    pred["polish_stopped"] = why
  return plan.replace(predicted=pred)


@dataclasses.dataclass(frozen=True)
class BoundTimes:
  """What ``pipeline_lower_bound`` knows of each stage: ``forward[s]`` and ``backward[s]``
  seconds per micro-batch, and at least ``update[s]`` seconds (None: 0) for the update that
  ends the stage's lane."""

  forward: Sequence[float]
  backward: Sequence[float]
  update: Sequence[float] | None = None

  @classmethod
  def of(cls, stages: Iterable[tuple[float, float, float]]) -> BoundTimes:
    """From (forward, backward, update) per stage (``stage_bound_times``)."""
    forward, backward, update = zip(*stages)
    return cls(forward, backward, update)


def pipeline_lower_bound(
  times: BoundTimes,
  order: Sequence[int],
  preds: Sequence[Sequence[int]],
  num_microbatches: int,
  drains: bool = True,
) -> float:
  """A lower bound on the iteration time of any schedule of the stage graph (stages in a
  topological ``order``, ``preds`` per stage) whose stages take ``times``: some stage runs its
  M forwards and backwards one after another, its first forward after micro-batch 0's
  forwards along the longest path to it; after its last backward come its own update and
  (``drains``) the last micro-batch's backwards along a path back from it, each followed by
  its stage's update. Transfers only add to it. ``drains=False`` for schedules that split W
  off the backward (the way back is then shorter)."""
  forward, backward = times.forward, times.backward
  up = [0.0] * len(forward) if times.update is None else times.update
  fill = [0.0] * len(forward)
  tail = list(up)  # after stage s's last backward: the rest of the iteration at least
  worst = 0.0
  # Maxima by comparison rather than max(): the polish bounds every candidate it meets.
  for s in order:
    f, t = fill[s], tail[s]
    for p in preds[s]:
      x = fill[p] + forward[p]
      if x > f:
        f = x
      if drains:
        x = backward[p] + tail[p]
        if x > t:
          t = x
    fill[s], tail[s] = f, t
    x = f + num_microbatches * (forward[s] + backward[s]) + t
    if x > worst:
      worst = x
  return worst


def stage_bound_times(
  problem: PlanningProblem,
  layer_times: tuple[np.ndarray, np.ndarray],
  idx: Any,
  n: int,
) -> tuple[float, float, float]:
  """What ``pipeline_lower_bound`` takes of a stage of the layers ``idx`` (indices or a slice
  of the order of the problem's costs) on ``n`` devices: its forward and backward seconds per
  micro-batch (``layer_times`` at its share of the micro-batch) and its update's lower bound
  on the problem's cluster under its cost model."""
  tf, tb = layer_times
  params = float(problem.costs.held_param_bytes[idx].sum())
  update = update_lower_bound(problem.cost_model, problem.cluster, params, n)
  return float(tf[idx].sum()), float(tb[idx].sum()), update


def update_lower_bound(cm: CostModel, cluster: Cluster, param_bytes: float, n: int) -> float:
  """A stage's update (gradient all-reduce over its ``n`` devices and optimizer step) on the
  fastest of the cluster's links: a bound that holds before the stage is placed."""
  links = [cluster.intra_link] + ([cluster.inter_link] if cluster.inter_link else [])
  return min(cm.update_time(param_bytes, cluster.device, n, link) for link in links)


def spend_idle_devices(
  problem: PlanningProblem, plan: Plan, *, max_rounds: int = 16, max_takers: int = 3
) -> Plan:
  """Plan -> the same stages with their device counts improved by local search.

  A DP that only asks "does every stage fit under the target time" leaves devices idle once
  the bottleneck cannot be improved, and it prices a stage's gradient all-reduce as if it
  were spread over the iteration, although it runs when the stage's last backward ends.
  """
  options = RefineOptions(
    partition=False, max_rounds=max_rounds, max_takers=max_takers, max_evals=10_000
  )
  return refine_plan(problem, plan, options)


# The polish refines plans within this factor of the best simulated one (planners that skip
# plans the polish would not start from use the same factor).
REFINE_WITHIN = 1.1


def polish(
  problem: PlanningProblem,
  plans: Sequence[Plan],
  *,
  refine_sizes: int = 4,
  refine_within: float = REFINE_WITHIN,
  max_evals: int = 200,
) -> Plan:
  """The planners' last step: the fastest plan after local search on the simulated time.

  The best plan of each of the ``refine_sizes`` best micro-batch sizes whose best plan is
  within ``refine_within`` times the best time gets ``refine_plan`` (device and partition
  moves), best size first, sharing ``max_evals`` simulations. A planner's search objective
  favours some micro-batch sizes the simulator does not, so polishing one plan per size finds
  what polishing only the best one misses. Last, the polished stages are tried (and
  refined) at the neighbouring micro-batch sizes (half and double) among the sizes the
  planner may choose from (``PlanningProblem.microbatch_sizes``). Every step goes by the
  ``problem``'s prediction (with its host costs where it has them) and shares its
  simulations; only plans of at least its ``min_stages`` stages are started from or moved
  to. The plan returned records in ``predicted["polish_stopped"]`` why the refinement it
  comes from ended short of a local optimum (the budget, or ``max_rounds``), where it did.
  """
  min_stages = problem.min_stages
  plans = sorted(
    (p for p in plans if p.predicted.get("memory_ok", True) and p.num_stages >= min_stages),
    key=lambda p: p.predicted["iteration_time"],
  )
  if not plans:
    raise ValueError(
      f"polish needs at least one plan within memory (of at least {min_stages} stages)"
    )
  best = plans[0]
  cutoff = refine_within * best.predicted["iteration_time"]
  done: list[int] = []
  budget = [max_evals]
  stops: list[tuple[Plan, str | None]] = []  # each refinement's plan, and why it stopped

  def refine(p: Plan) -> Plan:  # every refinement shares the budget and the simulations
    outcome: dict = {}
    q = refine_plan(problem, p, budget=budget, outcome=outcome)
    stops.append((q, outcome["stopped"]))
    return q

  for plan in plans:
    b = plan.stages[0].microbatch_size
    assert b is not None  # planners' plans set every stage's micro-batch size
    if b in done or len(done) >= refine_sizes or plan.predicted["iteration_time"] > cutoff:
      continue
    done.append(b)
    best = better(best, refine(plan))
  # The polished stages may suit a neighbouring micro-batch size better than their own.
  b = best.stages[0].microbatch_size
  assert b is not None
  microbatch_sizes = problem.microbatch_sizes()
  for b2 in (b // 2, 2 * b):
    if b2 not in microbatch_sizes:
      continue
    moved = _at_microbatch(problem, best, b2)
    if moved.predicted["memory_ok"] and moved.predicted["iteration_time"] <= cutoff:
      best = better(best, refine(moved))
  return _stopped(best, next((why for q, why in reversed(stops) if q is best), None))


def _at_microbatch(problem: PlanningProblem, plan: Plan, b: int) -> Plan:
  """The same stages at micro-batch size ``b`` (device counts cut to divisors of ``b``)."""
  ok = data_parallel_degrees(b, problem.cluster.num_devices)
  sequential = plan.sequential
  info = {k: v for k, v in plan.predicted.items() if k not in _PREDICTION_KEYS}
  stages = [(s.layers, max(d for d in ok if d <= len(s.devices))) for s in plan.stages]
  return assemble_plan(
    problem,
    stages,
    microbatch=b,
    planner=plan.planner,
    schedule=plan.schedule,
    layout=StageLayout(keep_order=sequential, sequential=sequential),
    info=info,
  )
