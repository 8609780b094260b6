"""The planning contract: PlanningProblem, the Planner protocol (users' planners included),
options dataclasses, the DP's device unit, and plan quality bounded by the earlier search."""

import dataclasses
import inspect
import re

import jax
import pytest

from gpp_jax.cost.cluster import v100_cluster
from gpp_jax.experiments import model_graphs as mg
from gpp_jax.experiments.planner_runs import build_graph
from gpp_jax.ir.plan import Plan
from gpp_jax.passes.partition import (
  PLANNERS,
  GraphPipeOptions,
  KeywordPlanner,
  Planner,
  PlanningProblem,
  ProblemPlanner,
  as_planner,
  balanced_plan,
  bapipe_plan,
  exhaustive_plan,
  graphpipe_plan,
  luo_plan,
  piper_plan,
)
from gpp_jax.passes.partition.plan_assembly import StageLayout, assemble_plan
from gpp_jax.passes.partition.problem import PROBLEM_KEYWORDS, device_unit
from gpp_jax.runtime.compile import Options, make_plan

FIXTURES = {
  "candle3_v100x8": (
    lambda: mg.candle_uno(batch_size=64, branches=3, layers=2, hidden=1024, top_layers=1),
    8,
    64,
  ),
  "candle4_v100x8": (
    lambda: mg.candle_uno(batch_size=256, branches=4, layers=4, hidden=2048, top_layers=2),
    8,
    256,
  ),
  "mmt_tiny_v100x64": (lambda: build_graph("mmt", "tiny", 512), 64, 512),
  "dlrm_tiny_v100x128": (lambda: build_graph("dlrm", "tiny", 2048), 128, 2048),
}
RUNS = {
  "graphpipe": ("graphpipe", {}),
  "pipedream": ("pipedream", {}),
  "pipedream-pub": ("pipedream", {"selection": "published"}),
  "piper": ("piper", {}),
  "bapipe": ("bapipe", {}),
  "luo": ("luo", {}),
}
# Simulated iteration times (s) of each planner's plan on each fixture, computed with the
# search as it was before the planning contract and the DPs' device unit (commit da92517).
BEFORE = {
  "candle3_v100x8/graphpipe": 0.0004922181437225762,
  "candle3_v100x8/pipedream": 0.0007417935665735465,
  "candle3_v100x8/pipedream-pub": 0.0008171629338190486,
  "candle3_v100x8/piper": 0.0007415343253160502,
  "candle3_v100x8/bapipe": 0.0008993858284784146,
  "candle3_v100x8/luo": 0.0007547341338190487,
  "candle4_v100x8/graphpipe": 0.003808639502420382,
  "candle4_v100x8/pipedream": 0.005010145204684321,
  "candle4_v100x8/pipedream-pub": 0.005010145204684321,
  "candle4_v100x8/piper": 0.004887863703233882,
  "candle4_v100x8/bapipe": 0.005010145204684321,
  "candle4_v100x8/luo": 0.005057060062471041,
  "mmt_tiny_v100x64/graphpipe": 0.0008468009332767161,
  "mmt_tiny_v100x64/pipedream": 0.0012378791745222928,
  "mmt_tiny_v100x64/pipedream-pub": 0.0019529350323000713,
  "mmt_tiny_v100x64/piper": 0.0012378791745222928,
  "mmt_tiny_v100x64/bapipe": 0.0012378791745222928,
  "mmt_tiny_v100x64/luo": 0.0014293274469639066,
  "dlrm_tiny_v100x128/graphpipe": 0.0004771327426751593,
  "dlrm_tiny_v100x128/pipedream": 0.0007494273440622789,
  "dlrm_tiny_v100x128/pipedream-pub": 0.0010890408127671616,
  "dlrm_tiny_v100x128/piper": 0.0007360299049115357,
  "dlrm_tiny_v100x128/bapipe": 0.0007914654333474877,
  "dlrm_tiny_v100x128/luo": 0.0007800105866949753,
}
TOLERANCE = 1e-6  # relative: the same plan simulated again


@pytest.mark.parametrize("fixture", list(FIXTURES))
def test_every_planner_is_at_least_as_good_as_before(fixture):
  make, k, batch = FIXTURES[fixture]
  g = make()
  problem = PlanningProblem.build(g, v100_cluster(k), batch)
  for run, (name, options) in RUNS.items():
    plan = PLANNERS[name].plan(problem, options)
    assert plan.predicted["memory_ok"]
    bound = BEFORE[f"{fixture}/{run}"]
    assert plan.predicted["iteration_time"] <= bound * (1 + TOLERANCE), run


def test_a_users_planner_is_a_planner():
  def halves(layer_graph, cluster, batch_size, *, num_microbatches=None):
    order = list(layer_graph.nodes)
    return assemble_plan(
      PlanningProblem.build(layer_graph, cluster, batch_size),
      [(order[: len(order) // 2], 1), (order[len(order) // 2 :], 1)],
      microbatch=batch_size // (num_microbatches or 2),
      planner="halves",
      layout=StageLayout(sequential=True),
    )

  assert isinstance(halves, Planner)
  for name, p in PLANNERS.items():
    assert isinstance(p, Planner) and isinstance(p, (ProblemPlanner, KeywordPlanner)), name
  g = mg.chain(layers=6, batch_size=16)
  problem = PlanningProblem.build(g, 2, 16, num_microbatches=4)
  users = as_planner(halves)
  assert users.name == "halves"
  plan = users.plan(problem)  # the problem's cost model and schedule are not forced on it
  assert plan.num_stages == 2 and plan.num_microbatches == 4
  # The runtime calls a planner= callable the same way.
  opts = Options(num_microbatches=4, devices=tuple(jax.devices()[:2]), planner=halves)
  assert make_plan(g, 16, opts).planner == "halves"
  # A registered planner object works as planner= too.
  opts = Options(num_microbatches=4, devices=tuple(jax.devices()[:2]), planner=PLANNERS["luo"])
  assert isinstance(make_plan(g, 16, opts), Plan)


def test_options_are_dataclasses_and_checked():
  g = mg.chain(layers=4, batch_size=8)
  problem = PlanningProblem.build(g, 2, 8)
  opts = GraphPipeOptions(polish_plans=False, chain_plans=False)
  assert dataclasses.is_dataclass(opts)
  a = PLANNERS["graphpipe"].plan(problem, opts)
  b = graphpipe_plan(g, 2, 8, polish_plans=False, chain_plans=False)
  assert a.predicted["iteration_time"] == b.predicted["iteration_time"]
  with pytest.raises(TypeError, match="unknown option"):
    graphpipe_plan(g, 2, 8, polish=False)


def test_the_dp_counts_devices_in_slots_on_large_clusters():
  assert [device_unit(k, 32) for k in (8, 32, 33, 64, 1024)] == [1, 1, 2, 2, 32]
  assert device_unit(1024, None) == 1
  g = build_graph("mmt", "tiny", 512)
  plan = graphpipe_plan(g, v100_cluster(64), 512)
  assert plan.predicted["search"]["device_unit"] == 2
  assert sum(len(s.devices) for s in plan.stages) + len(plan.predicted["idle_devices"]) == 64


# The built-in planners; PLANNERS may also hold planners users registered themselves.
BUILT_IN = (
  "balanced",
  "graphpipe",
  "pipedream",
  "piper",
  "bapipe",
  "luo",
  "exhaustive",
  "graphpipe-stage-mb",
)
# Keyword forms with their options spelled out, and keywords to check them with.
KEYWORD_FORMS = {
  "balanced": (balanced_plan, {"num_stages": 3, "schedule": "gpipe"}),
  "piper": (piper_plan, {"selection": "published", "simulate_top": 2}),
  "bapipe": (bapipe_plan, {"modes": ("gpipe",), "max_microbatches": 8}),
  "luo": (luo_plan, {"orders": ("1f1b", "gpipe"), "simulate_top": 2}),
  "exhaustive": (exhaustive_plan, {"max_layers": 9}),
}


def test_every_built_in_planner_takes_a_problem_and_frozen_options():
  assert set(BUILT_IN) <= set(PLANNERS)
  for name in BUILT_IN:
    p = PLANNERS[name]
    assert isinstance(p, ProblemPlanner) and p.name == name, name
    assert p.options_type.__dataclass_params__.frozen, name
    with pytest.raises(TypeError, match=f"^{re.escape(name)}: unknown option"):
      p.options(no_such_option=1)
  for name, (fn, _) in KEYWORD_FORMS.items():
    if fn is PLANNERS[name]:  # the registered planner under its own name: its options, as is
      continue
    # A keyword form of its own: its defaults are the options'.
    params = inspect.signature(fn).parameters
    for field in dataclasses.fields(PLANNERS[name].options_type):
      assert params[field.name].default == field.default, (name, field.name)


@pytest.mark.parametrize("given", [False, True], ids=["defaults", "options"])
@pytest.mark.parametrize("name", ["balanced", "piper", "bapipe", "luo"])
def test_the_problem_form_plans_as_the_keyword_form(name, given):
  make, k, batch = FIXTURES["candle3_v100x8"]
  g = make()
  fn, kw = KEYWORD_FORMS[name]
  kw = kw if given else {}
  problem = PlanningProblem.build(
    g, v100_cluster(k), batch, **{key: v for key, v in kw.items() if key in PROBLEM_KEYWORDS}
  )
  planner = PLANNERS[name]
  opts = planner.options(**{key: v for key, v in kw.items() if key not in PROBLEM_KEYWORDS})
  a = planner.plan(problem, opts)
  b = fn(g, v100_cluster(k), batch, **kw)
  assert a.stages == b.stages and a.edges == b.edges and a.schedule == b.schedule
  assert a.num_microbatches == b.num_microbatches
  assert a.predicted.get("iteration_time") == b.predicted.get("iteration_time")
