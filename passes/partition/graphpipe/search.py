"""GraphPipe's search: for every micro-batch size, one min-max DP run gives the depth / TPS
frontier; the best frontier plans are simulated; then the no-replication variant, the chain
seeds and the polish; the planner entry point ``graphpipe_plan``."""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

import networkx as nx
import numpy as np

from gpp_jax.cost.cluster import Cluster
from gpp_jax.cost.cost_model import CostModel, LayerCosts
from gpp_jax.ir.plan import Plan
from gpp_jax.passes.partition.graphpipe.context import MicrobatchContext
from gpp_jax.passes.partition.graphpipe.dp import MinMaxDP
from gpp_jax.passes.partition.graphpipe.tree import SPTreeNode
from gpp_jax.passes.partition.pipedream import chain_candidates, pipedream_plan
from gpp_jax.passes.partition.plan_assembly import (
  MAX_MICROBATCHES,
  assemble_plan,
  better,
  data_parallel_degrees,
  microbatch_sizes,
  no_plan_error,
  planner_inputs,
  predict,
)
from gpp_jax.passes.partition.refine import polish
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
  return SPTreeNode(sp.root, costs, incident, {}, edge_map)


def microbatch_context(
  b: int, B: int, dps: list[int], cluster: Cluster, cm: CostModel, costs: LayerCosts
) -> MicrobatchContext:
  """What one DP run holds fixed: micro-batch b of a batch B, the device counts a stage may
  take, per-layer times at b / d samples per device; transfers on the slowest link."""
  tsum = {}
  for d in dps:
    tf, tb = cm.layer_times(costs, cluster.device, b / d)
    tsum[d] = tf + tb
  link = cluster.slowest_link()
  return MicrobatchContext(
    b=b,
    B=B,
    M=B // b,
    K=cluster.num_devices,
    dps=dps,
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


def graphpipe_plan(
  layer_graph: nx.DiGraph,
  cluster: Cluster | int | None = None,
  batch_size: int | None = None,
  *,
  num_microbatches: int | None = None,
  cost_model: CostModel | None = None,
  schedule: str = "1f1b",
  powers_of_two: bool = False,
  max_microbatches: int | None = MAX_MICROBATCHES,
  simulate_top: int = 4,
  frontier_eps: float = 5e-3,
  prune: float = 1.25,
  replication_variant: bool = True,
  refine_sizes: int = 4,
  refine_within: float = 1.1,
  refine_evals: int = 200,
  chain_seeds: bool = True,
  serialise: bool = True,
  chain_plans: bool = True,
  seed_plans: Sequence[Plan] = (),
  polish_plans: bool = True,
  max_depth: int | None = None,
  schedules: tuple[str, ...] = (),
) -> Plan:
  """GraphPipe: LayerGraph + Cluster -> Plan with a stage DAG (see the module docstring).

  Args:
    layer_graph: the LayerGraph with costs.
    cluster: a Cluster, or a device count (a ``cpu_cluster``).
    batch_size: mini-batch size (default: the graph's batch size).
    num_microbatches: fix M (micro-batch = batch / M) instead of sweeping powers of two.
    cost_model: the CostModel (default: Adam fp32, "sum" TPS).
    schedule: the schedule generator the plan names ("1f1b", "graph-1f1b" or "gpipe").
    powers_of_two: restrict per-stage device counts to powers of two.
    max_microbatches: skip micro-batch sizes that would need more micro-batches than this.
    simulate_top: how many frontier plans per micro-batch size (best estimates first) are
      simulated.
    frontier_eps: a deeper frontier point is a candidate only where its TPS is more than this
      (relative) below the shallower candidate's.
    prune: skip a micro-batch size when B * t* exceeds ``prune`` times the best simulated
      iteration time so far (t* its smallest feasible TPS).
    replication_variant: at the two best micro-batch sizes, also search without data
      parallelism inside stages.
    refine_sizes: how many micro-batch sizes (best first) get their best plan polished by
      ``refine.refine_plan`` (layer moves, splits and merges against the simulator), among
      those whose best plan is within ``refine_within`` times the best simulated time.
    refine_evals: at most this many simulations for the polish, in all.
    chain_seeds: add the chain DP's plans (PipeDream's DP over the topological order, without
      ordering edges) to the candidates before polishing.
    serialise: let the DP solve children of a series or parallel node as one sequential
      pipeline (``serialised.py``). It costs most of the DP's time on graphs with many
      layers; switching it off is faster but loses plans that cut across branch boundaries
      (7% above the exhaustive optimum on one of the planner tests' graphs).
    chain_plans: take PipeDream's polished plan (``pipedream_plan``, simulated selection) as
      a candidate, with and without its ordering edges, so GraphPipe's plan is never slower
      than the polished PipeDream plan.
    seed_plans: finished plans of other planners for the same graph, cluster and batch (for
      instance the polished sequential baselines); they join the candidates after the polish,
      so the plan returned is at least as fast as each of them.
    polish_plans: run the polish (False: the fastest simulated candidate as it is, to measure
      what the search alone finds).
    max_depth: the deepest entry depth (stages on the longest path) the DP considers
      (default: the device count, i.e. no limit); a smaller one makes the DP cheaper.
    schedules: other schedule generators (e.g. ``("zero-bubble",)``) the best plan is also
      simulated with; the plan keeps the fastest within memory. Zero-bubble is simulated with
      the backward split into B and W (``PlanCosts.weight_fraction``) under the memory bound
      the device memory allows (``plan_assembly.memory_bound``).
  """
  t0 = time.perf_counter()
  cluster, cm, B, costs = planner_inputs(layer_graph, cluster, batch_size, cost_model)
  sp = sp_decompose(layer_graph)
  old_limit = sys.getrecursionlimit()
  sys.setrecursionlimit(max(old_limit, 20000))
  try:
    root = sp_tree(sp, costs)
    sizes = microbatch_sizes(B, num_microbatches, max_microbatches)
    # Phase 1: one DP run per micro-batch size (largest first) gives its depth / TPS frontier;
    # the plan at the smallest TPS t* is simulated at once, and a size whose perfect-balance
    # bound alone is clearly slower than the best simulated plan is skipped.
    per_size = []
    best: Plan | None = None
    evaluated: list[Plan] = []
    seen: set = set()
    n_cands = n_sims = runs = 0

    def consider(b, t, depth, stages):
      nonlocal best, n_sims
      key = (b, tuple(sorted((tuple(sorted(ls)), d) for ls, d in stages)))
      if key in seen:
        return
      seen.add(key)
      n_sims += 1
      plan = assemble_plan(
        layer_graph,
        cluster,
        [([costs.layers[l] for l in ls], d) for ls, d in stages],
        microbatch=b,
        batch_size=B,
        planner="graphpipe",
        schedule=schedule,
        cost_model=cm,
        costs=costs,
        info={"tps_target": float(t), "dp_entry_depth": depth},
      )
      best = better(best, plan)
      if plan.predicted["memory_ok"]:
        evaluated.append(plan)

    def context(b: int, dps: list[int]) -> MicrobatchContext:
      return microbatch_context(b, B, dps, cluster, cm, costs)

    def run_dp(ctx: MicrobatchContext) -> MinMaxDP | None:
      # Strategies whose bottleneck alone (B * TPS) is ``prune`` times the best simulated
      # time are not wanted (the sweep skips such sizes too): the DP drops them early.
      nonlocal runs
      runs += 1
      cap = math.inf if best is None else prune * best.predicted["iteration_time"] / B
      dp = MinMaxDP(ctx, serialise, max_depth, cap)
      return dp if dp.frontier(root) else None

    for b in sorted(sizes, reverse=True):
      dps = data_parallel_degrees(b, cluster.num_devices, powers_of_two)
      ctx = context(b, dps)
      tsum = ctx.tsum
      lo = sum(min(d * tsum[d][l] for d in dps) for l in range(len(costs))) / (ctx.K * b)
      if best is not None and B * lo > prune * best.predicted["iteration_time"]:
        continue
      dp = run_dp(ctx)
      if dp is not None:
        depth, t_star = dp.frontier(root)[-1]
        cands = frontier_candidates(dp, root, frontier_eps)
        per_size.append((cands[0][0] * b, b, dp, t_star, [c for c in cands if c[1] != depth]))
        consider(b, t_star, depth, dp.stages(root, ctx.K, depth))
    # Phase 2: most promising sizes first; skip a size whose bottleneck alone (B * t*) is
    # clearly slower than the best simulated plan; simulate the best frontier plans of the rest.
    per_size.sort(key=lambda x: x[:2])
    best_tps = min((x[3] for x in per_size), default=math.inf)
    for _, b, dp, t_star, cands in per_size:
      if best is not None and B * t_star > prune * best.predicted["iteration_time"]:
        continue
      n_cands += len(cands)
      for _, depth, t in cands[:simulate_top]:
        consider(b, t, depth, dp.stages(root, dp.K, depth))
    # Phase 3: the TPS objective spreads a stage's gradient all-reduce over the iteration,
    # but it runs after the stage's last backward; at the best micro-batch sizes, also search
    # without data parallelism (deeper, all-pipeline plans) and let the simulator decide.
    if replication_variant and cluster.num_devices > 1:
      top = sorted(evaluated, key=lambda p: p.predicted["iteration_time"])
      sizes_done = []
      for plan in top:
        mb = plan.stages[0].microbatch_size
        assert mb is not None  # assemble_plan sets every stage's micro-batch size
        if mb in sizes_done:
          continue
        sizes_done.append(mb)
        if len(sizes_done) > 2:
          break
        dp = run_dp(context(mb, [1]))
        if dp is not None:
          for _, depth, t in frontier_candidates(dp, root, frontier_eps)[:simulate_top]:
            consider(mb, t, depth, dp.stages(root, dp.K, depth))
  finally:
    sys.setrecursionlimit(old_limit)
  if best is None or not best.predicted.get("memory_ok", True):
    raise no_plan_error(
      "graphpipe", layer_graph, cluster, B, "every micro-batch size exceeds device memory"
    )
  t_dp = time.perf_counter() - t0
  # A chain of stages is a stage DAG too: the chain DP's optima over the topological order
  # join the candidates, so GraphPipe's plan space visibly contains the sequential one.
  t1 = time.perf_counter()
  if chain_seeds:
    chains = chain_candidates(
      layer_graph,
      cluster,
      B,
      sizes,
      cost_model=cm,
      costs=costs,
      schedule=schedule,
      simulate_top=3,
      sweep=False,
      planner="graphpipe",
      sequential=False,
    )
    evaluated += chains
    n_sims += len(chains)
  t_seeds = time.perf_counter() - t1
  # Phase 4: the DP's objective is a proxy; polish the best plans by local search on the
  # simulated time (device counts, layer moves, splits and merges, per micro-batch size).
  t1 = time.perf_counter()
  if not polish_plans:
    best = min(evaluated, key=lambda p: p.predicted["iteration_time"])
  else:
    best = polish(
      evaluated,
      layer_graph,
      cluster,
      cost_model=cm,
      costs=costs,
      refine_sizes=refine_sizes,
      refine_within=refine_within,
      max_evals=refine_evals,
      microbatch_sizes=sizes,
    )
  t_polish = time.perf_counter() - t1
  # Phase 5: the polished sequential plans are stage DAGs too; GraphPipe is never below them.
  t1 = time.perf_counter()
  seeds = list(seed_plans)
  if chain_plans:
    seeds.append(
      pipedream_plan(
        layer_graph,
        cluster,
        B,
        num_microbatches=num_microbatches,
        cost_model=cm,
        schedule=schedule,
        max_microbatches=max_microbatches,
      )
    )
  for seed in seeds:
    for plan in as_graphpipe(seed, layer_graph, cluster, cm, costs):
      n_sims += 1
      best = better(best, plan)
  t_seeds += time.perf_counter() - t1
  stats = SearchStats(
    seconds=time.perf_counter() - t0,
    dp_seconds=t_dp,
    seeds_seconds=t_seeds,
    polish_seconds=t_polish,
    dp_runs=runs,
    microbatch_sizes=tuple(sizes),
    candidates=n_cands,
    simulated=n_sims,
    best_tps=float(best_tps),
  )
  for name in schedules:
    if name != best.schedule:
      alt = predict(
        best.replace(schedule=name),
        layer_graph,
        cluster,
        cost_model=cm,
        costs=costs,
        idle=best.predicted.get("idle_devices", ()),
      )
      best = better(best, alt.replace(predicted={**best.predicted, **alt.predicted}))
  pred = dict(best.predicted)
  pred["search"] = stats.to_dict()
  pred["sp_ordering_edges"] = len(sp.added_edges)
  return best.replace(predicted=pred)


def as_graphpipe(
  plan: Plan,
  layer_graph: nx.DiGraph,
  cluster: Cluster,
  cm: CostModel,
  costs,
) -> list[Plan]:
  """Another planner's plan as GraphPipe candidates: its stages and devices as they are, and,
  for a chain, the same stages without the ordering edges no tensor flows along."""
  b = plan.stages[0].microbatch_size
  assert b is not None and plan.batch_size is not None
  stages = [(s.layers, len(s.devices)) for s in plan.stages]
  order = [d for s in plan.stages for d in s.devices]
  order += [d for d in range(cluster.num_devices) if d not in set(order)]
  out = []
  chain = bool(plan.predicted.get("sequential"))
  for sequential in (True, False) if chain else (False,):
    p = assemble_plan(
      layer_graph,
      cluster,
      stages,
      microbatch=b,
      batch_size=plan.batch_size,
      planner="graphpipe",
      schedule=plan.schedule,
      sequential=sequential,
      keep_order=True,
      device_order=order,
      extra_edges=() if chain else plan.edges,
      cost_model=cm,
      costs=costs,
      info={"seed": plan.planner},
    )
    if p.predicted["memory_ok"]:
      out.append(p)
  return out
