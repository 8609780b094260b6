"""GraphPipe's min-max DP: the depth / TPS frontier of one run per micro-batch size is exact on
chains (against brute force) and every frontier point reconstructs to stages that attain it."""

import itertools
import math

import networkx as nx
import numpy as np
import pytest

from gpp_jax.cost.cluster import Link, cpu_cluster
from gpp_jax.experiments import model_graphs as mg
from gpp_jax.passes.partition import PLANNERS
from gpp_jax.passes.partition.graphpipe.dp import MinMaxDP
from gpp_jax.passes.partition.graphpipe.search import microbatch_context, sp_tree
from gpp_jax.passes.partition.pipedream import chain_dp, chain_fits
from gpp_jax.passes.partition.plan_assembly import (
  assemble_plan,
  data_parallel_degrees,
  microbatch_sizes,
)
from gpp_jax.passes.partition.problem import PlanningProblem
from gpp_jax.passes.partition.range_costs import RangeCosts
from gpp_jax.passes.series_parallel import sp_decompose


def setup(g: nx.DiGraph, cluster, B: int, b: int, memory: float | None = None):
  if memory is not None:
    cluster = cluster.replace(memory_per_device=memory)
  problem = PlanningProblem.build(g, cluster, B)
  ctx = microbatch_context(problem, b, data_parallel_degrees(b, problem.num_devices, False))
  return ctx, sp_tree(sp_decompose(g), problem.costs), MinMaxDP(ctx)


def brute_force_chain(ctx) -> list[float]:
  """Smallest bottleneck with at most e stages over every cut of the chain and every device
  count per stage (sum <= K), memory at in-flight min(stages after, M)."""
  rc = RangeCosts(ctx.costs, ctx.cm, ctx.cluster, ctx.b, ctx.B, ctx.dps)
  n, K, M = rc.n, ctx.K, ctx.M
  best = [math.inf] * (K + 1)
  for s in range(1, min(n, K) + 1):
    for cuts in itertools.combinations(range(1, n), s - 1):
      bounds = (0, *cuts, n)
      for ds in itertools.product(ctx.dps, repeat=s):
        if sum(ds) > K:
          continue
        worst = 0.0
        for x, d in enumerate(ds):
          i, j = bounds[x], bounds[x + 1]
          if rc.memory(d, min(s - x, M))[i, j] > ctx.cluster.memory_per_device:
            worst = math.inf
            break
          worst = max(worst, float(rc.tps(d)[i, j]))
        best[s] = min(best[s], worst)
  return list(np.minimum.accumulate(best))


@pytest.mark.parametrize(
  "seed,layers,k,b,memory", [(0, 5, 4, 8, None), (1, 6, 4, 4, None), (2, 5, 3, 6, 4e7)]
)
def test_frontier_is_exact_on_chains(seed, layers, k, b, memory):
  g = mg.random_branches(
    seed, branches=1, max_branch_layers=layers, fork=True, join=True, batch_size=48
  )
  cluster = cpu_cluster(k).replace(intra_link=Link(20e-6, 1e9))
  ctx, root, dp = setup(g, cluster, 48, b, memory)
  assert len(ctx.costs) >= 3
  want = brute_force_chain(ctx)
  got = dp.R(root, 0).val[k]
  assert any(math.isfinite(x) for x in want)
  for e in range(k + 1):
    if math.isfinite(want[e]):
      assert got[e] == pytest.approx(want[e], rel=1e-12)
    else:
      assert got[e] == math.inf


@pytest.mark.parametrize(
  "seed,layers,k,b", [(0, 5, 4, 96), (1, 6, 4, 48), (2, 5, 3, 64), (3, 4, 8, 24)]
)
def test_the_memory_checks_before_a_dp_agree_with_the_plans_that_fit(seed, layers, k, b):
  """The planners skip a DP where a cheap check says nothing fits (``chain_fits`` on chains,
  ``CostModel.memory_rules_out`` on any graph): over memories from too little to enough, the
  chain check is exact against brute force, and the general one rules out no size brute force
  or GraphPipe's DP finds a plan for, while ruling out some it does not."""
  # Narrow layers and many samples: the stashed activations weigh as much as the weights,
  # so how many micro-batches each stage holds decides what fits.
  B = 768
  g = mg.random_branches(
    seed, branches=1, max_branch_layers=layers, fork=True, join=True, batch_size=B, hidden=32
  )
  cluster = cpu_cluster(k)
  seen, ruled_out = set(), 0
  for memory in np.geomspace(1e3, 1e7, 32):
    ctx, root, dp = setup(g, cluster, B, b, float(memory))
    rc = RangeCosts(ctx.costs, ctx.cm, ctx.cluster, ctx.b, ctx.B, ctx.dps)
    fits = any(math.isfinite(x) for x in brute_force_chain(ctx))
    seen.add(fits)
    assert chain_fits(rc, ctx.dps) == fits, memory
    assert bool(dp.frontier(root)) == fits, memory
    rules_out = ctx.cm.memory_rules_out(
      ctx.costs.held_param_bytes, ctx.costs.saved_ps, ctx.b, ctx.dps, ctx.K, float(memory)
    )
    assert not (fits and rules_out), memory
    ruled_out += rules_out
  assert seen == {True, False} and ruled_out > 0


def stage_tps(ctx, layers: list[int], d: int) -> float:
  """A stage's time per sample priced from the layer costs directly (not the DP's tables)."""
  c = ctx.costs
  tf, tb = ctx.cm.layer_times(c, ctx.cluster.device, ctx.b / d)
  inside = set(layers)
  cut = sum(by for u, v, by in c.edges if (u in inside) != (v in inside))
  comm = 0.0 if cut <= 1e-12 else 2 * ctx.p2p_alpha + cut * ctx.b / ctx.p2p_beta
  params = float(c.param_bytes[layers].sum())
  return ctx.cm.combine(float((tf + tb)[layers].sum()), comm) / ctx.b + ctx.upd(params, d) / ctx.B


GRAPHS = [
  mg.candle_uno(batch_size=64, branches=3, layers=3, hidden=1024, top_layers=2),
  mg.random_branches(3, branches=3, max_branch_layers=3, batch_size=64),
  mg.random_sp_dag(2, num_layers=9, batch_size=64),
  mg.random_dag(1, num_layers=8, edge_prob=0.4, batch_size=64),
]


@pytest.mark.parametrize("gi", range(len(GRAPHS)))
def test_every_frontier_point_reconstructs_to_its_value(gi):
  g = GRAPHS[gi]
  cluster = cpu_cluster(8).replace(intra_link=Link(20e-6, 2e9))
  ctx, root, dp = setup(g, cluster, 64, 8)
  front = dp.frontier(root)
  assert front and all(t1 > t2 for (_, t1), (_, t2) in itertools.pairwise(front))
  for e, t in front:
    stages = dp.stages(root, ctx.K, e)
    assert sorted(l for ls, _ in stages for l in ls) == list(range(len(ctx.costs)))
    assert sum(d for _, d in stages) <= ctx.K and all(d in ctx.dps for _, d in stages)
    assert max(stage_tps(ctx, ls, d) for ls, d in stages) == pytest.approx(t, rel=1e-9)
    plan = assemble_plan(
      PlanningProblem.build(g, ctx.cluster, ctx.B),
      [([ctx.costs.layers[l] for l in ls], d) for ls, d in stages],
      microbatch=ctx.b,
      planner="graphpipe",
    )
    assert plan.predicted["memory_ok"] and plan.predicted["depth"] <= e


def test_one_dp_run_per_microbatch_size():
  g = mg.candle_uno(batch_size=256, branches=4, layers=4, hidden=2048, top_layers=2)
  plan = PLANNERS["graphpipe"](g, cpu_cluster(8), 256, chain_plans=False)
  search = plan.predicted["search"]
  # the sweep plus the no-replication variant at the two best sizes
  assert 1 <= search["dp_runs"] <= len(microbatch_sizes(256, None, 256)) + 2


def reference_chain(dp: MinMaxDP, node, D: int) -> np.ndarray:
  """``serialised.chain`` by its recurrence over every stage [j, j2) and device count, with no
  stage left out: f[j, k, e] = min over them of max(the stage's TPS, f[j2, k - d, e - 1])
  where the stage fits at depth e, monotone in k and e, inf above the cap."""
  ctx = dp.ctx
  rc = ctx.linear(node)
  L, K, E = rc.n, dp.K, dp.E
  f = np.full((L + 1, K + 1, E), math.inf)
  f[L, :, D:] = 0.0
  for j in range(L - 1, -1, -1):
    for k, e in itertools.product(range(K + 1), range(1, E)):
      for (d, s), j2 in itertools.product(zip(ctx.dps, ctx.slots), range(j + 1, L + 1)):
        mem = ctx.mem(float(rc.params[j, j2]), float(rc.saved[j, j2]), d, e)
        if s <= k and mem <= ctx.cluster.memory_per_device:
          f[j, k, e] = min(f[j, k, e], max(rc.tps(d)[j, j2], f[j2, k - s, e - 1]))
    f[j] = np.minimum.accumulate(np.minimum.accumulate(f[j], axis=0), axis=1)
    f[j][f[j] > dp.cap] = math.inf
  return f


@pytest.mark.parametrize("memory,cap", [(None, math.inf), (3e7, math.inf), (3e7, "median")])
def test_serialised_chain_leaves_out_only_stages_that_cannot_count(memory, cap):
  """The chain DP skips, per device count, the longest stages that are out of memory at every
  depth or above the cap: its tables equal the recurrence over every stage."""
  g = mg.random_branches(4, branches=2, max_branch_layers=3, fork=True, join=True, batch_size=48)
  cluster = cpu_cluster(6).replace(intra_link=Link(20e-6, 1e9))
  ctx, root, dp = setup(g, cluster, 48, 8, memory)
  if cap == "median":
    tps = ctx.linear(root).tps(ctx.dps[0])
    dp.cap = float(np.median(tps[np.triu_indices_from(tps, 1)]))
  for D in (0, 1):
    want = reference_chain(dp, root, D)
    assert np.isfinite(want).any()
    assert np.array_equal(dp.chain(root, D), want)


@pytest.mark.parametrize("memory,cap", [(None, math.inf), (3e6, math.inf), (3e6, "median")])
def test_the_whole_chain_read_off_pipedreams_table_is_the_one_the_dp_computes(memory, cap):
  """Where the search shares PipeDream's chain DP table (every layer in the LayerGraph's
  order, context depth 0), the serialised chain read off it is the one the DP computes."""
  g = mg.candle_uno(batch_size=48, branches=2, layers=2, hidden=256, top_layers=2)
  cluster = cpu_cluster(6).replace(intra_link=Link(20e-6, 1e9))
  ctx, root, dp = setup(g, cluster, 48, 8, memory)
  assert root.layers == list(range(len(ctx.costs)))
  rc = RangeCosts(ctx.costs, ctx.cm, ctx.cluster, ctx.b, ctx.B, ctx.dps)
  A, dps = chain_dp(rc)
  assert dps == ctx.dps
  read = MinMaxDP(ctx, whole_chain=lambda: A)
  if cap == "median":
    tps = rc.tps(ctx.dps[0])
    dp.cap = read.cap = float(np.median(tps[np.triu_indices_from(tps, 1)]))
  want = dp.chain(root, 0)
  assert np.isfinite(want).any() and not np.isfinite(want).all()
  assert np.array_equal(read.chain(root, 0), want)


def test_the_handed_out_plan_is_polished_where_it_beats_every_starting_plan(monkeypatch):
  """Phase 4's rule: the best plan with its idle devices handed out gets a polish of its own
  where it beats every plan the first polish started from, however far that polish went (a
  rule on the polished plan skipped it once the polish went further, and lost the better
  plan); where it beats none of them it is not polished."""
  from types import SimpleNamespace

  from gpp_jax.ir.plan import Plan, Stage
  from gpp_jax.passes.partition.graphpipe import search

  def plan(seconds: float, name: str) -> Plan:
    return Plan(
      (Stage(0, ("a",), (0,)),),
      (),
      1,
      planner=name,
      batch_size=8,
      predicted={"iteration_time": seconds, "memory_ok": True},
    )

  polished_from = {"start": plan(0.5, "polished start"), "handed": plan(0.4, "polished handed")}
  calls = []

  def fake_polish(problem, plans, **kwargs):
    which = "handed" if plans[0].planner == "handed" else "start"
    calls.append(which)
    return polished_from[which]

  monkeypatch.setattr(search, "polish", fake_polish)
  problem = SimpleNamespace(
    layer_graph=None,
    cluster=None,
    cost_model=None,
    costs=None,
    host=None,
    simulations=lambda: {},
  )
  opts = search.GraphPipeOptions()
  starts = [plan(1.0, "dp"), plan(1.2, "dp")]
  # Beats the starting plans (1.0) but not the polished one (0.5): polished, and it wins.
  cands = SimpleNamespace(evaluated=starts, handed=[plan(0.9, "handed")])
  best = search.polished(problem, opts, cands)
  assert calls == ["start", "handed"] and best.planner == "polished handed"
  # Beats no starting plan: only the first polish runs.
  calls.clear()
  cands = SimpleNamespace(evaluated=starts, handed=[plan(1.1, "handed")])
  best = search.polished(problem, opts, cands)
  assert calls == ["start"] and best.planner == "polished start"
