"""Per-stage micro-batch sizes: plan checks, schedules with per-stage counts (re-chunked
dependencies), the simulator, and pipelined training that matches one device."""

import itertools

import jax
import jax.numpy as jnp
import optax
import pytest
from harness import (
  DAG_EDGES,
  DAG_STAGES,
  OPTIMIZERS,
  apply_dense,
  compare_steps,
  dag_model,
  dag_params,
  dense,
  make_batch,
  max_diff,
  mse_step,
)
from test_schedule_validator import overlaps, with_lanes

import gpp_jax
from gpp_jax.cost.cluster import cpu_cluster, make_cluster
from gpp_jax.cost.cost_model import plan_costs
from gpp_jax.errors import CaptureError, GppError, PlanError, ScheduleError
from gpp_jax.experiments import model_graphs as mg
from gpp_jax.ir.plan import Plan, Stage, stage_microbatch_counts, validate_plan
from gpp_jax.ir.schedule import Action, Schedule, dependencies, validate_schedule
from gpp_jax.passes.inflight import graph_1f1b, inflight_chunks
from gpp_jax.passes.partition import get_planner
from gpp_jax.passes.partition.plan_assembly import predict
from gpp_jax.passes.partition.problem import PlanningProblem
from gpp_jax.passes.schedules import (
  gpipe,
  make_schedule,
  one_f_one_b,
  plan_schedule,
)
from gpp_jax.passes.simulation import simulate
from gpp_jax.passes.zero_bubble import zero_bubble

TOL = 1e-5
# -- training matches one device ---------------------------------------------------------------


def _matches_one_device(sizes, opt, seed, stage_devices=None, **kw):
  """Trains the DAG with per-stage ``sizes`` (``kw``: steps, num_microbatches, schedule, ...)
  pipelined and on one device; asserts loss and state agree within TOL; returns the pipeline.
  ``stage_devices``: the manual plan's devices per stage."""
  params = dag_params()
  tx = OPTIMIZERS[opt]()
  plan = gpp_jax.manual_plan(
    DAG_STAGES, devices=stage_devices, microbatch_sizes=dict(enumerate(sizes))
  )
  r, p, pp = compare_steps(
    mse_step(dag_model, tx),
    (params, tx.init(params)),
    make_batch(seed, 16, 5, 2),
    planner=plan,
    **kw,
  )
  assert abs(float(r[2]["loss"]) - float(p[2]["loss"])) <= TOL
  assert max_diff(r[:2], p[:2]) <= TOL
  return pp


@pytest.mark.parametrize(
  "schedule,sizes,devices",
  [
    # The loss stage has the biggest chunks; the branch between has the smallest.
    ("1f1b", (4, 2, 8, 8), None),
    # The loss stage has the smallest chunks (its loss is scaled by 2 / 16); a two-device
    # stage runs its own size split over its devices.
    ("gpipe", (8, 2, 4, 2), {2: [2, 3], 3: 4}),
  ],
)
def test_per_stage_sizes_match_one_device(schedule, sizes, devices):
  pp = _matches_one_device(
    sizes,
    "clip_adam",
    3,
    devices,
    num_microbatches=4,
    devices=jax.devices()[:5],
    schedule=schedule,
  )
  counts = tuple(16 // b for b in sizes)
  assert sorted(pp.plan.edges) == DAG_EDGES
  assert pp.schedule.stage_counts == counts
  forwards = [sum(e.action == "F" and e.stage == s for e in pp.timeline.events) for s in range(4)]
  assert tuple(forwards) == counts


def test_zero_bubble_with_per_stage_sizes_matches_one_device():
  pp = _matches_one_device(
    (8, 2, 4, 4),
    "adamw",
    6,
    steps=2,
    num_microbatches=4,
    devices=jax.devices()[:4],
    schedule="zero-bubble",
  )
  assert pp.schedule.stage_counts == (2, 8, 4, 4)
  assert sum(e.action == "W" for e in pp.timeline.events) == 2 + 8 + 4 + 4


def test_graph_1f1b_remat_and_measure_with_per_stage_sizes_match_one_device():
  # measure=True runs one thread per stage, waiting until the re-chunked inputs are complete.
  pp = _matches_one_device(
    (2, 4, 4, 8),
    "adamw",
    5,
    steps=2,
    num_microbatches=2,
    devices=jax.devices()[:4],
    schedule="graph-1f1b",
    remat=True,
    measure=True,
  )
  assert pp.schedule.stage_counts == (8, 4, 4, 2)


def test_aux_outputs_with_per_stage_sizes():
  """Per-example aux outputs are concatenated from the loss stage's chunks, scalars averaged."""
  tx = OPTIMIZERS["adamw"]()

  def step(params, opt_state, batch):
    def loss_fn(p):
      out = dag_model(p, batch["x"])
      err = jnp.mean(jnp.abs(out - batch["y"]))
      return jnp.mean((out - batch["y"]) ** 2), {"pred": out, "err": err}

    (loss, aux), grads = gpp_jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, aux

  params = dag_params()
  batch = make_batch(1, 16, 5, 2)
  plan = gpp_jax.manual_plan(DAG_STAGES, microbatch_sizes={0: 4, 1: 2, 2: 8, 3: 8})
  pp = gpp_jax.graph_pipeline(step, num_microbatches=4, devices=jax.devices()[:4], planner=plan)
  opt_state = tx.init(params)
  with jax.transfer_guard("disallow"):
    out = pp(params, opt_state, batch)
  ref = jax.jit(step)(params, opt_state, batch)
  assert out[3]["pred"].shape == (16, 2)
  assert max_diff(ref[2:], out[2:]) <= TOL


@pytest.mark.parametrize("sizes", [{0: 1}, {3: 1}, {1: 1, 2: 1}])
def test_per_stage_size_one_for_a_linen_model(sizes):
  """A stage at one example per micro-batch: the loss traced at batch 1 numbers its values
  differently (a reshape fewer) but cuts into the same stages, so it runs and matches."""
  from flax import linen as nn
  from flax.training import train_state

  class Branches(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.relu(nn.Dense(8, name="a")(x))
      left, right = jnp.tanh(nn.Dense(8, name="b")(h)), nn.Dense(8, name="c")(h)
      return nn.Dense(3, name="d")(jnp.concatenate([left, right], -1))

  def step(state, batch):
    def loss_fn(p):
      logits = state.apply_fn(p, batch["x"])
      labels = (batch["y"][:, 0] > 0).astype(jnp.int32)
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    loss, grads = gpp_jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  model, batch = Branches(), make_batch(0, 8, 6, 3)
  state = train_state.TrainState.create(
    apply_fn=model.apply, params=model.init(jax.random.key(0), batch["x"]), tx=optax.adam(1e-2)
  )
  plan = gpp_jax.manual_plan(
    {"Branches/a": 0, "Branches/b": 1, "Branches/c": 2, "Branches/d": 3}, microbatch_sizes=sizes
  )
  r, p, _ = compare_steps(
    step, (state,), batch, steps=2, num_microbatches=4, devices=jax.devices()[:4], planner=plan
  )
  assert max_diff(r, p) <= TOL


# -- bad input ---------------------------------------------------------------------------------


def _run(plan, batch=16, num_microbatches=4, devices=None, schedule=None):
  params = dag_params()
  tx = OPTIMIZERS["adamw"]()
  pp = gpp_jax.graph_pipeline(
    mse_step(dag_model, tx),
    num_microbatches=num_microbatches,
    devices=devices or jax.devices()[:4],
    planner=plan,
    schedule=schedule,
  )
  pp(params, tx.init(params), make_batch(0, batch, 5, 2))


def test_size_that_does_not_divide_the_batch():
  plan = gpp_jax.manual_plan(DAG_STAGES, microbatch_sizes={1: 3})
  with pytest.raises(PlanError, match="stage 1 has micro-batch size 3, which does not divide"):
    _run(plan)


def test_sizes_misaligned_on_an_edge():
  plan = gpp_jax.manual_plan(DAG_STAGES, microbatch_sizes={0: 4, 1: 6, 2: 4, 3: 4})
  with pytest.raises(PlanError, match=r"stages 0 and 1 .* sizes 4 and 6 do not align"):
    _run(plan, batch=24)


def test_data_parallel_stage_size_must_split_over_its_devices():
  plan = gpp_jax.manual_plan(
    DAG_STAGES, devices={0: 0, 1: 1, 2: [2, 3, 4], 3: 5}, microbatch_sizes={2: 8}
  )
  with pytest.raises(PlanError, match="stage 2 spans 3 devices but a micro-batch has 8"):
    _run(plan, devices=jax.devices()[:6])


def test_a_value_without_the_batch_axis_cannot_cross_between_sizes():
  def model(p, x):
    h = jnp.tanh(apply_dense(p["inp"], x))
    h = h - jnp.mean(apply_dense(p["stat"], h))  # a scalar per micro-batch, sent to stage 1
    return apply_dense(p["head"], jnp.tanh(apply_dense(p["left"], h)))

  ks = jax.random.split(jax.random.key(0), 4)
  params = {
    "inp": dense(ks[0], 5, 12),
    "stat": dense(ks[1], 12, 1),
    "left": dense(ks[2], 12, 8),
    "head": dense(ks[3], 8, 2),
  }
  tx = OPTIMIZERS["adamw"]()
  plan = gpp_jax.manual_plan(
    {"inp": 0, "stat": 0, "left": 1, "head": 2}, microbatch_sizes={0: 4, 1: 8, 2: 8}
  )
  pp = gpp_jax.graph_pipeline(
    mse_step(model, tx), num_microbatches=4, devices=jax.devices()[:3], planner=plan
  )
  with pytest.raises(CaptureError, match=r"shape \(\) at stage 0 .* give stages 0 and 1 the same"):
    pp(params, tx.init(params), make_batch(0, 16, 5, 2))


def test_schedules_that_need_one_size_refuse():
  plan = gpp_jax.manual_plan(DAG_STAGES, microbatch_sizes={1: 2})
  with pytest.raises(ScheduleError, match=r"'pipedream-async' needs one micro-batch size"):
    _run(plan, schedule="pipedream-async")
  with pytest.raises(ScheduleError, match=r"'2bw' needs one micro-batch size"):
    make_schedule("2bw", 2, [(0, 1)], 4, counts=(4, 2))


def test_random_keys_refuse_per_stage_sizes():
  params = dag_params()
  tx = OPTIMIZERS["adamw"]()

  def step(params, opt_state, key, batch):
    def loss_fn(p):
      x = batch["x"] * jax.random.bernoulli(key, 0.9, batch["x"].shape)
      return jnp.mean((dag_model(p, x) - batch["y"]) ** 2)

    loss, grads = gpp_jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return jax.tree.map(jnp.add, params, updates), opt_state, loss

  pp = gpp_jax.graph_pipeline(
    step,
    num_microbatches=4,
    devices=jax.devices()[:4],
    planner=gpp_jax.manual_plan(DAG_STAGES, microbatch_sizes={1: 2}),
  )
  with pytest.raises(GppError, match="random key.*same micro-batch size"):
    pp(params, tx.init(params), jax.random.key(0), make_batch(0, 16, 5, 2))


def test_plan_helpers():
  stages = tuple(Stage(i, (f"l{i}",), (i,), b) for i, b in enumerate((4, None, 8)))
  plan = Plan(stages, ((0, 1), (1, 2)), num_microbatches=4, batch_size=16)
  validate_plan(plan)
  assert stage_microbatch_counts(plan, 16) == (4, 4, 2)
  # All sizes equal (or none): num_microbatches decides, as for plans without sizes.
  same = plan.replace(stages=tuple(Stage(s.index, s.layers, s.devices, 8) for s in stages))
  assert stage_microbatch_counts(same, 16) == (4, 4, 4)
  with pytest.raises(PlanError, match="no batch_size"):
    validate_plan(plan.replace(batch_size=None))


# -- schedules ---------------------------------------------------------------------------------


def test_dependencies_rechunk():
  g = Schedule("x", 4, tuple(DAG_EDGES), ((),) * 4).stage_graph()
  counts = (4, 8, 2, 2)
  # A big chunk waits for every small producer chunk inside it; a small one for the big one.
  assert set(dependencies(Action("F", 3, 1), g, counts=counts)) == {
    Action("F", 0, 2),
    Action("F", 0, 3),
    Action("F", 1, 4),
    Action("F", 1, 5),
    Action("F", 1, 6),
    Action("F", 1, 7),
    Action("F", 2, 1),
  }
  assert set(dependencies(Action("F", 1, 5), g, counts=counts)) == {Action("F", 0, 2)}
  assert set(dependencies(Action("B", 0, 1), g, counts=counts)) == {
    Action("F", 0, 1),
    Action("B", 1, 2),
    Action("B", 1, 3),
    Action("B", 2, 0),
    Action("B", 3, 0),
  }
  assert set(dependencies(Action("W", 2, 1), g, counts=counts)) == {Action("B", 2, 1)}
  # Against the independent overlap rule, for every action.
  for s, (kind, m) in itertools.product(range(4), itertools.product("FB", range(8))):
    if m >= counts[s]:
      continue
    others = g.predecessors(s) if kind == "F" else g.successors(s)
    want = {
      Action(kind, t, k) for t in others for k in range(counts[t]) if overlaps(s, m, t, k, counts)
    }
    if kind == "B":
      want.add(Action("F", s, m))
    assert set(dependencies(Action(kind, s, m), g, counts=counts)) == want


COUNTS = [(4, 8, 2, 2), (2, 8, 4, 8), (8, 4, 4, 1), (1, 2, 4, 8)]


@pytest.mark.parametrize("gen", [gpipe, one_f_one_b, graph_1f1b, zero_bubble])
@pytest.mark.parametrize("counts", COUNTS)
def test_generators_build_valid_per_stage_schedules(gen, counts):
  sched = gen(4, DAG_EDGES, max(counts), counts=counts)
  validate_schedule(sched)
  assert sched.stage_counts == counts
  for s, lane in enumerate(sched.lanes):
    for kind in "FBW" if gen is zero_bubble else "FB":
      assert [a.microbatch for a in lane if a.kind == kind] == list(range(counts[s]))
  assert Schedule.from_json(sched.to_json()) == sched


def test_one_f_one_b_warmup_is_counted_in_samples():
  # Chain 0 -> 1 -> 2 with sizes 2, 4, 8 of 16 samples: the sink holds 8 samples, stage 1
  # 8 + 8 = 16 (4 chunks), stage 0 16 + 4 = 20, capped at its 8 chunks.
  sched = one_f_one_b(3, [(0, 1), (1, 2)], 8, counts=(8, 4, 2))
  first_b = [next(i for i, a in enumerate(lane) if a.kind == "B") for lane in sched.lanes]
  assert first_b == [8, 4, 1]
  sched = one_f_one_b(3, [(0, 1), (1, 2)], 8, counts=(2, 4, 8))
  first_b = [next(i for i, a in enumerate(lane) if a.kind == "B") for lane in sched.lanes]
  assert first_b == [2, 2, 1]  # 16 and 12 samples: whole chunks of 8 and 4, capped


def test_validator_checks_counts():
  sched = gpipe(2, [(0, 1)], 4, counts=(4, 2))
  with pytest.raises(ScheduleError, match="micro-batch 2 outside 0..1 of stage 1"):
    validate_schedule(with_lanes(sched, sched.lanes[:1] + (gpipe(2, [(0, 1)], 4).lanes[1],)))
  with pytest.raises(ScheduleError, match="never runs B1.1"):
    validate_schedule(
      with_lanes(sched, sched.lanes[:1] + (sched.lanes[1][:3] + sched.lanes[1][4:],))
    )
  with pytest.raises(ScheduleError, match="run 4 and 3 micro-batches"):
    gpipe(2, [(0, 1)], 4, counts=(4, 3))
  with pytest.raises(ScheduleError, match="deadlocks"):
    # B0.0 needs B1.0, which needs F1.0, which needs F0.0 and F0.1: F0.1 comes after B0.0.
    lanes = (
      (Action("F", 0, 0), Action("B", 0, 0), Action("F", 0, 1), Action("B", 0, 1)),
      (Action("F", 1, 0), Action("B", 1, 0)),
    )
    validate_schedule(Schedule("x", 2, ((0, 1),), lanes, (2, 1)))


# -- simulator ---------------------------------------------------------------------------------


def test_simulator_runs_each_stage_at_its_own_size():
  g = mg.chain(batch_size=16, layers=3, hidden=64)
  sizes = (2, 8, 4)
  plan = Plan(
    stages=tuple(Stage(i, (f"fc{i}",), (i,), b) for i, b in enumerate(sizes)),
    edges=((0, 1), (1, 2)),
    num_microbatches=4,
    batch_size=16,
  )
  res = simulate(plan, g, cpu_cluster(3))
  counts = (8, 2, 4)
  assert plan_schedule(plan).stage_counts == counts
  for s, c in enumerate(counts):
    assert sum(a.kind == "F" and a.stage == s for a in res.actions) == c
    assert sum(a.kind == "B" and a.stage == s for a in res.actions) == c
  # One activation transfer per producer chunk, one cotangent per consumer chunk.
  for (i, j), n in {(0, 1): 8, (1, 2): 2}.items():
    assert sum(t.kind == "activation" and (t.src, t.dst) == (i, j) for t in res.transfers) == n
  for (i, j), n in {(0, 1): 2, (1, 2): 4}.items():
    assert sum(t.kind == "cotangent" and (t.src, t.dst) == (j, i) for t in res.transfers) == n
  pc = plan_costs(plan, g, cpu_cluster(3))
  assert pc.microbatch == (2.0, 8.0, 4.0)
  for a in res.actions:
    if a.kind == "F":
      assert a.end - a.start == pytest.approx(pc.forward[a.stage])
  # F1.0 covers the samples of F0.0 .. F0.3: it starts after the last of them arrived.
  last_in = max(
    t.end for t in res.transfers if t.kind == "activation" and t.src == 0 and t.microbatch < 4
  )
  assert res.time_of(Action("F", 1, 0))[0] >= last_in


# -- planner -----------------------------------------------------------------------------------


def test_stage_microbatch_pass_is_valid_and_never_slower():
  g = mg.model_graph("dlrm")
  cl = make_cluster("v100", 8)
  uniform = get_planner("graphpipe")(g, cl, 256, num_microbatches=8)
  plan = get_planner("graphpipe-stage-mb")(g, cl, 256, num_microbatches=8)
  validate_plan(plan, g, 8)
  assert plan.planner == "graphpipe+stage-mb"
  sizes = [s.microbatch_size for s in plan.stages]
  assert len(set(sizes)) > 1  # DLRM gains from bigger micro-batches on some stages
  start = predict(PlanningProblem.build(g, cl, 256), uniform).predicted["iteration_time"]
  assert plan.predicted["iteration_time"] < start
  sim = simulate(plan, g, cl)
  assert sim.iteration_time == pytest.approx(plan.predicted["iteration_time"])
  counts = stage_microbatch_counts(plan, 256)
  assert [s.in_flight for s in plan.stages] == list(inflight_chunks(8, plan.edges, counts))
