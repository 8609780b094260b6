"""Several steps in one call (``GraphPipeline.run_steps``): PipeDream's 1F1B without flushes
under the stale-weight schedules, the same values as one call per step, and the multi-step
schedule IR (validator, simulator) it runs."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from harness import (
  DAG_EDGES,
  DAG_STAGES,
  OPTIMIZERS,
  dag_model,
  dag_params,
  make_batch,
  max_diff,
  mse_step,
)
from test_async_schedules import DELAYS, reference_loop
from test_flax_steps import NNXNet, nnx_train_step

import gpp_jax
from gpp_jax.errors import BatchError, CaptureError, ScheduleError
from gpp_jax.ir.schedule import Action, Schedule, validate_schedule
from gpp_jax.passes.schedules import make_schedule, stream_schedule

TOL = 1e-5


def _pipeline(tx, schedule, **kw):
  return gpp_jax.graph_pipeline(
    mse_step(dag_model, tx),
    num_microbatches=4,
    devices=jax.devices()[:4],
    planner=gpp_jax.manual_plan(DAG_STAGES),
    schedule=schedule,
    **kw,
  )


@pytest.mark.parametrize(
  "schedule,opt",
  [
    ("pipedream-async", "adamw"),
    ("pipedream-async-vsync", "adamw"),
    ("2bw", "adamw"),
    # Clipping by the global norm reads every stage's gradients before any update.
    ("pipedream-async", "clip_adam"),
  ],
)
def test_run_steps_streams_and_matches_the_delayed_update_reference(schedule, opt):
  """6 steps as one call of 1 step then a stream of 5 (the stream reads the weight versions
  the earlier call kept): the delayed-update reference loop within 1e-5, and one stage's next
  step starts before its last backward of the step before (no flush)."""
  tx = OPTIMIZERS[opt]()
  params = dag_params()
  batches = [make_batch(20 + t, 8, 5, 2) for t in range(6)]
  pp = _pipeline(tx, schedule)
  o0 = tx.init(params)
  with jax.transfer_guard("disallow"):
    p, o, m = pp(params, o0, batches[0])
    p, o, metrics = pp.run_steps(p, o, batches[1:], stream=True)
  losses = [float(m["loss"])] + [float(x["loss"]) for x in metrics]
  rp, ro, rlosses = reference_loop(params, tx, batches, DELAYS[schedule])
  assert max_diff(rp, p) <= TOL
  assert max_diff(ro, o) <= TOL
  assert np.max(np.abs(np.array(losses) - np.array(rlosses))) <= TOL
  # Issue order: stage 0's first forward of step 1 (micro-batch 4) before its last backward
  # of step 0 (micro-batch 3).
  order = [(e.action, e.stage, e.microbatch) for e in pp.timeline.events]
  assert order.index(("F", 0, 4)) < order.index(("B", 0, 3))
  assert order.index(("UPDATE", 0, 0)) < order.index(("B", 0, 4))


def test_run_steps_on_cpu_streams_only_when_asked():
  """On CPU devices the default runs one call per step (the stream is slower there); the
  values are the stream's."""
  tx = OPTIMIZERS["adamw"]()
  params = dag_params()
  batches = [make_batch(50 + t, 8, 5, 2) for t in range(3)]
  out = {}
  for stream in (None, True):
    pp = _pipeline(tx, "2bw")
    out[stream] = pp.run_steps(params, tx.init(params), batches, stream=stream)
    beyond_one_step = [e for e in pp.timeline.events if e.microbatch >= 4]
    assert bool(beyond_one_step) == bool(stream)
  assert max_diff(out[None], out[True]) <= TOL


def test_run_steps_of_a_synchronous_schedule_equals_one_call_per_step():
  tx = OPTIMIZERS["adamw"]()
  params = dag_params()
  batches = [make_batch(40 + t, 8, 5, 2) for t in range(3)]
  one, many = _pipeline(tx, "1f1b"), _pipeline(tx, "1f1b")
  p, o = params, tx.init(params)
  losses = []
  for b in batches:
    p, o, m = one(p, o, b)
    losses.append(float(m["loss"]))
  sp, so, metrics = many.run_steps(params, tx.init(params), batches)
  assert max_diff(p, sp) == 0.0 and max_diff(o, so) == 0.0
  assert losses == [float(x["loss"]) for x in metrics]


def test_run_steps_updates_nnx_objects_like_one_call_per_step():
  def fresh():
    m = NNXNet(nnx.Rngs(0))
    return m, nnx.Optimizer(m, optax.adam(1e-2), wrt=nnx.Param)

  kw = dict(
    num_microbatches=2,
    devices=jax.devices()[:3],
    planner=gpp_jax.manual_plan({"enc": 0, "mid": 1, "head": 2}),
    schedule="pipedream-async",
  )
  batches = [make_batch(60 + t, 8, 5, 3) for t in range(4)]
  (m1, o1), (m2, o2) = fresh(), fresh()
  one = gpp_jax.graph_pipeline(nnx_train_step, **kw)
  losses = [float(one(m1, o1, b)) for b in batches]
  many = gpp_jax.graph_pipeline(nnx_train_step, **kw)
  streamed = many.run_steps(m2, o2, batches, stream=True)
  assert [float(x) for x in streamed] == pytest.approx(losses, abs=TOL)
  assert max_diff(nnx.state((m1, o1)), nnx.state((m2, o2))) <= TOL
  assert int(o2.step[...]) == 4


def test_run_steps_bad_input_is_named():
  tx = OPTIMIZERS["adamw"]()
  params = dag_params()
  pp = _pipeline(tx, "2bw")
  o = tx.init(params)
  with pytest.raises(BatchError, match="list of per-step batches"):
    pp.run_steps(params, o, make_batch(1, 8, 5, 2))
  with pytest.raises(BatchError, match="one structure, shape and dtype; batch 1"):
    pp.run_steps(params, o, [make_batch(1, 8, 5, 2), make_batch(2, 12, 5, 2)])

  def loss_only(params, opt_state, batch):  # returns no new state
    return mse_step(dag_model, tx)(params, opt_state, batch)[2]

  bad = gpp_jax.graph_pipeline(
    loss_only,
    num_microbatches=4,
    devices=jax.devices()[:4],
    planner=gpp_jax.manual_plan(DAG_STAGES),
    schedule="2bw",
  )
  with pytest.raises(CaptureError, match="new non-batch arguments first"):
    bad.run_steps(params, o, [make_batch(1, 8, 5, 2)] * 2)


# ---------------------------------------------------------------- the multi-step schedule IR


@pytest.mark.parametrize(
  "name", ["pipedream-async", "pipedream-async-vsync", "2bw", "1f1b", "zero-bubble"]
)
@pytest.mark.parametrize("M", [1, 2, 5])
def test_stream_schedule_is_valid_and_round_trips(name, M):
  one = make_schedule(name, 4, DAG_EDGES, M)
  multi = stream_schedule(one, 3)
  validate_schedule(multi)
  assert multi.steps == 3
  assert Schedule.from_json(multi.to_json()) == multi
  for s, lane in enumerate(multi.lanes):
    assert [a for a in lane if a.kind == "UPDATE"] == [Action("UPDATE", s, t) for t in range(3)]
  assert stream_schedule(one, 1) is one


def test_stream_schedule_validator_names_the_misplaced_action():
  multi = stream_schedule(make_schedule("1f1b", 2, [(0, 1)], 2), 2)
  lanes = [list(l) for l in multi.lanes]

  def with_lane(s, lane):
    ls = list(lanes)
    ls[s] = lane
    return Schedule(multi.name, 2, multi.edges, tuple(map(tuple, ls)), None, 2)

  # Stage 1 (synchronous: no staleness) computing step 1 before its update of step 0.
  lane = lanes[1]
  i, j = lane.index(Action("UPDATE", 1, 0)), lane.index(Action("F", 1, 2))
  lane2 = list(lane)
  lane2[i], lane2[j] = lane2[j], lane2[i]
  with pytest.raises(ScheduleError, match=r"F1\.2 \(step 1\) computes with the weights UPDATE1\.0"):
    validate_schedule(with_lane(1, lane2))
  # An update before the backward whose gradient it applies.
  lane3 = [a for a in lane if a != Action("UPDATE", 1, 0)]
  lane3.insert(lane3.index(Action("B", 1, 1)), Action("UPDATE", 1, 0))
  with pytest.raises(ScheduleError, match=r"UPDATE1\.0 comes before B1\.1"):
    validate_schedule(with_lane(1, lane3))
  # A missing update.
  lane4 = [a for a in lane if a != Action("UPDATE", 1, 1)]
  with pytest.raises(ScheduleError, match=r"never runs UPDATE1\.1"):
    validate_schedule(with_lane(1, lane4))
  # Stale weights allow what synchronous ones do not: stage 0 of pipedream-async is one update
  # behind, so step 1's forwards may come before its update of step 0.
  stale = stream_schedule(make_schedule("pipedream-async", 2, [(0, 1)], 2), 2)
  lane0 = stale.lanes[0]
  assert lane0.index(Action("F", 0, 2)) < lane0.index(Action("UPDATE", 0, 0))


def test_simulated_stream_removes_the_flush():
  """Per step over 8 steps, PipeDream's 1F1B without flushes is faster than 1F1B with them,
  and approaches the busiest stage's work (M * (F + B) + update)."""
  from gpp_jax.passes.simulation import StageTimes, simulate_times

  S, M, K = 4, 8, 8
  chain = [(s, s + 1) for s in range(S - 1)]
  times = StageTimes(forward=[1.0] * S, backward=[2.0] * S, update=[0.5] * S)
  per_step = {}
  for name in ("1f1b", "pipedream-async"):
    multi = stream_schedule(make_schedule(name, S, chain, M), K)
    per_step[name] = simulate_times(multi, times).iteration_time / K
  one = simulate_times(make_schedule("1f1b", S, chain, M), times).iteration_time
  assert per_step["1f1b"] == pytest.approx(one)  # flushed steps: K times one step
  busiest = M * 3.0 + 0.5
  assert busiest <= per_step["pipedream-async"] < per_step["1f1b"]
  # The fill and drain of one step, (S - 1) * (F + B), spread over K steps.
  assert per_step["pipedream-async"] == pytest.approx(busiest + (S - 1) * 3.0 / K)
