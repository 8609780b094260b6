"""Stages spanning several devices (data parallel inside the stage) match one device."""

import jax
import pytest
from harness import OPTIMIZERS, compare_steps, dense, make_batch, max_diff, mse_step
from jax.sharding import NamedSharding
from test_pipeline_numerics import diamond_model

import gpp_jax

TOL = 1e-5


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_stages_of_width_1_2_4(schedule):
  ks = jax.random.split(jax.random.key(7), 4)
  params = {
    "inp": dense(ks[0], 5, 12),
    "left": dense(ks[1], 12, 8),
    "right": dense(ks[2], 12, 8),
    "head": dense(ks[3], 16, 2),
  }
  tx = OPTIMIZERS["clip_adam"]()
  plan = gpp_jax.manual_plan(
    {"inp": 0, "left": 1, "right": 2, "head": 2}, devices={0: 0, 1: [1, 2], 2: [4, 5, 6, 7]}
  )
  r, p, pp = compare_steps(
    mse_step(diamond_model, tx),
    (params, tx.init(params)),
    make_batch(7, 32, 5, 2),
    num_microbatches=4,
    devices=jax.devices(),
    planner=plan,
    schedule=schedule,
  )
  assert [len(s.devices) for s in pp.plan.stages] == [1, 2, 4]
  assert abs(float(r[2]["loss"]) - float(p[2]["loss"])) <= TOL
  assert max_diff(r[:2], p[:2]) <= TOL
  # Parameters of a wide stage are replicated over its sub-mesh.
  w = p[0]["head"]["w"]
  assert isinstance(w.sharding, NamedSharding)
  assert w.sharding.device_set == {jax.devices()[i] for i in (4, 5, 6, 7)}


def test_microbatch_must_split_across_stage_width():
  params = {
    "inp": dense(jax.random.key(0), 5, 12),
    "left": dense(jax.random.key(1), 12, 8),
    "right": dense(jax.random.key(2), 12, 8),
    "head": dense(jax.random.key(3), 16, 2),
  }
  tx = OPTIMIZERS["adamw"]()
  plan = gpp_jax.manual_plan(
    {"inp": 0, "left": 1, "right": 2, "head": 2}, devices={0: 0, 1: [1, 2, 3], 2: 4}
  )
  pp = gpp_jax.graph_pipeline(mse_step(diamond_model, tx), num_microbatches=4, planner=plan)
  with pytest.raises(gpp_jax.PlanError, match="spans 3 devices but a micro-batch has 4"):
    pp(params, tx.init(params), make_batch(0, 16, 5, 2))
