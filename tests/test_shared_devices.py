"""Several stages per device: plans, schedules (interleaved 1F1B, looped BFS, ZB-V) on stage
DAGs, the local hand-over in the lowered program, the validator, memory per device, and the
runs against the plain one-device step."""

import jax
import jax.numpy as jnp
import networkx as nx
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from flax.training import train_state
from harness import (
  DAG_EDGES,
  DAG_STAGES,
  OPTIMIZERS,
  compare_steps,
  dag_model,
  dag_params,
  dense,
  make_batch,
  max_diff,
  mse_step,
)

import gpp_jax
from gpp_jax.cost.cluster import cpu_cluster, v100_cluster
from gpp_jax.errors import PlanError, ScheduleError
from gpp_jax.experiments import model_graphs as mg
from gpp_jax.experiments.planner_runs import build_graph, default_batch_size
from gpp_jax.ir.plan import Plan, Stage, validate_plan
from gpp_jax.ir.program import Program
from gpp_jax.ir.schedule import Action, Schedule, validate_schedule
from gpp_jax.passes import shared_devices
from gpp_jax.passes.lowering import lower_schedule
from gpp_jax.passes.partition import PLANNERS
from gpp_jax.passes.partition.shared import (
  at_microbatches,
  balanced_cuts,
  fold,
  plan_with_shared_devices,
  shared_schedules,
  split_stages,
  virtual_cluster,
)
from gpp_jax.passes.schedules import make_schedule
from gpp_jax.passes.shared_devices import SHARED_SCHEDULES, round_robin_places
from gpp_jax.passes.simulation import StageTimes, simulate, simulate_times

TOL = 2e-5
CHAIN4 = [(0, 1), (1, 2), (2, 3)]


# ---------------------------------------------------------------------------- closed forms


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (8, 8)])
def test_one_stage_per_device_meets_the_textbook_form(name, p, m):
  f, b = 1.0, 2.0
  assert gpp_jax.simulate_uniform_chain(name, p, m, 1, f, b) == pytest.approx((m + p - 1) * (f + b))


@pytest.mark.parametrize("v", [1, 2, 4])
@pytest.mark.parametrize(
  "p,m,f,b", [(4, 8, 1.0, 2.0), (8, 16, 1.0, 2.0), (4, 4, 1.0, 1.0), (8, 8, 2.0, 3.0)]
)
def test_interleaved_meets_megatrons_form(p, m, f, b, v):
  t = gpp_jax.simulate_uniform_chain("interleaved-1f1b", p, m, v, f, b)
  form = m * (f + b) + (p - 1) * (f + b) / v
  assert t == pytest.approx(form, rel=0.02)


@pytest.mark.parametrize("p,m", [(4, 8), (8, 16), (4, 4), (8, 32)])
def test_zb_v_is_close_to_no_bubble(p, m):
  """With F = B = W the only idle time left is the last device's start: it waits for p - 1
  forwards of half a stage. ZB-V's 'about zero bubble' is m(f + b + w) plus that."""
  f = b = w = 1.0
  t = gpp_jax.simulate_uniform_chain("zb-v", p, m, 2, f, b + w, w)
  assert t == pytest.approx(m * (f + b + w) + (p - 1) * f / 2, rel=0.02)
  assert t <= m * (f + b + w) * (1 + (p - 1) / (6 * m) + 1e-9)
  # One stage per device: 1F1B's bubble, (p - 1)(f + b + w), is what ZB-V removes.
  assert t < gpp_jax.simulate_uniform_chain("1f1b", p, m, 1, f, b + w)


def test_more_stages_per_device_shrink_the_bubble():
  times = [gpp_jax.simulate_uniform_chain("interleaved-1f1b", 8, 8, v) for v in (1, 2, 4)]
  assert times[0] > times[1] > times[2]


# ---------------------------------------------------------------------------- schedules


@pytest.mark.parametrize("name", SHARED_SCHEDULES)
@pytest.mark.parametrize(
  "edges,places",
  [
    (CHAIN4, (0, 1, 0, 1)),
    (DAG_EDGES, (0, 1, 0, 1)),  # branches, fan-in, a skip edge
    (DAG_EDGES, (0, 0, 1, 1)),  # one branch with its input, the other with the head
    ([(0, 2), (1, 2), (2, 3), (2, 4), (3, 5), (4, 5)], (0, 1, 2, 0, 1, 2)),
  ],
)
@pytest.mark.parametrize("M", [1, 3, 4])
def test_shared_schedules_are_valid_on_dags(name, edges, places, M):
  S = len(places)
  sched = make_schedule(name, S, edges, M, places=places)
  validate_schedule(sched)
  assert sched.places == places
  # Each place runs its stages' actions one after another, every action once.
  for p, order in enumerate(sched.device_lanes()):
    stages = {s for s in range(S) if places[s] == p}
    assert {a.stage for a in order} == stages
    assert len(order) == len(set(order))
  assert Schedule.from_json(sched.to_json()) == sched
  program = lower_schedule(sched)
  assert program.places == (*places, max(places) + 1)


def test_interleaved_is_megatrons_order_on_a_chain():
  """p = 2 devices, v = 2, m = 4: Megatron's device 0 warms up with (p - 1) * 2 + (v - 1) * p
  = 4 forwards, then alternates, then drains (its Figure 4)."""
  sched = make_schedule("interleaved-1f1b", 4, CHAIN4, 4, places=round_robin_places(4, 2))
  device0 = [str(a) for a in sched.device_lanes()[0] if a.kind != "UPDATE"]
  expected = "F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3 B2.1 F2.2 B0.0 F2.3 B0.1 B2.2 B2.3 B0.2 B0.3"
  assert device0 == expected.split()


def test_interleaved_on_a_dag_does_not_wait_on_megatrons_warm_up(monkeypatch):
  """Two towers cut in two and crossed over places 0 and 1, a head cut in three over places 2
  and 3 (its first and last piece on place 2): Megatron's order fills place 2 with the head's
  first forwards while place 3 waits for a backward, and the towers wait behind both. The
  generator keeps the order that ends first (a ready backward first, here); on a chain it
  is Megatron's (``test_interleaved_is_megatrons_order_on_a_chain``)."""
  edges = [(0, 1), (2, 3), (1, 4), (3, 4), (4, 5), (5, 6)]
  places = (0, 1, 1, 0, 2, 3, 2)

  def time(M):
    sched = make_schedule("interleaved-1f1b", 7, edges, M, places=places)
    validate_schedule(sched)
    return simulate_times(sched, StageTimes([1.0] * 7, [2.0] * 7)).iteration_time

  chosen = {M: time(M) for M in (2, 4)}
  monkeypatch.setattr(
    shared_devices, "_INTERLEAVED_VARIANTS", shared_devices._INTERLEAVED_VARIANTS[:1]
  )
  shared_devices._scheduled.cache_clear()  # schedules listed under all the rules
  megatron = {M: time(M) for M in (2, 4)}
  shared_devices._scheduled.cache_clear()
  assert chosen == {2: 22.0, 4: 36.0}
  assert megatron == {2: 23.0, 4: 41.0}


def test_co_located_deadlock_is_rejected_with_the_cycle_named():
  """Device 0 holds stages 0 and 2, device 1 stages 1 and 3; device 0 running F2.0 before
  F0.0 waits for F1.0, which waits for F0.0 behind it."""
  good = make_schedule("interleaved-1f1b", 4, CHAIN4, 1, places=(0, 1, 0, 1))
  orders = list(good.orders)
  orders[0] = (Action("F", 2, 0), *[a for a in orders[0] if a != Action("F", 2, 0)])
  bad = Schedule(good.name, 1, good.edges, good.lanes, places=good.places, orders=tuple(orders))
  with pytest.raises(ScheduleError, match="cycle") as e:
    validate_schedule(bad)
  msg = str(e.value)
  assert "place 0 runs F2.0 next, which waits for F1.0 on place 1" in msg
  assert "place 1 runs F1.0 next, which waits for F0.0 on place 0" in msg


def test_orders_must_keep_each_lane_and_stay_on_their_place():
  good = make_schedule("looped-bfs", 4, CHAIN4, 2, places=(0, 1, 0, 1))
  swapped = list(good.orders[0])
  i, j = swapped.index(Action("F", 0, 0)), swapped.index(Action("F", 0, 1))
  swapped[i], swapped[j] = swapped[j], swapped[i]
  bad = Schedule(
    good.name,
    2,
    good.edges,
    good.lanes,
    places=good.places,
    orders=(tuple(swapped), good.orders[1]),
  )
  with pytest.raises(ScheduleError, match="not in its lane's order"):
    validate_schedule(bad)
  stray = Schedule(
    good.name,
    2,
    good.edges,
    good.lanes,
    places=good.places,
    orders=(good.orders[1], good.orders[0]),
  )
  with pytest.raises(ScheduleError):
    validate_schedule(stray)


def test_stale_weight_schedules_refuse_shared_devices():
  with pytest.raises(ScheduleError, match="one stage per device"):
    make_schedule("2bw", 4, CHAIN4, 4, places=(0, 1, 0, 1))


def test_local_hand_over_in_the_program_text_and_timed_free():
  sched = make_schedule("interleaved-1f1b", 4, CHAIN4, 2, places=(0, 0, 1, 1))
  program = lower_schedule(sched)
  text = program.to_text()
  assert "places=0,0,1,1,2" in text.splitlines()[0]
  hands = [l for l in text.splitlines() if " HAND>" in l]
  sends = [l for l in text.splitlines() if " SEND>" in l]
  # 0 -> 1 and 2 -> 3 stay on their devices; 1 -> 2 crosses (both ways, per micro-batch).
  assert {l.split()[1][:6] for l in hands} == {"HAND>1", "HAND>3", "HAND>0", "HAND>2"}
  assert {l.split()[1][:6] for l in sends} == {"SEND>2", "SEND>1"}
  assert Program.from_text(text) == program
  # A hand-over costs nothing however slow the link: only 1 -> 2 is paid for.
  slow = dict.fromkeys(CHAIN4, 10.0)
  t = simulate_times(
    sched, StageTimes([1.0] * 4, [1.0] * 4, activation_transfer=slow)
  ).iteration_time
  t0 = simulate_times(
    sched, StageTimes([1.0] * 4, [1.0] * 4, activation_transfer={(1, 2): 10.0})
  ).iteration_time
  assert t == t0


def test_memory_per_device_sums_its_stages():
  sched = make_schedule("interleaved-1f1b", 4, CHAIN4, 4, places=(0, 1, 0, 1))
  res = simulate_times(
    sched,
    StageTimes(
      [1.0] * 4,
      [2.0] * 4,
      static_memory=[10.0, 20.0, 30.0, 40.0],
      activation_memory=[1.0] * 4,
      stage_devices=[(0,), (1,), (0,), (1,)],
    ),
  )
  mem = res.stage_memory
  assert res.peak_memory[0] == pytest.approx(mem[0] + mem[2])
  assert res.peak_memory[1] == pytest.approx(mem[1] + mem[3])


# ---------------------------------------------------------------------------- plans


def _plan(devices, edges=CHAIN4):
  stages = tuple(Stage(i, (f"l{i}",), tuple(d)) for i, d in enumerate(devices))
  return Plan(stages, tuple(edges), 4)


def test_plans_share_devices_whole_or_not_at_all():
  shared = _plan([[0], [1], [0], [1]])
  validate_plan(shared, num_devices=2)
  assert shared.places() == (0, 1, 0, 1)
  assert shared.stages_per_device == 2
  assert _plan([[0], [1], [2], [3]]).places() is None
  with pytest.raises(PlanError, match="either on disjoint devices or on the same ones"):
    validate_plan(_plan([[0, 1], [1, 2], [3], [4]]), num_devices=5)
  with pytest.raises(PlanError, match="4 stages but only 1 devices"):
    validate_plan(_plan([[0], [1], [2], [3]]), num_devices=1)


def test_fold_is_megatrons_placement_on_a_chain():
  virtual = _plan([[k] for k in range(8)], [(i, i + 1) for i in range(7)])
  virtual = virtual.replace(stages=tuple(Stage(i, (f"l{i}",), (i,)) for i in range(8)))
  folded = fold(virtual, 4, 2)
  assert [s.devices for s in folded.stages] == [(s % 4,) for s in range(8)]
  assert fold(virtual, 3, 2) is None  # 8 stages, 2 per device, need 4 devices


def test_fold_keeps_concurrent_branches_apart():
  edges = [(0, 1), (0, 2), (1, 3), (2, 3)]
  folded = fold(_plan([[0], [1], [2], [3]], edges), 2, 2)
  places = folded.places()
  assert places[1] != places[2]  # the two branches run side by side
  assert sorted(places) == [0, 0, 1, 1]


def test_balanced_cuts_make_the_largest_piece_least():
  # An input projection and five equal layers in four pieces: the largest holds two layers.
  w = [68.7] + [859.0] * 5
  cuts = balanced_cuts(w, 4)
  pieces = [sum(w[a:b]) for a, b in zip([0, *cuts], [*cuts, len(w)])]
  assert len(pieces) == 4 and max(pieces) == pytest.approx(2 * 859.0)
  assert balanced_cuts([1.0, 1.0, 4.0], 2) == [2]
  assert balanced_cuts([5.0, 1.0, 1.0, 1.0], 2) == [1]
  assert balanced_cuts([1.0, 2.0], 4) == [1]  # no more pieces than layers
  assert balanced_cuts([3.0], 2) == []


def _two_branches():
  g = nx.DiGraph([("a1", "a2"), ("a2", "h"), ("b1", "b2"), ("b2", "h")])
  for i, n in enumerate(["a1", "a2", "b1", "b2", "h"]):
    g.nodes[n]["order"] = i
  return g


def test_cutting_a_chain_keeps_it_a_chain():
  """A linearised plan orders its branches with an edge no tensor flows along; cut, the
  ordering edge runs from the last piece of one stage to the first of the next."""
  g = _two_branches()
  stages = (Stage(0, ("a1", "a2"), (0,)), Stage(1, ("b1", "b2"), (1,)), Stage(2, ("h",), (2,)))
  chain = Plan(stages, ((0, 1), (0, 2), (1, 2)), 4)
  cut = split_stages(chain, g, 2)
  assert [s.layers for s in cut.stages] == [("a1",), ("a2",), ("b1",), ("b2",), ("h",)]
  assert cut.edges == ((0, 1), (1, 2), (1, 4), (2, 3), (3, 4))  # (1, 2): a2 before b1
  dag = split_stages(Plan(stages, ((0, 2), (1, 2)), 4), g, 2)
  assert (1, 2) not in dag.edges  # the DAG plan's branches stay side by side
  assert cut.stages_per_device == 2 and len({s.devices for s in cut.stages}) == 3


def test_virtual_devices_keep_their_nodes():
  """A virtual stage of w devices is folded onto w real ones, so a node holds as many
  virtual devices as real ones: a stage of 8 crosses nodes of 4 in both."""
  cluster = v100_cluster(16)
  virtual = virtual_cluster(cluster, 2)
  assert virtual.num_devices == 32 and virtual.devices_per_node == cluster.devices_per_node
  assert virtual.memory_per_device == cluster.memory_per_device / 2


def test_shared_schedules_follow_the_backward_split():
  assert shared_schedules(None) == ("interleaved-1f1b",)
  assert shared_schedules(None, ("zero-bubble",)) == ("interleaved-1f1b", "zb-v")
  assert shared_schedules("zero-bubble") == ("zero-bubble", "zb-v")
  assert shared_schedules("looped-bfs") == ("looped-bfs",)


def test_planners_take_stages_per_device_and_choose_it():
  g, B = mg.chain(batch_size=32, layers=16, hidden=4096), 32
  cluster = v100_cluster(8)
  one = PLANNERS["graphpipe"](g, cluster, B, num_microbatches=8)
  two = PLANNERS["graphpipe"](g, cluster, B, num_microbatches=8, stages_per_device=2)
  assert two.stages_per_device == 2 and two.schedule == "interleaved-1f1b"
  assert two.planner == "graphpipe"
  assert two.predicted["iteration_time"] < one.predicted["iteration_time"]
  auto = PLANNERS["pipedream"](g, cluster, B, num_microbatches=8, stages_per_device="auto")
  assert auto.predicted["iteration_time"] <= two.predicted["iteration_time"] * 1.0001
  # Memory per device is the sum of its stages': within the budget.
  assert two.predicted["max_memory"] <= cluster.memory_per_device
  with pytest.raises(ValueError, match="stages_per_device"):
    plan_with_shared_devices(PLANNERS["graphpipe"], g, cluster, B, stages_per_device=0)


def test_interleaving_pays_on_mmt_with_few_microbatches():
  """MMT (four branches) on 16 V100s, 2 micro-batches: GraphPipe's plan with two stages per
  device is predicted more than 15% faster than its plan with one and than PipeDream's chain
  with two, all within 16 GiB per device (``benchmarks/shared_devices.py``; modelled)."""
  n, M = 16, 2
  batch = default_batch_size("mmt", n)
  g, cluster = build_graph("mmt", "paper", batch), v100_cluster(n)
  one = PLANNERS["graphpipe"](g, cluster, batch, num_microbatches=M)
  two = PLANNERS["graphpipe"](g, cluster, batch, num_microbatches=M, stages_per_device=2)
  chain = PLANNERS["pipedream"](g, cluster, batch, num_microbatches=M, stages_per_device=2)
  t = {k: p.predicted["iteration_time"] for k, p in (("1", one), ("2", two), ("pd", chain))}
  assert two.stages_per_device == 2 and two.predicted["memory_ok"]
  assert t["1"] / t["2"] >= 1.15 and t["pd"] / t["2"] >= 1.15, t


def test_the_reproduction_reports_several_stages_per_device():
  """``python -m gpp_jax.experiments.reproduce`` writes the benchmark's table as section (g)
  of ``results.md`` (the quick sweep: MMT at 16 devices); the tiny preset leaves it out."""
  import dataclasses

  from gpp_jax.experiments.report import shared_devices_section
  from gpp_jax.experiments.sweeps import QUICK

  md = shared_devices_section(QUICK, progress=None)
  assert md.startswith("## (g) Several stages per device")
  rows = [l for l in md.splitlines() if l.startswith("| MMT | 16 |")]
  assert len(rows) == 2 and "Modelled" in md
  assert shared_devices_section(dataclasses.replace(QUICK, preset="tiny")) == ""


# ---------------------------------------------------------------------------- runs


def _dag_run(schedule, devices, M=4):
  params, tx = dag_params(), OPTIMIZERS["clip_adam"]()
  plan = gpp_jax.manual_plan(DAG_STAGES, devices=devices)
  return compare_steps(
    mse_step(dag_model, tx),
    (params, tx.init(params)),
    make_batch(3, 16, 5, 2),
    num_microbatches=M,
    devices=jax.devices()[: 1 + max(d for ds in devices.values() for d in ds)],
    planner=plan,
    schedule=schedule,
  )


@pytest.mark.parametrize("schedule", SHARED_SCHEDULES)
def test_dag_with_shared_devices_is_exact(schedule):
  r, p, pp = _dag_run(schedule, {0: [0], 1: [1], 2: [0], 3: [1]})
  assert pp.plan.places() == (0, 1, 0, 1)
  assert pp.schedule.name == schedule and pp.schedule.places == (0, 1, 0, 1)
  assert " HAND>" in pp.program.to_text()
  assert max_diff(r[:2], p[:2]) <= TOL
  assert abs(float(r[2]["loss"]) - float(p[2]["loss"])) <= TOL


@pytest.mark.slow
@pytest.mark.parametrize(
  "schedule,devices",
  [
    ("interleaved-1f1b", {0: [0], 1: [0], 2: [0], 3: [0]}),  # v = 4: every stage on one device
    ("zb-v", {0: [0, 1], 1: [2, 3], 2: [2, 3], 3: [0, 1]}),  # a V of stages over two devices each
    ("1f1b", {0: [0], 1: [1], 2: [0], 3: [1]}),  # a one-place schedule on shared devices
  ],
)
def test_more_layouts_with_shared_devices_are_exact(schedule, devices):
  r, p, pp = _dag_run(schedule, devices)
  assert pp.plan.places() is not None
  assert max_diff(r[:2], p[:2]) <= TOL


def _chain8(p, x):
  for i in range(8):
    x = jnp.tanh(x @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"])
  return x


@pytest.mark.slow
@pytest.mark.parametrize("v", [1, 2, 4])
def test_chain_interleaved_is_exact_for_each_v(v):
  ks = jax.random.split(jax.random.key(5), 8)
  params = {f"l{i}": dense(ks[i], 4, 4) for i in range(8)}
  tx = optax.adam(1e-2)
  n = 8 // v
  plan = gpp_jax.manual_plan({f"l{i}": i for i in range(8)}, devices={i: [i % n] for i in range(8)})
  r, p, pp = compare_steps(
    mse_step(_chain8, tx),
    (params, tx.init(params)),
    make_batch(4, 16, 4, 4),
    num_microbatches=4,
    devices=jax.devices()[:n],
    planner=plan,
    schedule="interleaved-1f1b",
  )
  assert pp.plan.stages_per_device == v
  assert max_diff(r[:2], p[:2]) <= TOL


class _Linen(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(nn.Dense(8, name="a")(x))
    left = jnp.tanh(nn.Dense(8, name="left")(h))
    right = jax.nn.relu(nn.Dense(8, name="right")(h))
    return nn.Dense(3, name="head")(left + right + h)


def _batch(seed=0, n=16):
  rng = np.random.default_rng(seed)
  return {
    "x": rng.normal(size=(n, 5)).astype(np.float32),
    "y": rng.normal(size=(n, 3)).astype(np.float32),
  }


def test_linen_dag_interleaved_is_exact():
  model = _Linen()
  state = train_state.TrainState.create(
    apply_fn=model.apply,
    params=model.init(jax.random.key(0), jnp.ones((1, 5))),
    tx=optax.adam(1e-2),
  )

  def step(state, batch):
    def loss_fn(params):
      return jnp.mean((state.apply_fn(params, batch["x"]) - batch["y"]) ** 2)

    loss, grads = gpp_jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}

  rules = {"_Linen/a": 0, "_Linen/left": 1, "_Linen/right": 2, "_Linen/head": 3}
  plan = gpp_jax.manual_plan(rules, devices={0: [0], 1: [1], 2: [0], 3: [1]})
  r, p, pp = compare_steps(
    step,
    (state,),
    _batch(),
    num_microbatches=4,
    devices=jax.devices()[:2],
    planner=plan,
    schedule="interleaved-1f1b",
  )
  assert pp.plan.places() == (0, 1, 0, 1)
  assert max_diff(r[0].params, p[0].params) <= TOL


class _NNX(nnx.Module):
  def __init__(self, rngs):
    self.a = nnx.Linear(5, 8, rngs=rngs)
    self.left = nnx.Linear(8, 8, rngs=rngs)
    self.right = nnx.Linear(8, 8, rngs=rngs)
    self.head = nnx.Linear(8, 3, rngs=rngs)

  def __call__(self, x):
    h = jnp.tanh(self.a(x))
    return self.head(jnp.tanh(self.left(h)) + jax.nn.relu(self.right(h)) + h)


def test_nnx_dag_zb_v_is_exact():
  def step(model, optimizer, batch):
    def loss_fn(model):
      return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    loss, grads = gpp_jax.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  def fresh():
    m = _NNX(nnx.Rngs(0))
    return m, nnx.Optimizer(m, optax.adam(1e-2), wrt=nnx.Param)

  ref_model, ref_opt = fresh()
  for obj in (ref_model, ref_opt):
    nnx.update(obj, jax.device_put(nnx.state(obj), jax.devices()[0]))
  ref = nnx.jit(step)
  model, opt = fresh()
  pp = gpp_jax.graph_pipeline(
    step,
    num_microbatches=4,
    devices=jax.devices()[:2],
    planner=gpp_jax.manual_plan(
      {"a": 0, "left": 1, "right": 2, "head": 3}, devices={0: [0], 1: [1], 2: [1], 3: [0]}
    ),
    schedule="zb-v",
  )
  batch = _batch(1)
  dbatch = jax.device_put(batch, jax.devices()[0])
  with jax.transfer_guard("disallow"):
    for _ in range(2):
      lr = ref(ref_model, ref_opt, dbatch)
      lp = pp(model, opt, batch)
  assert pp.plan.places() == (0, 1, 1, 0)
  assert abs(float(lr) - float(lp)) <= TOL
  assert max_diff(nnx.state(ref_model, nnx.Param), nnx.state(model, nnx.Param)) <= TOL


def test_auto_searches_only_where_the_bubble_leaves_room_and_keeps_only_a_clear_gain():
  """``stages_per_device="auto"``: a plan with no bubble to fill (one stage) is kept without
  planning again; where the bubble is wide (8 micro-batches on 8 devices) v > 1 is searched
  and kept only when predicted ``auto_min_gain`` faster (more on CPU devices than on
  accelerators)."""
  from gpp_jax.passes.partition import shared

  g, B = mg.chain(batch_size=32, layers=16, hidden=4096), 32
  cluster = v100_cluster(8)
  calls = []

  def counting(*a, **k):
    calls.append(k.get("num_microbatches"))
    return PLANNERS["graphpipe"](*a, **k)

  alone = plan_with_shared_devices(
    counting, g, v100_cluster(1), B, num_microbatches=4, stages_per_device="auto"
  )
  assert not shared.bubble_leaves_room(alone, 0.0)
  assert len(calls) == 1 and alone.stages_per_device == 1
  calls.clear()
  few = plan_with_shared_devices(
    counting, g, cluster, B, num_microbatches=8, stages_per_device="auto"
  )
  one = PLANNERS["graphpipe"](g, cluster, B, num_microbatches=8)
  gain = shared.auto_min_gain(cluster)
  assert gain == shared.AUTO_MIN_GAIN_DEVICES  # V100s, planned devices only
  assert shared.auto_min_gain(cpu_cluster(8)) == shared.AUTO_MIN_GAIN  # CPU devices
  assert shared.bubble_leaves_room(one, gain) and len(calls) > 1
  if few.stages_per_device > 1:
    assert few.predicted["iteration_time"] * (1 + gain) <= one.predicted["iteration_time"]
  else:
    assert few.predicted["iteration_time"] == one.predicted["iteration_time"]
    assert [st.layers for st in few.stages] == [st.layers for st in one.stages]
  # The gain asked for decides: none asked, the fastest is kept; an impossible one, v = 1.
  best = plan_with_shared_devices(
    PLANNERS["graphpipe"], g, cluster, B, num_microbatches=8, stages_per_device=2
  )
  assert best.stages_per_device == 2
  assert best.predicted["iteration_time"] < one.predicted["iteration_time"]
  shared.AUTO_MIN_GAIN_DEVICES, saved = 0.0, shared.AUTO_MIN_GAIN_DEVICES
  try:
    eager = plan_with_shared_devices(
      PLANNERS["graphpipe"], g, cluster, B, num_microbatches=8, stages_per_device="auto"
    )
    shared.AUTO_MIN_GAIN_DEVICES = 100.0
    never = plan_with_shared_devices(
      PLANNERS["graphpipe"], g, cluster, B, num_microbatches=8, stages_per_device="auto"
    )
  finally:
    shared.AUTO_MIN_GAIN_DEVICES = saved
  assert eager.stages_per_device > 1
  assert eager.predicted["iteration_time"] <= best.predicted["iteration_time"] * 1.0001
  assert never.stages_per_device == 1


def test_auto_searches_four_stages_per_device_only_where_two_gained(monkeypatch):
  """``"auto"`` plans for v = 4 (the largest virtual cluster, the most stages to simulate)
  only where some v = 2 plan was predicted faster than v = 1. With no plan of shared devices
  to be had (every candidate refused), the planner is never asked for v = 4's."""
  from gpp_jax.passes.partition import shared

  g, B = mg.chain(batch_size=32, layers=16, hidden=4096), 32
  cluster = v100_cluster(8)
  asked = []

  def counting(graph, cl, batch, **k):
    asked.append((cl.num_devices, k.get("num_microbatches")))
    return PLANNERS["graphpipe"](graph, cl, batch, **k)

  searched = plan_with_shared_devices(
    counting, g, cluster, B, num_microbatches=8, stages_per_device="auto"
  )
  if searched.stages_per_device > 1:  # v = 2 gained: v = 4 was searched too
    assert (32, 8) in asked or (8, 32) in asked
  asked.clear()
  monkeypatch.setattr(shared, "fold", lambda *a, **k: None)  # no stages may share devices
  alone = plan_with_shared_devices(
    counting, g, cluster, B, num_microbatches=8, stages_per_device="auto"
  )
  assert alone.stages_per_device == 1
  assert (8, 8) in asked and (16, 8) in asked  # v = 1, v = 2's virtual cluster
  assert all(n != 32 and m != 32 for n, m in asked)  # nothing for v = 4


def test_stages_per_device_is_chosen_by_prediction_where_not_given():
  """Not given, ``stages_per_device`` is ``"auto"`` on accelerators and 1 on CPU devices, for
  ``graph_pipeline``'s planner (by name or the planner itself) and the ``gpp_jax.plan``
  command line; given, it is what it says."""
  import dataclasses

  from gpp_jax.cli import plan as plan_cli
  from gpp_jax.passes.partition.shared import default_stages_per_device
  from gpp_jax.runtime.options import Options
  from gpp_jax.runtime.planning import make_plan

  assert default_stages_per_device(v100_cluster(8)) == "auto"
  assert default_stages_per_device(cpu_cluster(8)) == 1
  g, B = mg.chain(batch_size=32, layers=16, hidden=4096), 32
  auto = PLANNERS["graphpipe"](g, v100_cluster(8), B, num_microbatches=8, stages_per_device="auto")
  assert auto.stages_per_device > 1  # the bubble of 8 micro-batches on 8 stages, interleaved
  opts = Options(
    num_microbatches=8,
    devices=tuple(jax.devices()[:8]),
    planner="graphpipe",
    cluster=v100_cluster(8),
  )
  for planner in ("graphpipe", PLANNERS["graphpipe"]):
    chosen = make_plan(g, B, dataclasses.replace(opts, planner=planner))
    assert chosen.stages_per_device == auto.stages_per_device
    assert [st.layers for st in chosen.stages] == [st.layers for st in auto.stages]
  asked = dataclasses.replace(opts, planner_options={"stages_per_device": 1})
  assert make_plan(g, B, asked).stages_per_device == 1
  on_cpu = dataclasses.replace(opts, cluster=cpu_cluster(8))
  assert make_plan(g, B, on_cpu).stages_per_device == 1
  # The planning command line: the report says what was asked of the planners.
  tiny = dict(model="chain", preset="tiny", num_devices=4, planners=("graphpipe",))
  assert plan_cli.compare(plan_cli.PlanOptions(**tiny))["stages_per_device"] == "auto"
  assert plan_cli.compare(plan_cli.PlanOptions(**tiny, cluster="cpu"))["stages_per_device"] == 1
  one = plan_cli.compare(plan_cli.PlanOptions(**tiny, stages_per_device="1"))
  assert one["stages_per_device"] == 1 and one["results"][0]["stages_per_device"] == 1
  # gpp_jax.train's flag: not given, the decorator's default; given, what it says.
  from absl import app

  stages_per_device_option = plan_cli.stages_per_device_option
  assert stages_per_device_option(None) == {}
  assert stages_per_device_option("1") == {"stages_per_device": 1}
  assert stages_per_device_option("auto") == {"stages_per_device": "auto"}
  with pytest.raises(app.UsageError, match="--stages_per_device must be"):
    stages_per_device_option("0")


def test_the_virtual_cluster_is_also_planned_at_the_micro_batches_its_candidate_runs():
  """The candidates of several stages per device run at the one-stage plan's M. The planner's
  plan on the virtual cluster of v x N devices chooses its own micro-batches; where that is
  another number, the virtual cluster is planned again at M. MMT on 4 CPU devices: the plan
  at M (64) is kept, faster than every candidate made without it."""
  g = mg.mmt(batch_size=64)
  plan = PLANNERS["graphpipe"](g, cpu_cluster(4), 64, stages_per_device=2)
  assert plan.predicted["shared_devices"] == "planned on 8 virtual devices at M 64"

  def only_the_sweep(planner):
    def call(graph, cluster, batch, num_microbatches=None, **kw):
      if cluster.num_devices == 8 and num_microbatches is not None:
        raise PlanError("left out")
      return planner(graph, cluster, batch, num_microbatches=num_microbatches, **kw)

    return call

  without = plan_with_shared_devices(
    only_the_sweep(PLANNERS["graphpipe"]), g, cpu_cluster(4), 64, stages_per_device=2
  )
  assert "at M" not in without.predicted["shared_devices"]
  assert plan.predicted["iteration_time"] < without.predicted["iteration_time"]


def test_a_plan_given_other_micro_batches_is_priced_at_the_size_it_runs():
  """A plan whose stages name one micro-batch size runs batch / num_microbatches samples a
  micro-batch whatever that size (``stage_microbatch_sizes``), and the cost model prices it so:
  a plan planned for 4 x as many micro-batches and given M again was priced at a quarter of
  its samples (the 145.6B GPT over 1,536 A100s came out at 434 TFLOP/s per GPU, over the
  A100's peak). The candidates of several stages per device are made to name the size they
  run (``at_microbatches``), or left out where their devices do not split it."""
  g = mg.chain(batch_size=1024, layers=8, hidden=1024)
  cluster = v100_cluster(8)
  layers = list(nx.topological_sort(g))

  def plan(size: int, M: int) -> Plan:
    stages = (Stage(0, tuple(layers[:4]), (0, 1), size), Stage(1, tuple(layers[4:]), (2, 3), size))
    return Plan(stages, ((0, 1),), M, batch_size=1024)

  stale, right = plan(16, 16), plan(64, 16)
  t = simulate(stale, g, cluster).iteration_time
  assert t == pytest.approx(simulate(right, g, cluster).iteration_time)  # 5% under before
  fixed = at_microbatches(plan(16, 64), 16, 1024)
  assert isinstance(fixed, Plan) and fixed.num_microbatches == 16
  assert [s.microbatch_size for s in fixed.stages] == [64, 64]
  assert "stage 0 spans 2 devices but a micro-batch has 1 samples" in at_microbatches(
    plan(16, 64), 1024, 1024
  )
  mixed = stale.replace(stages=(stale.stages[0], right.stages[1]))
  assert at_microbatches(mixed, 16, 1024).stages == mixed.stages  # per-stage sizes kept
