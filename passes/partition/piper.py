"""Piper planner: LayerGraph + Cluster -> a sequential Plan of contiguous stages.

Piper (Tarnawski, Narayanan, Phanishayee; NeurIPS'21; reference code msr-fiddle/piper,
``algo.cpp``) runs a dynamic program over *downsets* of the layer DAG (successor-closed layer
sets, what its code calls ideals). A stage is the difference ``I \\ I'`` of two downsets
``I' ⊂ I``, which is always convex; the DP peels one stage at a time off the front, so the
stages it returns are totally ordered: a sequential pipeline whose stages may mix layers of
different branches.

  dp[∅][k][0] = 0
  dp[I][k][s] = min over downsets I' ⊊ I and d | b, d <= k, with
                memory(I \\ I', d, min(s, M)) <= capacity, of
                max(TPS(I \\ I', d), dp[I'][k - d][s - 1])

``s`` counts the stages of I; a stage that is s-th from the end holds min(s, M) micro-batches
in synchronous 1F1B (Piper's own code uses the PipeDream-2BW count ceil(s/d); this repository
runs PipeDream-Flush, so it uses the flush count). There is no tensor parallelism here, so
Piper's TMPC choice is the single "data parallel" configuration. TPS is the shared cost model.
As for PipeDream, the micro-batch size is swept over powers of two and the optima with the
best estimates (M + s - 1) * TPS * b are simulated; the fastest plan wins.

The number of downsets grows as l^b for b branches of l layers, and the DP visits every pair
(I', I). ``max_downsets`` and ``max_pairs`` bound the work; beyond them the planner raises
PlanError (GraphPipe reports Piper finding no strategy for DLRM and CANDLE-Uno for this reason).
"""

from __future__ import annotations

import math
import time

import networkx as nx
import numpy as np

from gpp_jax.cost.cluster import Cluster
from gpp_jax.cost.cost_model import CostModel
from gpp_jax.errors import PlanError
from gpp_jax.ir.plan import Plan
from gpp_jax.passes.partition.plan_assembly import (
  MAX_MICROBATCHES,
  assemble_plan,
  better,
  data_parallel_degrees,
  microbatch_sizes,
  no_plan_error,
  planner_inputs,
)
from gpp_jax.passes.partition.refine import polish


def downsets(layer_graph: nx.DiGraph, order: list[str], limit: int) -> list[int]:
  """All successor-closed layer sets as bitmasks over ``order``, smallest first.

  Raises PlanError when there are more than ``limit``.
  """
  pos = {l: i for i, l in enumerate(order)}
  succ = [0] * len(order)
  for u, v in layer_graph.edges:
    succ[pos[u]] |= 1 << pos[v]
  seen = {0}
  frontier = [0]
  while frontier:
    nxt = []
    for I in frontier:
      for v in range(len(order)):
        bit = 1 << v
        if not I & bit and succ[v] & ~I == 0:
          J = I | bit
          if J not in seen:
            seen.add(J)
            nxt.append(J)
            if len(seen) > limit:
              raise PlanError(
                f"piper: {layer_graph.graph.get('name', 'the graph')} has more than {limit} "
                f"downsets (successor-closed layer sets) over {len(order)} layers; Piper's "
                "DP is quadratic in their number, which explodes with the number of parallel "
                "branches. Use the graphpipe or pipedream planner, coarsen the layers, or "
                "raise max_downsets."
              )
    frontier = nxt
  return sorted(seen, key=lambda m: (bin(m).count("1"), m))


def piper_plan(
  layer_graph: nx.DiGraph,
  cluster: Cluster | int | None = None,
  batch_size: int | None = None,
  *,
  num_microbatches: int | None = None,
  cost_model: CostModel | None = None,
  schedule: str = "1f1b",
  max_downsets: int = 4000,
  max_pairs: int = 150_000,
  max_microbatches: int | None = MAX_MICROBATCHES,
  simulate_top: int = 6,
) -> Plan:
  """Piper: LayerGraph + Cluster -> sequential Plan over downset differences.

  Args:
    layer_graph, cluster, batch_size, num_microbatches: as for every planner.
    cost_model: the CostModel.
    schedule: the schedule generator the plan names.
    max_downsets, max_pairs: state limits; PlanError beyond them.
    max_microbatches: skip micro-batch sizes needing more micro-batches than this.
    simulate_top: how many (micro-batch, stage count) optima are simulated.
  """
  t0 = time.perf_counter()
  cluster, cm, B, costs = planner_inputs(layer_graph, cluster, batch_size, cost_model)
  K = cluster.num_devices
  order = list(costs.layers)
  n = len(order)
  sets = downsets(layer_graph, order, max_downsets)
  D = len(sets)
  member = np.array([[(m >> i) & 1 for i in range(n)] for m in sets], dtype=bool)  # (D, n)
  size = member.sum(axis=1)
  # Proper sub-downsets of each downset.
  subs = []
  pairs = 0
  for a in range(D):
    ok = ~(member & ~member[a]).any(axis=1) & (size < size[a])
    idx = np.nonzero(ok)[0]
    subs.append(idx)
    pairs += len(idx)
    if pairs > max_pairs:
      raise PlanError(
        f"piper: more than {max_pairs} downset pairs ({D} downsets over {n} layers); the "
        "DP visits every pair, which explodes with the number of parallel branches. Use the "
        "graphpipe or pipedream planner, coarsen the layers, or raise max_pairs."
      )
  eu = np.array([u for u, _, _ in costs.edges], dtype=int)
  ev = np.array([v for _, v, _ in costs.edges], dtype=int)
  eb = np.array([b for _, _, b in costs.edges], dtype=float)
  if len(eb):
    cin = (member[:, ev] & ~member[:, eu]).astype(float) @ eb  # bytes into each downset
  else:
    cin = np.zeros(D)
  params = member.astype(float) @ costs.param_bytes
  saved = member.astype(float) @ costs.saved_ps
  link = cluster.slowest_link()
  full = D - 1
  S = min(K, n)
  found = []
  sizes = microbatch_sizes(B, num_microbatches, max_microbatches)
  for b in sizes:
    M = B // b
    dps = data_parallel_degrees(b, K)
    T = {}
    for d in dps:
      tf, tb = cm.layer_times(costs, cluster.device, b / d)
      T[d] = member.astype(float) @ (tf + tb)
    s_in = np.minimum(np.arange(1, S + 1), M)
    dp = np.full((D, K + 1, S + 1), math.inf)
    dp[0, :, 0] = 0.0
    stats = {}
    for a in range(1, D):
      idx = subs[a]
      if not len(idx):
        continue
      if len(eb):
        into_sub = (member[idx][:, ev] & ~member[a, eu][None, :]).astype(float) @ eb
      else:
        into_sub = np.zeros(len(idx))
      cut = np.maximum(cin[a] + cin[idx] - 2 * into_sub, 0.0)
      comm = np.where(cut > 1e-12, 2 * link.alpha + cut * b / link.beta, 0.0)
      p_s = params[a] - params[idx]
      sv_s = saved[a] - saved[idx]
      stats[a] = (idx, comm, p_s, sv_s)
      for d in dps:
        compute = T[d][a] - T[d][idx]
        both = compute + comm if cm.tps_formula == "sum" else np.maximum(compute, comm)
        ar = _allreduce(cluster, p_s, d)
        tps = both / b + (ar + cm.update_traffic * p_s / cluster.device.memory_bandwidth) / B
        mem = cm.static_memory(p_s)[:, None] + sv_s[:, None] * b / d * s_in[None, :]
        ok = mem <= cluster.memory_per_device  # (nv, S)
        sub = dp[idx][:, : K + 1 - d, :S]  # (nv, K+1-d, S)
        val = np.where(ok[:, None, :], np.maximum(tps[:, None, None], sub), math.inf).min(axis=0)
        dp[a, d:, 1:] = np.minimum(dp[a, d:, 1:], val)
      dp[a] = np.minimum.accumulate(dp[a], axis=0)
    for s in range(1, S + 1):
      v = float(dp[full, K, s])
      if math.isfinite(v):
        found.append(((M + s - 1) * v * b, b, s, v, dp, dps))
  found.sort(key=lambda c: c[:3])
  best, plans = None, []
  for _est, b, s, v, dp, dps in found[:simulate_top]:
    M = B // b
    stages = _reconstruct(
      sets,
      member,
      subs,
      dp,
      dps,
      costs,
      cm,
      cluster,
      b,
      B,
      M,
      K,
      s,
      v,
      cin,
      params,
      saved,
      link,
      order,
    )
    plan = assemble_plan(
      layer_graph,
      cluster,
      stages,
      microbatch=b,
      batch_size=B,
      planner="piper",
      schedule=schedule,
      sequential=True,
      cost_model=cm,
      costs=costs,
      info={"bottleneck_tps": v, "downsets": D},
    )
    best = better(best, plan)
    plans.append(plan)
  if best is None or not best.predicted.get("memory_ok", True):
    raise no_plan_error("piper", layer_graph, cluster, B)
  best = polish(plans, layer_graph, cluster, cost_model=cm, costs=costs, microbatch_sizes=sizes)
  pred = dict(best.predicted)
  pred["search"] = {"seconds": time.perf_counter() - t0, "downsets": D, "pairs": pairs}
  return best.replace(predicted=pred)


def _allreduce(cluster: Cluster, nbytes, d: int):
  if d <= 1:
    return np.zeros_like(nbytes)
  c = cluster
  link = c.intra_link if (c.devices_per_node is None or d <= c.devices_per_node) else c.inter_link
  assert link is not None  # a cluster with devices_per_node has an inter_link
  return 2 * (d - 1) * link.alpha + 2 * (d - 1) / d * nbytes / link.beta


def _reconstruct(
  sets,
  member,
  subs,
  dp,
  dps,
  costs,
  cm,
  cluster,
  b,
  B,
  M,
  K,
  s,
  target,
  cin,
  params,
  saved,
  link,
  order,
):
  """Stages (front to back) of the optimum dp[full, K, s] = target."""
  eu = np.array([u for u, _, _ in costs.edges], dtype=int)
  ev = np.array([v for _, v, _ in costs.edges], dtype=int)
  eb = np.array([x for _, _, x in costs.edges], dtype=float)
  a = len(sets) - 1
  k = K
  out = []
  while s > 0:
    while k > 0 and dp[a, k - 1, s] <= target:
      k -= 1
    step = None
    for d in dps:
      if d > k:
        break
      for i in subs[a]:
        if dp[i, k - d, s - 1] > target:
          continue
        into = (
          float(((member[i, ev] & ~member[a, eu]).astype(float) * eb).sum()) if len(eb) else 0.0
        )
        cut = max(cin[a] + cin[i] - 2 * into, 0.0)
        comm = 2 * link.alpha + cut * b / link.beta if cut > 1e-12 else 0.0
        tf, tb = cm.layer_times(costs, cluster.device, b / d)
        compute = float(((member[a] & ~member[i]).astype(float) * (tf + tb)).sum())
        p = float(params[a] - params[i])
        both = cm.combine(compute, comm)
        tps = (
          both / b
          + float(
            _allreduce(cluster, np.array(p), d)
            + cm.update_traffic * p / cluster.device.memory_bandwidth
          )
          / B
        )
        mem = cm.stage_memory(p, float(saved[a] - saved[i]), b, d, min(s, M))
        if tps <= target * (1 + 1e-9) and mem <= cluster.memory_per_device:
          step = (i, d)
          break
      if step:
        break
    if step is None:
      raise AssertionError("Piper reconstruction lost the optimum")
    i, d = step
    layers = [order[x] for x in range(len(order)) if member[a, x] and not member[i, x]]
    out.append((layers, d))
    a, k, s = i, k - d, s - 1
    target = dp[a, k, s] if s > 0 else 0.0
  return out
