"""The decorated step's per-call path: new NNX state written straight into the objects'
Variables, and the compiled-step cache keyed cheaply (``benchmarks/overhead.py`` times it
against ``nnx.jit``)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from harness import max_diff

import gpp_jax
from gpp_jax.runtime import pipeline as pipeline_mod


class Net(nnx.Module):
  def __init__(self, rngs):
    self.a = nnx.Linear(4, 8, rngs=rngs)
    self.b = nnx.Linear(8, 2, rngs=rngs)

  def __call__(self, x):
    return self.b(jnp.tanh(self.a(x)))


def step(model, optimizer, batch):
  def loss_fn(model):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

  loss, grads = gpp_jax.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


def _batch(n=8):
  rng = np.random.default_rng(0)
  return {
    "x": rng.normal(size=(n, 4)).astype(np.float32),
    "y": rng.normal(size=(n, 2)).astype(np.float32),
  }


def _fresh(seed: int):
  """A model and its adam optimizer, the same for the same seed."""
  m = Net(nnx.Rngs(seed))
  return m, nnx.Optimizer(m, optax.adam(1e-2), wrt=nnx.Param)


def test_new_state_goes_into_the_same_variables_without_nnx_update(monkeypatch):
  ref_model, ref_opt = _fresh(0)
  ref = nnx.jit(step)
  model, opt = _fresh(0)
  kernel = model.a.kernel  # the Variable object
  pp = gpp_jax.graph_pipeline(step, num_microbatches=1, devices=jax.devices()[:1])
  batch = _batch()
  pp(model, opt, batch)  # compiles (and may take the general path)

  def no_update(*a, **k):
    raise AssertionError("the per-call path should write the Variables directly")

  monkeypatch.setattr(pipeline_mod.nnx, "update", no_update)
  for _ in range(2):
    pp(model, opt, batch)
  monkeypatch.undo()
  for _ in range(3):
    ref(ref_model, ref_opt, batch)
  assert model.a.kernel is kernel
  assert max_diff(nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param)) <= 1e-5
  assert max_diff(nnx.state(opt), nnx.state(ref_opt)) <= 1e-5
  assert int(opt.step[...]) == 3


def test_compiled_step_cache_keys_on_shapes_and_dtypes():
  m = Net(nnx.Rngs(1))
  opt = nnx.Optimizer(m, optax.sgd(1e-2), wrt=nnx.Param)
  pp = gpp_jax.graph_pipeline(step, num_microbatches=1, devices=jax.devices()[:1])
  pp(m, opt, _batch(8))
  pp(m, opt, _batch(8))
  assert len(pp._compiled) == 1
  pp(m, opt, _batch(4))  # another batch shape: another compiled step
  assert len(pp._compiled) == 2
  # A NumPy array and a JAX array of one shape and dtype are the same signature.
  pp(m, opt, jax.tree.map(jnp.asarray, _batch(4)))
  assert len(pp._compiled) == 2
  with pytest.raises(Exception):  # noqa: B017 - a batch the model cannot take fails, not hangs
    pp(m, opt, {"x": np.ones((4, 3), np.float32), "y": np.ones((4, 2), np.float32)})


def test_steady_state_call_puts_nothing_already_where_it_goes(monkeypatch):
  """The cached step's later calls pass its own last outputs and a batch already on the
  device (``jnp.asarray``: uncommitted) straight to the program, as jit takes them: no
  ``device_put`` a call (each was tens of microseconds of host time), the same result."""
  ref_model, ref_opt = _fresh(2)
  ref = nnx.jit(step)
  model, opt = _fresh(2)
  device = jax.devices()[0]
  fast = gpp_jax.graph_pipeline(step, num_microbatches=1, devices=[device]).cached_partial(
    model, opt
  )
  batch = jax.tree.map(jnp.asarray, _batch())
  assert not batch["x"].committed and batch["x"].devices() == {device}
  fast(batch)
  puts = []
  real_put = jax.device_put

  def counting_put(*a, **k):
    puts.append(a)
    return real_put(*a, **k)

  monkeypatch.setattr(jax, "device_put", counting_put)
  for _ in range(2):
    fast(batch)
  monkeypatch.undo()
  assert puts == []
  for _ in range(3):
    ref(ref_model, ref_opt, batch)
  assert max_diff(nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param)) <= 1e-5
  assert max_diff(nnx.state(opt), nnx.state(ref_opt)) <= 1e-5


def test_a_calibrated_step_is_predicted_with_the_time_outside_of_its_own_call_path(monkeypatch):
  """With calibrate=True the host's time outside the program per call is measured on the
  step's own arguments, on the path it is called by, in place of the host probe's (a small
  functional step's): through ``cached_partial`` the Variables read and written, through the
  decorated call the NNX objects split and written back too (more). Measuring leaves the
  objects' values as they were."""
  import functools

  from gpp_jax.cost.host import HostCosts
  from gpp_jax.runtime import host as host_mod
  from gpp_jax.runtime.capture_step import functionalize

  ops = ("F", "B", "W", "UPDATE", "SEND", "RECV", "STEP")
  probed = HostCosts(per_op=dict.fromkeys(ops, 1e-5), outside=1.0, parallel=1.0, cores=2)
  monkeypatch.setattr(host_mod, "measure_host", lambda devices, *_: probed)
  batch = _batch()
  outside = {}
  for how in ("decorated", "cached"):
    model, opt = _fresh(0)
    pp = gpp_jax.graph_pipeline(step, num_microbatches=1, devices=jax.devices()[:1], calibrate=True)
    call = pp.cached_partial(model, opt) if how == "cached" else functools.partial(pp, model, opt)
    call(batch)
    planned = pp.compiled.planned
    outside[how] = planned.host.outside
    if planned.predicted_how == "measured":  # the trial's time, with the path's outside
      assert planned.predicted_s >= outside[how]
  assert 0.0 < outside["cached"] < outside["decorated"] < probed.outside
  # Measuring runs nothing and changes nothing.
  model, opt = _fresh(1)
  fast = pp.cached_partial(model, opt)
  full = (model, opt, batch)
  pure, leaves = functionalize(step, full)
  before = jax.tree.leaves(nnx.state((model, opt)))
  assert fast.seconds_outside(full, pure, leaves) > 0.0
  assert pp.seconds_outside(full, pure, leaves) > 0.0
  after = jax.tree.leaves(nnx.state((model, opt)))
  assert len(before) == len(after) and all(a is b for a, b in zip(before, after))
