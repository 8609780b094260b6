"""A Flax user's step as written: keyword arguments, one micro-batch equal to the plain step
(keys included), metrics computed from the batch after the loss, summed aux values."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from harness import DAG_STAGES, dag_model, dag_params, make_batch, max_diff

import gpp_jax

TOL = 1e-5
tx = optax.adam(1e-2)


def _pipeline(step, M=4, **kw):
  return gpp_jax.graph_pipeline(
    step,
    num_microbatches=M,
    devices=jax.devices()[:4],
    planner=gpp_jax.manual_plan(DAG_STAGES),
    **kw,
  )


def step_with_options(params, opt_state, batch, *, scale=1.0):
  def loss_fn(p):
    return jnp.mean((dag_model(p, batch["x"]) - batch["y"]) ** 2) * scale

  loss, grads = gpp_jax.value_and_grad(loss_fn)(params)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def test_keyword_arguments_reach_the_step():
  params, batch = dag_params(), make_batch(0, 8, 5, 2)
  pp = _pipeline(step_with_options)
  ref = jax.jit(step_with_options)(params, tx.init(params), batch, scale=3.0)
  out = pp(params, tx.init(params), batch, scale=3.0)
  assert max_diff(ref, out) <= TOL
  # The batch given by name is still the batch; another value of the option, another result.
  by_name = pp(params, tx.init(params), batch=batch, scale=3.0)
  assert max_diff(out, by_name) <= TOL
  other = pp(params, tx.init(params), batch, scale=1.0)
  assert abs(float(other[2]) * 3.0 - float(out[2])) <= TOL
  with pytest.raises(TypeError, match="unexpected keyword argument 'scal'"):
    pp(params, tx.init(params), batch, scal=1.0)


def dropout_step(params, opt_state, key, batch):
  def loss_fn(p):
    h = jnp.tanh(batch["x"] @ p["inp"]["w"] + p["inp"]["b"])
    mask = jax.random.bernoulli(key, 0.5, h.shape)
    h = jnp.where(mask, h / 0.5, 0.0)
    out = h @ p["head"]["w"][:6] + p["head"]["b"]
    return jnp.mean((out - batch["y"]) ** 2), mask

  (loss, mask), grads = gpp_jax.value_and_grad(loss_fn, has_aux=True)(params)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss, mask


def test_one_microbatch_equals_the_plain_step_keys_included():
  params, batch = dag_params(), make_batch(1, 8, 5, 2)
  key = jax.random.key(7)
  ref = jax.jit(dropout_step)(params, tx.init(params), key, batch)
  for fuse in (True, False):
    pp = gpp_jax.graph_pipeline(
      dropout_step,
      num_microbatches=1,
      devices=jax.devices()[:2],
      planner=gpp_jax.manual_plan({"inp": 0, "head": 1}),
      fuse=fuse,
    )
    out = pp(params, tx.init(params), key, batch)
    np.testing.assert_array_equal(np.asarray(out[3]), np.asarray(ref[3]))  # the same draws
    assert max_diff(ref[:3], out[:3]) <= TOL


def test_several_microbatches_fold_the_index_into_the_key():
  """The documented rule for M > 1: micro-batch m draws with fold_in(key, m)."""
  params, batch = dag_params(), make_batch(2, 8, 5, 2)
  key = jax.random.key(7)
  pp = gpp_jax.graph_pipeline(
    dropout_step,
    num_microbatches=2,
    devices=jax.devices()[:2],
    planner=gpp_jax.manual_plan({"inp": 0, "head": 1}),
  )
  out = pp(params, tx.init(params), key, batch)
  halves = [jax.tree.map(lambda a, m=m: a[4 * m : 4 * m + 4], batch) for m in range(2)]
  masks = [
    jax.jit(dropout_step)(params, tx.init(params), jax.random.fold_in(key, m), h)[3]
    for m, h in enumerate(halves)
  ]
  np.testing.assert_array_equal(np.asarray(out[3]), np.concatenate(masks))


class Classifier(nnx.Module):
  def __init__(self, rngs):
    self.body = nnx.Linear(5, 8, rngs=rngs)
    self.head = nnx.Linear(8, 3, rngs=rngs)

  def __call__(self, x):
    return self.head(nnx.relu(self.body(x)))


def classify_step(model, optimizer, batch):
  """As the Flax examples write it: logits from the loss's aux, metrics from the batch."""

  def loss_fn(model):
    logits = model(batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    count = jnp.sum(batch["label"] >= 0).astype(jnp.float32)
    return loss, {"logits": logits, "count": count}

  (loss, aux), grads = gpp_jax.value_and_grad(loss_fn, has_aux=True, aux_reduce={"count": "sum"})(
    model
  )
  optimizer.update(model, grads)
  accuracy = jnp.mean(jnp.argmax(aux["logits"], -1) == batch["label"])
  return {"loss": loss, "accuracy": accuracy, "count": aux["count"]}


def _classify_batch(seed: int):
  rng = np.random.default_rng(seed)
  return {
    "x": rng.normal(size=(8, 5)).astype(np.float32),
    "label": rng.integers(0, 3, size=(8,)).astype(np.int32),
  }


def test_metrics_from_the_batch_and_summed_aux_match_the_plain_step():
  def fresh():
    model = Classifier(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

  ref_model, ref_opt = fresh()
  model, opt = fresh()
  pp = gpp_jax.graph_pipeline(
    classify_step,
    num_microbatches=4,
    devices=jax.devices()[:2],
    planner=gpp_jax.manual_plan({"body": 0, "head": 1}),
  )
  plain = nnx.jit(classify_step)
  for seed in range(2):
    batch = _classify_batch(seed)
    r = plain(ref_model, ref_opt, batch)
    p = pp(model, opt, batch)
    assert max_diff(r, p) <= TOL
    assert float(p["count"]) == 8.0  # summed over the micro-batches, not averaged
  assert max_diff(nnx.state(ref_model), nnx.state(model)) <= TOL


def test_aux_reduce_must_name_known_reductions():
  with pytest.raises(gpp_jax.CaptureError, match="aux_reduce takes"):
    gpp_jax.value_and_grad(lambda p: (p, p), has_aux=True, aux_reduce="median")
