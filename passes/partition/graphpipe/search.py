"""GraphPipe's search, phase by phase: the SP decomposition, one min-max DP run per micro-batch
size (its depth / TPS frontier, the best frontier plans simulated), the no-replication
variant, the chain seeds, the polish and the seed plans; ``graphpipe_search`` runs them in
order on a ``PlanningProblem``; ``graphpipe_plan`` is the keyword entry point."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import networkx as nx
import numpy as np

from gpp_jax.cost.cost_model import LayerCosts
from gpp_jax.errors import PlanError
from gpp_jax.ir.plan import Plan
from gpp_jax.passes.partition.graphpipe.context import MicrobatchContext
from gpp_jax.passes.partition.graphpipe.dp import MinMaxDP, Stages
from gpp_jax.passes.partition.graphpipe.tree import SPTreeNode, TreeCosts
from gpp_jax.passes.partition.pipedream import (
  PIPEDREAM,
  ChainSearch,
  PipeDreamOptions,
  chain_candidates,
  chain_fits,
  chain_table,
)
from gpp_jax.passes.partition.plan_assembly import (
  StageLayout,
  assemble_plan,
  better,
  data_parallel_degrees,
  no_plan_error,
)
from gpp_jax.passes.partition.problem import (
  PlanningProblem,
  ProblemPlanner,
  device_unit,
  no_plan_with_stages_error,
)
from gpp_jax.passes.partition.range_costs import RangeCosts
from gpp_jax.passes.partition.refine import REFINE_WITHIN, polish
from gpp_jax.passes.series_parallel import SPDecomposition, sp_decompose


@dataclasses.dataclass(frozen=True)
class SearchStats:
  """What the search did (recorded in ``plan.predicted['search']``)."""

  seconds: float
  dp_seconds: float
  seeds_seconds: float
  polish_seconds: float
  dp_runs: int
  microbatch_sizes: tuple[int, ...]
  candidates: int
  simulated: int
  best_tps: float
  device_unit: int = 1

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def sp_tree(sp: SPDecomposition, costs: LayerCosts) -> SPTreeNode:
  """The DP's tree for an SP decomposition (transfer bytes per layer and per edge attached)."""
  incident = np.zeros(len(costs))
  edge_map: dict = {}  # u -> [(v, bytes)]; ("in", v) -> [(u, bytes)]
  for u, v, nbytes in costs.edges:
    incident[u] += nbytes
    incident[v] += nbytes
    edge_map.setdefault(u, []).append((v, nbytes))
    edge_map.setdefault(("in", v), []).append((u, nbytes))
  return SPTreeNode(sp.root, TreeCosts(costs, incident, edge_map))


def microbatch_context(
  problem: PlanningProblem, b: int, dps: list[int], unit: int = 1
) -> MicrobatchContext:
  """What one DP run holds fixed: micro-batch b of the problem's batch B, the device counts a
  stage may take (those of ``dps`` that are multiples of ``unit``), per-layer times at b / d
  samples per device; transfers on the cluster's slowest link; devices counted in slots of
  ``unit``."""
  cluster, cm, B, costs = problem.inputs()
  dps = [d for d in dps if d % unit == 0]
  tsum = {}
  for d in dps:
    tf, tb = cm.planner_layer_times(costs, cluster, b / d)
    tsum[d] = tf + tb
  link = cluster.slowest_link()
  return MicrobatchContext(
    b=b,
    B=B,
    M=B // b,
    K=cluster.num_devices // unit,
    dps=dps,
    unit=unit,
    tsum=tsum,
    mem_cap=cluster.memory_per_device,
    p2p_alpha=link.alpha,
    p2p_beta=link.beta,
    cm=cm,
    cluster=cluster,
    costs=costs,
  )


def frontier_candidates(
  dp: MinMaxDP, root: SPTreeNode, eps: float
) -> list[tuple[float, int, float]]:
  """The root's depth / TPS frontier as (estimate, depth, TPS), best estimate first, where the
  estimate (M + depth - 1) * TPS is the synchronous 1F1B time per sample of the mini-batch. A
  deeper point is kept only where it lowers the TPS by more than ``eps`` (relative) below the
  last point kept, so the simulations go to plans that differ."""
  M = dp.ctx.M
  kept: list[tuple[int, float]] = []
  for e, t in dp.frontier(root):
    if not kept or t < (1 - eps) * kept[-1][1]:
      kept.append((e, t))
  return sorted(((M + e - 1) * t, e, t) for e, t in kept)


@dataclasses.dataclass(frozen=True)
class GraphPipeOptions:
  """GraphPipe's search options (the problem itself is a ``PlanningProblem``).

  Attributes:
    powers_of_two: restrict per-stage device counts to powers of two.
    device_grid: the DP counts devices in slots of u devices, u the smallest power of two
      with at most this many slots (None: single devices); the polish then moves single
      devices. Up to ``device_grid`` devices the DP sees every count.
    chain_device_grid: ``device_grid`` of PipeDream's chain DP where GraphPipe uses it: its
      chain seeds, the PipeDream seed (``chain_plans``) and the chain table the DP shares
      with them (default: PipeDream's own, ``PipeDreamOptions.device_grid``). With
      ``device_grid=None`` too, no part of the search counts devices in slots (the exact DP
      ``benchmarks/device_grid.py`` compares the default with).
    simulate_top: how many frontier plans per micro-batch size (best estimates first) are
      simulated.
    frontier_eps: a deeper frontier point is a candidate only where its TPS is more than this
      (relative) below the shallower candidate's.
    prune: skip a micro-batch size when B * t* exceeds ``prune`` times the best simulated
      iteration time so far (t* its smallest feasible TPS).
    replication_variant: at the two best micro-batch sizes, also search without data
      parallelism inside stages.
    refine_sizes, refine_within, refine_evals: the polish (``refine.polish``) refines the
      best plan of the ``refine_sizes`` best micro-batch sizes within ``refine_within`` times
      the best simulated time, with at most ``refine_evals`` simulations in all.
    chain_seeds: add the chain DP's plans (PipeDream's DP over the topological order, without
      ordering edges) to the candidates before polishing. PipeDream's polished plan
      (``chain_plans``) starts from the same optima, but the polish may start GraphPipe's own
      local search from one of them and end elsewhere (CANDLE-Uno on 16 V100s: 4% faster).
    serialise: let the DP solve children of a series or parallel node as one sequential
      pipeline (``serialised.py``); off is faster but loses plans that cut across branches.
    chain_plans: take PipeDream's polished plan as a candidate, with and without its
      ordering edges, so GraphPipe's plan is never slower than it.
    seed_plans: finished plans of other planners for the same problem; they join the
      candidates after the polish.
    polish_plans: run the polish (False: the fastest simulated candidate as it is).
    max_depth: the deepest entry depth the DP considers (default: no limit).
    schedules: other schedule generators (e.g. ``("zero-bubble",)``) the best plan is also
      simulated with; the plan keeps the fastest within memory.
  """

  powers_of_two: bool = False
  device_grid: int | None = 32
  chain_device_grid: int | None = PipeDreamOptions().device_grid
  simulate_top: int = 4
  frontier_eps: float = 5e-3
  prune: float = 1.25
  replication_variant: bool = True
  refine_sizes: int = 4
  refine_within: float = REFINE_WITHIN
  refine_evals: int = 200
  chain_seeds: bool = True
  serialise: bool = True
  chain_plans: bool = True
  seed_plans: Sequence[Plan] = ()
  polish_plans: bool = True
  max_depth: int | None = None
  schedules: tuple[str, ...] = ()


class Candidates:
  """The simulated plans of one search: the best so far, those within memory, and the stage
  choices already simulated (each is simulated once).

  Under the problem's ``min_stages`` a plan of fewer stages is simulated but is no candidate:
  it is kept apart (``short``, those within memory) only to say which micro-batch sizes the
  DP's strategies do best at (``no_replication``), and ``best`` and ``evaluated`` hold the
  plans of enough stages."""

  def __init__(self, problem: PlanningProblem):
    self.problem = problem
    self.best: Plan | None = None
    self.evaluated: list[Plan] = []
    self.handed: list[Plan] = []
    self.short: list[Plan] = []
    self.seen: set = set()
    self.simulated = 0

  def bound(self, prune: float) -> float:
    """``prune`` times the best simulated iteration time (inf before the first plan)."""
    return math.inf if self.best is None else prune * self.best.predicted["iteration_time"]

  def consider(
    self, b: int, t: float, depth: int, stages: Stages, ctx: MicrobatchContext | None = None
  ) -> None:
    """Simulates the DP's strategy (stages of layer indices, device counts) at micro-batch b;
    with ``ctx``, also the strategy with its idle devices handed out (``hand_out``), kept
    apart in ``handed`` (it joins after the polish, so the polish sees what it saw before)."""
    info = {"tps_target": float(t), "dp_entry_depth": depth}
    if self.first_time(b, stages):
      self.add(self.assemble(b, stages, info))
    if ctx is None:
      return
    filled = hand_out(stages, ctx, self.problem)
    if filled != stages and self.first_time(b, filled):
      self.simulated += 1
      plan = self.assemble(b, filled, {**info, "idle_handed_out": True})
      if plan.predicted["memory_ok"] and self.problem.enough_stages(plan):
        self.handed.append(plan)

  def first_time(self, b: int, stages: Stages) -> bool:
    key = (b, tuple(sorted((tuple(sorted(ls)), d) for ls, d in stages)))
    if key in self.seen:
      return False
    self.seen.add(key)
    return True

  def assemble(self, b: int, stages: Stages, info: dict[str, Any]) -> Plan:
    p = self.problem
    return assemble_plan(
      p,
      [([p.costs.layers[l] for l in ls], d) for ls, d in stages],
      microbatch=b,
      planner="graphpipe",
      info=info,
    )

  def add(self, plan: Plan) -> None:
    self.simulated += 1
    if not self.problem.enough_stages(plan):
      if plan.predicted["memory_ok"]:
        self.short.append(plan)
      return
    self.best = better(self.best, plan)
    if plan.predicted["memory_ok"]:
      self.evaluated.append(plan)


@dataclasses.dataclass
class SizeResult:
  """One micro-batch size's DP run: its best estimate, t* and the other frontier points."""

  estimate: float
  b: int
  dp: MinMaxDP
  t_star: float
  frontier: list[tuple[float, int, float]]


class DPRuns:
  """Runs the min-max DP for micro-batch contexts of one problem (phase 1 of the search)."""

  def __init__(self, problem: PlanningProblem, opts: GraphPipeOptions, root: SPTreeNode):
    self.problem, self.opts, self.root = problem, opts, root
    self.unit = device_unit(problem.num_devices, opts.device_grid)
    self.runs = 0
    g = problem.layer_graph
    # On a chain of layers every stage DAG is a chain of ranges, so where PipeDream's chain
    # DP (the same memory rule, the device counts a superset) fits nothing, neither does this.
    self.chain = nx.is_weakly_connected(g) and all(
      g.in_degree(v) <= 1 and g.out_degree(v) <= 1 for v in g
    )

  def context(self, b: int, dps: list[int]) -> MicrobatchContext:
    return microbatch_context(self.problem, b, dps, unit=self.unit)

  def run(self, ctx: MicrobatchContext, cap: float) -> MinMaxDP | None:
    """The DP's tables for ``ctx``; strategies whose bottleneck alone (B * TPS) is above
    ``cap`` (``prune`` times the best simulated time) are dropped early."""
    p = self.problem
    if not ctx.dps or p.cost_model.memory_rules_out(
      p.costs.held_param_bytes,
      p.costs.saved_ps,
      ctx.b,
      ctx.dps,
      p.num_devices,
      p.cluster.memory_per_device,
    ):
      return None
    # The ranges' bytes alone (no per-degree times: ``chain_fits`` reads none).
    if self.chain and not chain_fits(
      RangeCosts(p.costs, p.cost_model, p.cluster, ctx.b, p.batch_size, []), ctx.dps, 1e-9
    ):
      return None
    self.runs += 1
    dp = MinMaxDP(
      ctx,
      self.opts.serialise,
      self.opts.max_depth,
      cap / self.problem.batch_size,
      self.pipedream_table(ctx),
    )
    return dp if dp.frontier(self.root) else None

  def pipedream_table(self, ctx: MicrobatchContext) -> Callable[[], np.ndarray] | None:
    """PipeDream's chain DP table for ``ctx`` (``pipedream.chain_table``, kept in the
    problem's ``chain_tables``), where the DP may read its serialised chain of the whole graph
    off it (``MinMaxDP.chain_of_table``) and PipeDream's search for the seed
    (``chain_plans``) builds that very table anyway: at every micro-batch size, with
    replication, in its own device unit. The context must count devices the same way (its
    unit and device counts those of the table), and the device counts must be powers of two:
    a stage's stashed bytes per device, saved x b / d there and saved x (b / d) here, are
    then the same float. None where the table is not shared."""
    p = self.problem
    unit = device_unit(p.num_devices, self.opts.chain_device_grid)
    dps = [d for d in data_parallel_degrees(ctx.b, p.num_devices) if d % unit == 0]
    if (
      not self.opts.chain_plans
      or ctx.unit != unit
      or ctx.dps != dps
      or any(d & (d - 1) for d in dps)
    ):
      return None

    def table() -> np.ndarray:
      return chain_table(p, ctx.b, True, unit).A

    return table

  def stages(self, dp: MinMaxDP, depth: int) -> Stages:
    """The strategy at the root's frontier point ``depth`` (device counts in devices)."""
    u = dp.ctx.unit
    return [(ls, d * u) for ls, d in dp.stages(self.root, dp.K, depth)]

  def lower_bound(self, ctx: MicrobatchContext) -> float:
    """B * the TPS of perfect balance over all devices (no transfers, no all-reduce)."""
    p = self.problem
    per_layer = [min(d * ctx.tsum[d][l] for d in ctx.dps) for l in range(len(p.costs))]
    return p.batch_size * sum(per_layer) / (p.num_devices * ctx.b)


def hand_out(stages: Stages, ctx: MicrobatchContext, problem: PlanningProblem) -> Stages:
  """The DP's strategy with its idle devices handed out: the min-max DP leaves devices idle
  once the bottleneck cannot improve, and a local search that adds devices to one stage at a
  time cannot see the gain when several stages are equally slow; here, repeatedly, the stage
  with the largest time per sample (compute and update, at its device count) that has a
  larger device count (of ``ctx.dps``) within the idle devices and faster there takes it."""
  params = problem.costs.held_param_bytes

  def tps(ls: list[int], d: int) -> float:
    return float(ctx.tsum[d][ls].sum()) / ctx.b + ctx.upd(float(params[ls].sum()), d) / ctx.B

  out = list(stages)
  idle = problem.num_devices - sum(d for _, d in out)
  while idle > 0:
    best = None
    for i, (ls, d) in enumerate(out):
      up = next((d2 for d2 in ctx.dps if d2 > d), None)
      if up is None or up - d > idle:
        continue
      now = tps(ls, d)
      if tps(ls, up) < now and (best is None or now > best[0]):
        best = (now, i, up)
    if best is None:
      break
    _, i, up = best
    idle -= up - out[i][1]
    out[i] = (out[i][0], up)
  return out


def sweep_sizes(runs: DPRuns, sizes: list[int], cands: Candidates) -> list[SizeResult]:
  """Phases 1 and 2: one DP run per micro-batch size (largest first) gives its depth / TPS
  frontier, the plan at t* simulated at once (a size whose perfect-balance bound is already
  ``prune`` times the best simulated time is skipped); then, most promising sizes first,
  the best frontier plans of each size whose bottleneck alone is not clearly slower."""
  opts = runs.opts
  B = runs.problem.batch_size
  per_size = []
  for b in sorted(sizes, reverse=True):
    dps = data_parallel_degrees(b, runs.problem.num_devices, opts.powers_of_two)
    ctx = runs.context(b, dps)
    if not ctx.dps or runs.lower_bound(ctx) > cands.bound(opts.prune):
      continue
    dp = runs.run(ctx, cands.bound(opts.prune))
    if dp is None:
      continue
    depth, t_star = dp.frontier(runs.root)[-1]
    front = frontier_candidates(dp, runs.root, opts.frontier_eps)
    rest = [c for c in front if c[1] != depth]
    per_size.append(SizeResult(front[0][0] * b, b, dp, t_star, rest))
    cands.consider(b, t_star, depth, runs.stages(dp, depth), dp.ctx)
  per_size.sort(key=lambda r: (r.estimate, r.b))
  for r in per_size:
    if B * r.t_star > cands.bound(opts.prune):
      continue
    for _, depth, t in r.frontier[: opts.simulate_top]:
      cands.consider(r.b, t, depth, runs.stages(r.dp, depth), r.dp.ctx)
  return per_size


def finer_grid_may_plan(runs: DPRuns, sizes: Sequence[int]) -> bool:
  """Whether counting devices in smaller slots than ``runs.unit`` can give the DP strategies
  its grid left out: no micro-batch size allows a stage a multiple of the unit as its device
  count (a stage's devices each take whole samples of its micro-batch), or the slots are
  fewer than the stages a chain of the layers needs for their weights, gradients and
  optimizer state alone (layers packed in topological order up to the device memory)."""
  p, u = runs.problem, runs.unit
  if u <= 1:
    return False
  missed = missed_degrees(runs, sizes)
  if len(missed) == len(sizes):  # the sizes are distinct
    # Halved while the DP stays within HALVED_SLOTS grids' worth of slots; beyond that,
    # ``finer_for_missed_sizes`` searches each size in slots of one of its own degrees
    # (halving down to single devices made a DP of 630 slots: 68 s for one size).
    grid = runs.opts.device_grid or p.num_devices
    if p.num_devices // (u // 2) <= HALVED_SLOTS * grid:
      return True
    if any(missed_size_unit(ds, p.num_devices, grid) is None for ds in missed.values()):
      return True
  stages, held = 1, 0.0
  for x in p.cost_model.static_memory(p.costs.held_param_bytes):
    if held > 0 and held + x > p.memory_limit:
      stages, held = stages + 1, 0.0
    held += float(x)
  return p.num_devices // u < stages <= p.num_devices


def missed_degrees(runs: DPRuns, sizes: Sequence[int]) -> dict[int, list[int]]:
  """The micro-batch sizes none of whose data-parallel degrees is a multiple of the DP's
  device unit (at that grid no stage can take them), each with its degrees."""
  N, u, pow2 = runs.problem.num_devices, runs.unit, runs.opts.powers_of_two
  out = {}
  for b in sizes:
    degrees = data_parallel_degrees(b, N, pow2)
    if not any(d % u == 0 for d in degrees):
      out[b] = degrees
  return out


def finer_for_missed_sizes(
  runs: DPRuns, sizes: Sequence[int], cands: Candidates
) -> list[SizeResult]:
  """The sizes the device grid left out (``missed_degrees``: a replica count such as 6 of 384
  rows in slots of 16), each searched in slots of a size it allows: the smallest of its
  data-parallel degrees that keeps the DP within ``MISSED_SIZE_SLOTS`` grids' worth of slots
  (a stage then takes a multiple of that many devices), under the same pruning as the sweep (a
  size whose perfect-balance bound is already slower than the best simulated plan is
  skipped). The DP's unit is restored afterwards."""
  p, opts = runs.problem, runs.opts
  if opts.device_grid is None:
    return []
  by_unit: dict[int, list[int]] = {}
  for b, degrees in missed_degrees(runs, sizes).items():
    slot = missed_size_unit(degrees, p.num_devices, opts.device_grid)
    if slot is not None:
      by_unit.setdefault(slot, []).append(b)
  unit, out = runs.unit, []
  try:
    for u in sorted(by_unit, reverse=True):
      runs.unit = u
      out += sweep_sizes(runs, by_unit[u], cands)
  finally:
    runs.unit = unit
  return out


def missed_size_unit(degrees: Sequence[int], num_devices: int, grid: int) -> int | None:
  """The device unit ``finer_for_missed_sizes`` searches a size the grid left out in: the
  smallest of its data-parallel ``degrees`` that keeps the DP within ``MISSED_SIZE_SLOTS``
  grids' worth of slots; None where none does."""
  fits = [d for d in degrees if num_devices // d <= MISSED_SIZE_SLOTS * grid]
  return min(fits) if fits else None


MISSED_SIZE_SLOTS = 2  # a size the grid left out is searched in at most this many grids' slots
HALVED_SLOTS = 4  # where every size is left out, the grid is halved up to this many grids' slots


def no_replication(runs: DPRuns, cands: Candidates) -> None:
  """Phase 3: the TPS objective spreads a stage's gradient all-reduce over the iteration, but
  it runs after the stage's last backward; at the two best micro-batch sizes, search again
  with one slot of the DP's device unit per stage (deeper, all-pipeline plans) and let the
  simulator decide. The sizes are those of the best plans simulated, of too few stages for
  ``min_stages`` too (their sizes suit the model; the variant's deeper plans may have
  enough)."""
  sizes: list[int] = []
  simulated = cands.evaluated + cands.short
  for plan in sorted(simulated, key=lambda p: p.predicted["iteration_time"]):
    b = plan.stages[0].microbatch_size
    assert b is not None  # assemble_plan sets every stage's micro-batch size
    if b in sizes:
      continue
    sizes.append(b)
    if len(sizes) > 2:
      break
    ctx = runs.context(b, [runs.unit])
    dp = runs.run(ctx, cands.bound(runs.opts.prune))
    if dp is not None:
      for _, depth, t in frontier_candidates(dp, runs.root, runs.opts.frontier_eps)[
        : runs.opts.simulate_top
      ]:
        cands.consider(b, t, depth, runs.stages(dp, depth), dp.ctx)


def chain_seed_plans(
  problem: PlanningProblem, sizes: list[int], grid: int | None = PipeDreamOptions().device_grid
) -> list[Plan]:
  """A chain of stages is a stage DAG too: the chain DP's optima over the topological order
  (without ordering edges), so GraphPipe's plan space visibly contains the sequential one.
  The chain DP's tables are PipeDream's (shared through the problem), counting devices in
  slots for ``grid`` (``GraphPipeOptions.chain_device_grid``)."""
  search = ChainSearch(
    planner="graphpipe",
    sequential=False,
    simulate_top=3,
    sweep=False,
    unit=device_unit(problem.num_devices, grid),
  )
  return chain_candidates(problem, sizes, search)


def polished(problem: PlanningProblem, opts: GraphPipeOptions, cands: Candidates) -> Plan:
  """Phase 4: the DP's objective is a proxy; the best plans are polished by local search on
  the simulated time (device counts, layer moves, splits and merges, per micro-batch size).
  Then the best strategy with its idle devices handed out, polished on its own (a quarter of
  the budget), where it beats every candidate the polish started from (a rule that does not
  hang on how far the polish went). The polish keeps to plans of the problem's
  ``min_stages`` stages."""
  if not opts.polish_plans:
    return min(cands.evaluated + cands.handed, key=lambda p: p.predicted["iteration_time"])

  def run(plans: list[Plan], refine_sizes: int, max_evals: int) -> Plan:
    return polish(
      problem,
      plans,
      refine_sizes=refine_sizes,
      refine_within=opts.refine_within,
      max_evals=max_evals,
    )

  start = min(p.predicted["iteration_time"] for p in cands.evaluated)
  best = run(cands.evaluated, opts.refine_sizes, opts.refine_evals)
  handed = min(cands.handed, key=lambda p: p.predicted["iteration_time"], default=None)
  if handed is not None and handed.predicted["iteration_time"] < start:
    best = better(best, run([handed], 1, max(1, opts.refine_evals // 4)))
  return best


def seeded(problem: PlanningProblem, opts: GraphPipeOptions, best: Plan) -> tuple[Plan, int]:
  """Phase 5: the polished sequential plans (PipeDream's, and ``seed_plans``) are stage DAGs
  too; GraphPipe's plan is never slower than them (those of at least ``min_stages`` stages:
  PipeDream's search keeps to them too). Returns the plan and the simulations."""
  seeds = [p for p in opts.seed_plans if problem.enough_stages(p)]
  if opts.chain_plans:
    # Where PipeDream's chain finds no plan (its device grid, memory) there is none to add.
    with contextlib.suppress(PlanError):
      seeds.append(PIPEDREAM.plan(problem, PipeDreamOptions(device_grid=opts.chain_device_grid)))
  n = 0
  for seed in seeds:
    for plan in as_graphpipe(problem, seed):
      n += 1
      best = better(best, plan)
  return best, n


def other_schedules(problem: PlanningProblem, names: Sequence[str], best: Plan) -> Plan:
  """The best plan simulated with the other schedule generators; the fastest within memory."""
  for name in names:
    if name != best.schedule:
      alt = problem.predict(
        best.replace(schedule=name), idle=best.predicted.get("idle_devices", ())
      )
      best = better(best, alt.replace(predicted={**best.predicted, **alt.predicted}))
  return best


def graphpipe_search(problem: PlanningProblem, opts: GraphPipeOptions) -> Plan:
  """GraphPipe: PlanningProblem -> Plan with a stage DAG (see the package docstring)."""
  t0 = time.perf_counter()
  sp = sp_decompose(problem.layer_graph)
  sizes = problem.microbatch_sizes()
  cands = Candidates(problem)
  old_limit = sys.getrecursionlimit()
  sys.setrecursionlimit(max(old_limit, 20000))
  try:
    runs = DPRuns(problem, opts, sp_tree(sp, problem.costs))
    per_size = sweep_sizes(runs, sizes, cands)
    if opts.replication_variant and problem.num_devices > 1:
      no_replication(runs, cands)
    while not cands.evaluated and not cands.short and finer_grid_may_plan(runs, sizes):
      runs.unit //= 2  # the device grid left the DP no strategy: slots half as large
      per_size += sweep_sizes(runs, sizes, cands)
      if opts.replication_variant and problem.num_devices > 1:
        no_replication(runs, cands)
    per_size += finer_for_missed_sizes(runs, sizes, cands)
  finally:
    sys.setrecursionlimit(old_limit)
  if not cands.evaluated and not cands.short:
    raise no_plan_error(
      "graphpipe",
      problem.layer_graph,
      problem.cluster,
      problem.batch_size,
      "every micro-batch size exceeds device memory",
    )
  t_dp = time.perf_counter() - t0
  t1 = time.perf_counter()
  if opts.chain_seeds:
    for plan in chain_seed_plans(problem, sizes, opts.chain_device_grid):
      cands.add(plan)
  if not cands.evaluated:  # every plan within memory has fewer than min_stages stages
    raise no_plan_with_stages_error(
      "graphpipe",
      problem.min_stages,
      "none of its DP's strategies"
      + (" or chain seeds" if opts.chain_seeds else " (chain_seeds=False)")
      + " of that many stages fits device memory",
    )
  t_seeds = time.perf_counter() - t1
  t1 = time.perf_counter()
  best = polished(problem, opts, cands)
  t_polish = time.perf_counter() - t1
  t1 = time.perf_counter()
  best, n_seeded = seeded(problem, opts, best)
  t_seeds += time.perf_counter() - t1
  stats = SearchStats(
    seconds=time.perf_counter() - t0,
    dp_seconds=t_dp,
    seeds_seconds=t_seeds,
    polish_seconds=t_polish,
    dp_runs=runs.runs,
    microbatch_sizes=tuple(sizes),
    candidates=sum(len(r.frontier) for r in per_size),
    simulated=cands.simulated + n_seeded,
    best_tps=float(min((r.t_star for r in per_size), default=math.inf)),
    device_unit=runs.unit,
  )
  best = other_schedules(problem, opts.schedules, best)
  pred = dict(best.predicted)
  pred["search"] = stats.to_dict()
  pred["sp_ordering_edges"] = len(sp.added_edges)
  return best.replace(predicted=pred)


GRAPHPIPE = ProblemPlanner("graphpipe", GraphPipeOptions, graphpipe_search)


# The keyword form (``GRAPHPIPE(layer_graph, cluster, batch_size, **options)``) under its own name.
graphpipe_plan = GRAPHPIPE


def as_graphpipe(problem: PlanningProblem, plan: Plan) -> list[Plan]:
  """Another planner's plan for ``problem`` as GraphPipe candidates: its stages and devices as
  they are, and, for a chain, the same stages without the ordering edges no tensor flows
  along (simulated with the problem's simulations, where the plan as it is was simulated
  already). They record the planner as ``predicted["seed"]``, and how its polish ended
  (``polish_stopped``)."""
  b = plan.stages[0].microbatch_size
  assert b is not None and plan.batch_size is not None
  stages = [(s.layers, len(s.devices)) for s in plan.stages]
  order = [d for s in plan.stages for d in s.devices]
  order += [d for d in range(problem.num_devices) if d not in set(order)]
  out = []
  chain = plan.sequential
  info = {"seed": plan.planner}
  if "polish_stopped" in plan.predicted:  # how the seed's own polish ended
    info["polish_stopped"] = plan.predicted["polish_stopped"]
  for sequential in (True, False) if chain else (False,):
    layout = StageLayout(
      extra_edges=() if chain else plan.edges,
      keep_order=True,
      sequential=sequential,
      device_order=order,
    )
    p = assemble_plan(
      problem,
      stages,
      microbatch=b,
      planner="graphpipe",
      schedule=plan.schedule,
      layout=layout,
      info=info,
    )
    if p.predicted["memory_ok"]:
      out.append(p)
  return out
