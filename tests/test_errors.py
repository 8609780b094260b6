"""Bad input gets a clear error naming the problem and the fix."""

import jax
import jax.numpy as jnp
import optax
import pytest
from harness import OPTIMIZERS, apply_dense, dense, make_batch, mse_step
from test_pipeline_numerics import chain_model, chain_params

import gpp_jax
from gpp_jax.ir.layer_graph import add_edge, add_layer, new_layer_graph
from gpp_jax.ir.plan import Plan, Stage

TX = OPTIMIZERS["adamw"]()


def _pp(step=None, **kw):
  kw.setdefault("num_microbatches", 4)
  kw.setdefault("devices", jax.devices()[:4])
  return gpp_jax.graph_pipeline(step or mse_step(chain_model, TX), **kw)


def _args():
  p = chain_params()
  return p, TX.init(p)


def test_batch_not_divisible_by_microbatches():
  with pytest.raises(gpp_jax.BatchError, match=r"batch of 10 examples does not split into 4"):
    _pp()(*_args(), make_batch(0, 10, 6, 3))


def test_batch_leaves_with_different_sizes():
  b = make_batch(0, 8, 6, 3)
  b["y"] = b["y"][:4]
  with pytest.raises(gpp_jax.BatchError, match="share one leading"):
    _pp()(*_args(), b)


def test_more_stages_than_devices():
  plan = gpp_jax.manual_plan({"l0": 0, "l1": 1, "l2": 2, "l3": 3})
  with pytest.raises(gpp_jax.PlanError, match="4 stages but only 2 devices"):
    _pp(planner=plan, devices=jax.devices()[:2])(*_args(), make_batch(0, 8, 6, 3))


def test_unknown_module_path():
  plan = gpp_jax.manual_plan({"l0": 0, "l1": 1, "l2": 1, "l3": 1, "decoder": 1})
  with pytest.raises(gpp_jax.PlanError, match=r"rules \['decoder'\] match no layer"):
    _pp(planner=plan)(*_args(), make_batch(0, 8, 6, 3))


def test_layer_in_no_rule():
  plan = gpp_jax.manual_plan({"l0": 0, "l1": 1})
  with pytest.raises(gpp_jax.PlanError, match=r"layers \['l2', 'l3'\] match no rule"):
    _pp(planner=plan)(*_args(), make_batch(0, 8, 6, 3))


def test_non_convex_stage():
  # l0 and l2 on stage 0, l1 on stage 1: the path l0 -> l1 -> l2 leaves stage 0 and re-enters.
  plan = gpp_jax.manual_plan({"l0": 0, "l1": 1, "l2": 0, "l3": 2})
  with pytest.raises(gpp_jax.PlanError, match="stage 0 is not convex"):
    _pp(planner=plan)(*_args(), make_batch(0, 8, 6, 3))


def test_stage_graph_cycle_in_plan_ir():
  g = new_layer_graph("g", 1)
  for n in "ab":
    add_layer(g, n)
  add_edge(g, "a", "b", 4)
  plan = Plan((Stage(0, ("a",), (0,)), Stage(1, ("b",), (1,))), ((0, 1), (1, 0)), 2)
  with pytest.raises(gpp_jax.PlanError, match="cycle"):
    gpp_jax.validate_plan(plan, g, 2)


def test_devices_partly_shared_between_stages():
  # Stages share their devices whole (several stages per device) or not at all.
  plan = gpp_jax.manual_plan(
    {"l0": 0, "l1": 1, "l2": 2, "l3": 3}, devices={0: [0, 1], 1: [1, 2], 2: 3, 3: 4}
  )
  with pytest.raises(gpp_jax.PlanError, match="device 1 is used by stages 0 .* and 1"):
    _pp(planner=plan)(*_args(), make_batch(0, 8, 6, 3))


def test_side_effect_in_loss_is_rejected():
  def model(p, x):
    h = jnp.tanh(apply_dense(p["l0"], x))
    jax.debug.print("h {}", h.sum())
    return apply_dense(p["l1"], h)

  params = {"l0": dense(jax.random.key(0), 6, 4), "l1": dense(jax.random.key(1), 4, 3)}
  pp = _pp(mse_step(model, TX), planner=gpp_jax.manual_plan({"l0": 0, "l1": 1}))
  with pytest.raises(
    gpp_jax.CaptureError, match=r"unsupported primitive debug_print.*must be pure"
  ):
    pp(params, TX.init(params), make_batch(0, 8, 6, 3))


def test_batch_used_outside_the_loss_is_the_whole_batch():
  """Not an error: the rest of the step reads the whole batch, as it would undecorated."""

  def step(params, opt_state, batch):
    _loss, grads = gpp_jax.value_and_grad(
      lambda p: jnp.mean((chain_model(p, batch["x"]) - batch["y"]) ** 2)
    )(params)
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, {"ymean": batch["y"].mean()}

  batch = make_batch(0, 8, 6, 3)
  out = _pp(step)(*_args(), batch)
  ref = jax.jit(step)(*_args(), batch)
  assert abs(float(out[2]["ymean"]) - float(ref[2]["ymean"])) <= 1e-6


def test_step_without_marker():
  def step(params, opt_state, batch):
    loss, _grads = jax.value_and_grad(
      lambda p: jnp.mean((chain_model(p, batch["x"]) - batch["y"]) ** 2)
    )(params)
    return params, opt_state, loss

  with pytest.raises(gpp_jax.CaptureError, match="never calls gpp_jax.value_and_grad"):
    _pp(step)(*_args(), make_batch(0, 8, 6, 3))


def test_non_scalar_loss():
  def step(params, opt_state, batch):
    loss, _grads = gpp_jax.value_and_grad(lambda p: (chain_model(p, batch["x"]) - batch["y"]) ** 2)(
      params
    )
    return params, opt_state, loss

  with pytest.raises(gpp_jax.CaptureError, match="scalar loss"):
    _pp(step)(*_args(), make_batch(0, 8, 6, 3))


def test_value_and_grad_outside_pipeline_is_plain_jax():
  p = chain_params()
  b = make_batch(0, 8, 6, 3)
  f = lambda p: jnp.mean((chain_model(p, b["x"]) - b["y"]) ** 2)
  l1, g1 = gpp_jax.value_and_grad(f)(p)
  l2, g2 = jax.value_and_grad(f)(p)
  assert float(l1) == float(l2)
  assert all(jnp.array_equal(a, c) for a, c in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)))


def test_unknown_or_missing_decorator_keyword_is_named():
  with pytest.raises(TypeError, match=r"unexpected keyword 'planer'; did you mean 'planner'"):
    _pp(planer="graphpipe")
  with pytest.raises(TypeError, match=r"needs num_microbatches="):
    gpp_jax.graph_pipeline(mse_step(chain_model, TX))
