"""``min_stages`` constrains the named planner's own search: every planner returns its best plan
of at least that many stages, records itself as the plan's planner, and no other planner
stands in for it (a planner that cannot search under the constraint says so)."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import optax
import pytest
from harness import dag_model, dag_params, make_batch, max_diff, mse_step

import gpp_jax
from gpp_jax.cost.cluster import cpu_cluster
from gpp_jax.cost.host import HostCosts
from gpp_jax.experiments.planner_runs import build_graph
from gpp_jax.ir import layer_graph as lg
from gpp_jax.ir.plan import Plan, Stage
from gpp_jax.passes.partition import PLANNERS, get_planner
from gpp_jax.runtime import compile as cp

OPS = ("F", "B", "W", "UPDATE", "SEND", "RECV", "STEP")
MiB = 2**20


def host(per_op: float, parallel: float | None) -> HostCosts:
  """A machine whose every instruction takes ``per_op`` seconds to issue and whose devices
  compute ``parallel`` at once (1: they take turns on the cores)."""
  return HostCosts(
    per_op=dict.fromkeys(OPS, per_op), outside=0.0, parallel=parallel, cores=2, device="cpu:0"
  )


def four_layer_chain(seconds: float):
  """Four layers a -> b -> c -> d of ``seconds`` forward (twice that backward) per batch of
  16 and 32 MiB of parameters each: a pipeline by the devices-only model, one stage on a
  host whose instructions cost milliseconds and whose devices take turns on the cores."""
  g = lg.new_layer_graph("chain4", 16)
  names = ("a", "b", "c", "d")
  for name in names:
    lg.add_layer(
      g,
      name,
      lg.LayerCost(flops=1e9, param_bytes=32 * MiB, act_bytes=1024),
      time_f=seconds,
      time_b=2 * seconds,
    )
  for u, v in itertools.pairwise(names):
    lg.add_edge(g, u, v, 1024)
  return g


# What each planner records as the plan's planner.
RECORDED = {"graphpipe-stage-mb": "graphpipe+stage-mb"}


@pytest.mark.parametrize("name", sorted(PLANNERS))
def test_every_planner_keeps_its_own_search_to_min_stages(name):
  """On a host where one stage is fastest, min_stages=2 gives the planner's own best plan of
  at least 2 stages, predicted for that host and recorded as that planner's; GraphPipe's,
  PipeDream's, BaPipe's and the exhaustive search's unconstrained plans are one stage."""
  g, cluster, h = four_layer_chain(10e-3), cpu_cluster(4, 8 * 2**30), host(2e-3, 1.0)
  planner = get_planner(name)
  free = planner(g, cluster, 16, num_microbatches=4, host=h)
  kept = planner(g, cluster, 16, num_microbatches=4, host=h, min_stages=2)
  if name in ("graphpipe", "pipedream", "bapipe", "exhaustive"):
    assert free.num_stages == 1  # the constraint binds
  assert kept.num_stages >= 2
  assert kept.planner == RECORDED.get(name, name)
  if name != "balanced":  # the one planner that prices nothing
    assert kept.predicted["host_aware"] and kept.predicted["memory_ok"]


def test_graphpipe_and_pipedream_each_keep_their_own_plan():
  """Tiny DLRM on a host where one stage is each planner's best: under min_stages=2 each
  returns its own pipeline, and they differ (GraphPipe's stage DAG is faster than PipeDream's
  chain; no shared substitute plan)."""
  g = build_graph("dlrm", "tiny", batch_size=16)
  cluster, h = cpu_cluster(4, 8 * 2**30), host(3e-4, 1.5)
  plans = {}
  for name in ("graphpipe", "pipedream"):
    planner = get_planner(name)
    assert planner(g, cluster, 16, num_microbatches=4, host=h).num_stages == 1
    plans[name] = planner(g, cluster, 16, num_microbatches=4, host=h, min_stages=2)
    assert plans[name].num_stages >= 2 and plans[name].planner == name
  gp, pd = plans["graphpipe"], plans["pipedream"]
  assert [(s.layers, s.devices) for s in gp.stages] != [(s.layers, s.devices) for s in pd.stages]
  assert gp.predicted["iteration_time"] < pd.predicted["iteration_time"]


def test_min_stages_through_the_compile_chain_names_the_planner():
  """``make_plan`` passes min_stages to the named planner's search (its plan, searched with
  the host); the devices-only search of the same planner is not what runs either."""
  g, h = four_layer_chain(10e-3), host(2e-3, 1.0)
  for name in ("graphpipe", "pipedream"):
    opts = cp.Options(
      num_microbatches=4,
      devices=tuple(jax.devices()[:4]),
      planner=name,
      cluster=cpu_cluster(4, 8 * 2**30),
      min_stages=2,
    )
    plan = cp.make_plan(g, 16, opts, h)
    assert plan.planner == name and plan.num_stages >= 2
    assert plan.predicted["host_aware"]


def test_a_user_planner_gets_min_stages_or_fails_naming_itself():
  """A callable planner whose signature takes ``min_stages`` is passed it; one that does not
  and returns fewer stages is a PlanError that names it and the fix (no balanced plan in its
  place); more stages than devices is refused before any planner runs."""
  g = four_layer_chain(10e-3)
  seen = []

  def one_stage(graph, cluster, batch_size, *, num_microbatches=None):
    layers = tuple(lg.topo_layers(graph))
    return Plan(
      (Stage(0, layers, (0,)),), (), num_microbatches, planner="mine", batch_size=batch_size
    )

  def halves(graph, cluster, batch_size, *, num_microbatches=None, min_stages=1):
    seen.append(min_stages)
    layers = tuple(lg.topo_layers(graph))
    return Plan(
      (Stage(0, layers[:2], (0,)), Stage(1, layers[2:], (1,))),
      ((0, 1),),
      num_microbatches,
      planner="halves",
      batch_size=batch_size,
    )

  def opts(planner, k, n=4):
    return cp.Options(
      num_microbatches=4,
      devices=tuple(jax.devices()[:n]),
      planner=planner,
      cluster=cpu_cluster(n, 8 * 2**30),
      min_stages=k,
    )

  assert cp.make_plan(g, 16, opts(halves, 2)).planner == "halves" and seen == [2]
  with pytest.raises(gpp_jax.PlanError, match=r"mine's plan has 1 stage, fewer than"):
    cp.make_plan(g, 16, opts(one_stage, 2))
  with pytest.raises(gpp_jax.PlanError, match="takes no min_stages keyword"):
    cp.make_plan(g, 16, opts(one_stage, 2))
  one = dataclasses.replace(opts("balanced", 2), planner_options={"num_stages": 1})
  with pytest.raises(gpp_jax.PlanError, match=r"balanced: num_stages=1 .* min_stages=2"):
    cp.make_plan(g, 16, one)
  with pytest.raises(gpp_jax.PlanError, match=r"min_stages=3 .* than there are devices \(2\)"):
    get_planner("pipedream")(g, cpu_cluster(2, 8 * 2**30), 16, num_microbatches=4, min_stages=3)


@pytest.fixture(scope="module")
def dag():
  tx = optax.adam(1e-2)
  params = dag_params()
  return mse_step(dag_model, tx), params, tx.init(params), make_batch(0, 16, 5, 2)


def test_min_stages_runs_graphpipe_own_pipeline_exactly(dag, monkeypatch):
  """With instructions of 5 ms to issue GraphPipe's own plan on this machine is one stage;
  min_stages=2 runs GraphPipe's best pipeline of at least 2 stages (not the balanced
  planner's), says so, and its step's values are the plain jitted step's."""
  from gpp_jax.runtime import host as host_mod

  monkeypatch.setattr(host_mod, "measure_host", lambda devices, *_: host(5e-3, 1.0))
  step, params, opt_state, batch = dag
  pp = gpp_jax.graph_pipeline(
    step,
    num_microbatches=2,
    devices=jax.devices()[:4],
    planner="graphpipe",
    calibrate=True,
    min_stages=2,
  )
  out = pp(params, opt_state, batch)
  planned = pp.compiled.planned
  assert pp.plan.planner == "graphpipe" and pp.plan.num_stages >= 2
  # The constraint binds: GraphPipe's search on the same graph and host, unconstrained.
  free = dataclasses.replace(pp.compiled.opts, min_stages=1)
  assert cp.make_plan(planned.layer_graph, pp.batch_size, free, planned.host).num_stages == 1
  assert all(p.planner == "graphpipe" for p in planned.plans.values())
  assert str(pp.plan).startswith("Plan by graphpipe")
  assert "min_stages=2: graphpipe's search kept to plans of at least 2 stages" in pp.explain()
  assert "balanced" not in pp.explain()
  assert max_diff(jax.jit(step)(params, opt_state, batch), out) < 1e-5
