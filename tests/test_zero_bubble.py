"""Zero-bubble: backward split into B (input cotangents) and W (parameter gradients) on a DAG."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from harness import OPTIMIZERS, apply_dense, compare_steps, dense, make_batch, max_diff, mse_step

import gpp_jax
from gpp_jax.errors import ScheduleError
from gpp_jax.ir.schedule import validate_schedule
from gpp_jax.passes.inflight import inflight_counts
from gpp_jax.passes.schedules import make_schedule
from gpp_jax.passes.simulation import StageTimes, simulate_times
from gpp_jax.passes.zero_bubble import zero_bubble

TOL = 1e-5
CHAIN = [(0, 1), (1, 2), (2, 3)]
DAG = [(0, 1), (0, 2), (1, 3), (2, 3), (3, 4), (0, 4)]


def dag_model(p, x):
  """Two branches from the input stage, joined; the input stage's output also skips to the head."""
  h = jnp.tanh(apply_dense(p["inp"], x))
  a = jnp.tanh(apply_dense(p["left"], h))
  b = jax.nn.relu(apply_dense(p["right"], h))
  j = jnp.tanh(apply_dense(p["join"], jnp.concatenate([a, b], axis=-1)))
  return apply_dense(p["head"], j + h)  # h skips the branches and the join


@pytest.mark.parametrize("remat", [False, True])
def test_zero_bubble_dag_matches_one_device(remat):
  ks = jax.random.split(jax.random.key(7), 5)
  params = {
    "inp": dense(ks[0], 5, 8),
    "left": dense(ks[1], 8, 6),
    "right": dense(ks[2], 8, 6),
    "join": dense(ks[3], 12, 8),
    "head": dense(ks[4], 8, 2),
  }
  tx = OPTIMIZERS["clip_adam"]()
  manual = gpp_jax.manual_plan({"inp": 0, "left": 1, "right": 2, "join": 3, "head": 4})

  def plan(graph, cluster, batch_size, num_microbatches):
    # The memory bound a planner would give: every stage may hold all 4 micro-batches.
    p = manual.resolve(graph, num_microbatches, "zero-bubble", 5, batch_size)
    return p.replace(stages=tuple(dataclasses.replace(s, in_flight=4) for s in p.stages))

  r, p, pp = compare_steps(
    mse_step(dag_model, tx),
    (params, tx.init(params)),
    make_batch(7, 16, 5, 2),
    num_microbatches=4,
    devices=jax.devices()[:5],
    planner=plan,
    schedule="zero-bubble",
    remat=remat,
  )
  assert sorted(pp.plan.edges) == sorted(DAG)
  sched = pp.schedule
  assert sched.name == "zero-bubble"
  # Every stage runs a W per micro-batch, and some W is deferred past a later F or B.
  for lane in sched.lanes:
    assert sum(a.kind == "W" for a in lane) == 4
  deferred = [
    a
    for lane in sched.lanes
    for i, a in enumerate(lane)
    if a.kind == "W" and (lane[i - 1].kind, lane[i - 1].microbatch) != ("B", a.microbatch)
  ]
  assert deferred, sched
  assert max_diff(r[:2], p[:2]) <= TOL
  assert abs(float(r[2]["loss"]) - float(p[2]["loss"])) <= TOL


@pytest.mark.parametrize("edges,n", [(CHAIN, 4), (DAG, 5), ([], 2)])
@pytest.mark.parametrize("M", [1, 3, 8])
def test_zero_bubble_valid_and_within_memory_bound(edges, n, M):
  for bound in (None, [2] * n, [M] * n):
    s = zero_bubble(n, edges, M, memory_bound=bound)
    validate_schedule(s)
    cap = bound or inflight_counts(n, edges, num_microbatches=M).microbatches
    res = simulate_times(s, StageTimes([1.0] * n, [1.0] * n, weight=[1.0] * n))
    assert all(p <= min(c, M) for p, c in zip(res.peak_in_flight, cap))


def test_zero_bubble_halves_1f1b_bubble_with_memory_to_spare():
  # F = B = W = 1: 1F1B runs B+W = 2 at once. With the 1F1B memory bound ZB fills some of the
  # bubble; with room for one more micro-batch per stage it reaches the warm-up-only bubble.
  for n, edges in ((4, CHAIN), (5, DAG)):
    ofob = simulate_times(make_schedule("1f1b", n, edges, 8), StageTimes([1.0] * n, [2.0] * n))
    same = simulate_times(
      zero_bubble(n, edges, 8), StageTimes([1.0] * n, [1.0] * n, weight=[1.0] * n)
    )
    more = simulate_times(
      zero_bubble(n, edges, 8, memory_bound=[5] * n),
      StageTimes([1.0] * n, [1.0] * n, weight=[1.0] * n),
    )
    assert max(same.bubble) < max(ofob.bubble)
    assert max(more.bubble) <= 0.5 * max(ofob.bubble)


def test_zero_bubble_rejects_bad_bound():
  with pytest.raises(ScheduleError, match="memory_bound needs one count >= 1 per stage"):
    zero_bubble(2, [(0, 1)], 2, memory_bound=[0, 1])
  with pytest.raises(ValueError, match="zero-bubble schedule only"):
    make_schedule("1f1b", 2, [(0, 1)], 2, memory_bound=[1, 1])


def test_planners_simulate_the_split_and_choose_zero_bubble():
  from gpp_jax.cost.cluster import make_cluster
  from gpp_jax.cost.cost_model import plan_costs
  from gpp_jax.experiments.model_graphs import model_graph
  from gpp_jax.passes.partition import get_planner
  from gpp_jax.passes.partition.plan_assembly import memory_bound
  from gpp_jax.passes.schedules import plan_schedule
  from gpp_jax.passes.simulation import simulate

  g = model_graph("mmt")
  cluster = make_cluster("v100", 8)
  B = int(g.graph["batch_size"])
  plan = get_planner("graphpipe")(
    g, cluster, B, num_microbatches=8, schedules=("zero-bubble",), refine_evals=20
  )
  assert plan.schedule == "zero-bubble"
  # The plan carries the memory bound its schedule was generated under; the runtime's
  # schedule (plan_schedule) is the simulated one.
  bound = memory_bound(plan, g, cluster)
  assert tuple(s.in_flight for s in plan.stages) == bound
  sched = plan_schedule(plan)
  res = simulate(plan, g, cluster)
  assert res.iteration_time == pytest.approx(plan.predicted["iteration_time"])
  assert all(p <= b for p, b in zip(res.peak_in_flight, bound))
  assert plan.predicted["memory_ok"]
  # B and W split the stage's backward time: W is the weight-gradient share.
  pc = plan_costs(plan, g, cluster)
  for s in range(plan.num_stages):
    b = next(a for a in res.actions if a.stage == s and a.kind == "B")
    w = next(a for a in res.actions if a.stage == s and a.kind == "W")
    assert (b.end - b.start) + (w.end - w.start) == pytest.approx(pc.backward[s])
    assert w.end - w.start == pytest.approx(pc.backward[s] * pc.weight_fraction[s])
    assert 0 < pc.weight_fraction[s] <= 0.5
  assert sum(a.kind == "W" for a in sched.lanes[0]) == 8
  # The same plan under 1F1B is slower.
  ofob = simulate(plan.replace(schedule="1f1b"), g, cluster)
  assert ofob.iteration_time > res.iteration_time


@pytest.mark.parametrize("planner,option", [("bapipe", "modes"), ("luo", "orders")])
def test_sequential_planners_choose_among_schedules(planner, option):
  from gpp_jax.cost.cluster import make_cluster
  from gpp_jax.experiments.model_graphs import model_graph
  from gpp_jax.passes.partition import get_planner
  from gpp_jax.passes.partition.bapipe import ALL_MODES
  from gpp_jax.passes.partition.luo import ALL_ORDERS

  g = model_graph("mmt")
  cluster = make_cluster("v100", 8)
  B = int(g.graph["batch_size"])
  fn = get_planner(planner)
  every = ALL_MODES if planner == "bapipe" else ALL_ORDERS
  assert "zero-bubble" in every
  best = fn(g, cluster, B, num_microbatches=8, **{option: every})
  times = {}
  for name in every:
    times[name] = fn(g, cluster, B, num_microbatches=8, **{option: (name,)}).predicted[
      "iteration_time"
    ]
  assert best.schedule == min(times, key=times.__getitem__)
  assert best.predicted["iteration_time"] == pytest.approx(min(times.values()))
  assert times["zero-bubble"] < times["1f1b"]


def chain_model(p, x):
  for i in range(4):
    x = jnp.tanh(apply_dense(p[f"l{i}"], x)) if i < 3 else apply_dense(p[f"l{i}"], x)
  return x


@pytest.mark.parametrize(
  "planner,options",
  [
    ("luo", {"orders": ("graph-1f1b",)}),
    ("luo", {"orders": ("zero-bubble",)}),
    ("bapipe", {"modes": ("1f1b", "gpipe", "zero-bubble")}),
  ],
)
def test_planner_chosen_order_is_what_the_runtime_runs(planner, options):
  from gpp_jax.passes.schedules import plan_schedule

  ks = jax.random.split(jax.random.key(5), 4)
  params = {f"l{i}": dense(ks[i], 8, 8) for i in range(4)}
  tx = OPTIMIZERS["adamw"]()
  r, p, pp = compare_steps(
    mse_step(chain_model, tx),
    (params, tx.init(params)),
    make_batch(5, 16, 8, 8),
    steps=2,
    num_microbatches=4,
    devices=jax.devices()[:4],
    planner=planner,
    planner_options=options,
  )
  assert pp.plan.planner == planner and pp.plan.num_stages >= 2, pp.plan
  if "orders" in options:
    assert pp.plan.schedule == options["orders"][0]
  assert pp.schedule == plan_schedule(pp.plan)
  assert max_diff(r[:2], p[:2]) <= TOL


def test_backward_split_computes_nothing_twice():
  import numpy as np

  from gpp_jax.passes.backward_split import SplitBackward

  def stage(w1, w2, x):
    return jnp.tanh(jnp.tanh(x @ w1) @ w2)

  ks = jax.random.split(jax.random.key(0), 4)
  w1, w2 = jax.random.normal(ks[0], (6, 5)), jax.random.normal(ks[1], (5, 4))
  x, ct = jax.random.normal(ks[2], (3, 6)), jax.random.normal(ks[3], (3, 4))
  _, vjp = jax.vjp(stage, w1, w2, x)

  def grads(vjp, ct):
    return vjp(ct)

  split = SplitBackward(grads, 2, lambda g, acc: [a + b for a, b in zip(acc, g)])
  in_cts, kept = split.bwd_input(vjp, ct)
  acc = split.bwd_weight(vjp, ct, kept, [jnp.zeros_like(w1), jnp.zeros_like(w2)])
  want = vjp(ct)
  np.testing.assert_allclose(in_cts[0], want[2], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(acc[0], want[0], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(acc[1], want[1], rtol=1e-5, atol=1e-6)

  def dots(closed):
    return sum(e.primitive.name == "dot_general" for e in closed.jaxpr.eqns)

  full = jax.make_jaxpr(lambda c: vjp(c))(ct)
  # Two layers: B runs the two input-gradient products, W the two weight-gradient products,
  # reading the layers' output gradients B kept; together the backward's four, none twice.
  assert dots(split.input_jaxpr) == 2 and dots(split.weight_jaxpr) == 2
  assert dots(full) == 4 and split.kept >= 1
  n_b, n_w = len(split.input_jaxpr.jaxpr.eqns), len(split.weight_jaxpr.jaxpr.eqns)
  assert n_b + n_w == len(full.jaxpr.eqns)
