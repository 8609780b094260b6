"""State the loss updates: Linen mutable batch statistics, NNX BatchNorm and nnx.Rngs dropout.

The documented reference is the gradient-accumulation loop over the micro-batches on one
device, with the state carried from one micro-batch to the next.
"""

import pathlib
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from flax.training import train_state
from harness import max_diff

import gpp_jax
from gpp_jax.errors import CaptureError, PlanError

TOL = 1e-5
M = 4
STEPS = 3


def _batch(seed=0, n=16):
  rng = np.random.default_rng(seed)
  return {
    "x": rng.normal(size=(n, 5)).astype(np.float32),
    "y": rng.normal(size=(n, 3)).astype(np.float32),
  }


def _split(batch):
  return [jax.tree.map(lambda a, m=m: a.reshape(M, -1, *a.shape[1:])[m], batch) for m in range(M)]


# ---------------------------------------------------------------------------------- Linen


class Block(nn.Module):
  @nn.compact
  def __call__(self, x, train):
    h = nn.Dense(16, use_bias=False)(x)
    h = nn.BatchNorm(use_running_average=not train, momentum=0.8)(h)
    return x + nn.relu(h)


class ResNet(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Dense(16, name="stem")(x)
    for i in range(3):
      x = Block(name=f"block{i}")(x, train)
    return nn.Dense(3, name="head")(x)


class BNState(train_state.TrainState):
  batch_stats: Any


def _linen_state():
  model = ResNet()
  variables = model.init(jax.random.key(0), jnp.ones((2, 5)))
  return BNState.create(
    apply_fn=model.apply,
    params=variables["params"],
    batch_stats=variables["batch_stats"],
    tx=optax.adam(1e-2),
  )


def _linen_loss(state, params, batch_stats, batch):
  out, updates = state.apply_fn(
    {"params": params, "batch_stats": batch_stats}, batch["x"], mutable=["batch_stats"]
  )
  return jnp.mean((out - batch["y"]) ** 2), updates


def _readme_step():
  """The README's Linen batch-statistics step, run as written (with an MSE loss)."""
  text = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
  (src,) = [s for s in re.findall(r"^```python\n(.*?)^```", text, re.S | re.M) if "mutable=" in s]
  namespace = {"gpp_jax": gpp_jax, "loss": lambda out, y: jnp.mean((out - y) ** 2)}
  exec(compile(src, "README.md", "exec"), namespace)
  return namespace["train_step"]


linen_step = _readme_step()


@jax.jit
def linen_reference(state, batch):
  """Gradient accumulation over the micro-batches, batch statistics carried along."""
  loss, grads, stats = 0.0, jax.tree.map(jnp.zeros_like, state.params), state.batch_stats
  for mb in _split(batch):
    (l, updates), g = jax.value_and_grad(
      lambda p, s, b=mb: _linen_loss(state, p, s, b), has_aux=True
    )(state.params, stats)
    stats = updates["batch_stats"]
    loss += l / M
    grads = jax.tree.map(lambda a, b: a + b / M, grads, g)
  return state.apply_gradients(grads=grads, batch_stats=stats), {"loss": loss}


@pytest.mark.parametrize("planner", ["graphpipe", "pipedream"])
def test_linen_batchnorm_matches_accumulation(planner):
  batch = _batch(0)
  dev0 = jax.devices()[0]
  ref, state = jax.device_put(_linen_state(), dev0), _linen_state()
  pp = gpp_jax.graph_pipeline(
    linen_step, num_microbatches=M, devices=jax.devices()[:4], planner=planner
  )
  with jax.transfer_guard("disallow"):
    for _ in range(STEPS):
      ref, rm = linen_reference(ref, jax.device_put(batch, dev0))
      state, pm = pp(state, batch)
  assert pp.plan.num_stages > 1
  assert abs(float(rm["loss"]) - float(pm["loss"])) <= TOL
  assert max_diff(ref.params, state.params) <= TOL
  assert max_diff(ref.batch_stats, state.batch_stats) <= TOL
  # The statistics are carried micro-batch after micro-batch, not averaged: the plain
  # full-batch step ends elsewhere.
  plain, _ = jax.jit(linen_step_plain)(_linen_state(), batch)
  assert max_diff(plain.batch_stats, state.batch_stats) > 1e-3


def linen_step_plain(state, batch):
  (loss, updates), grads = jax.value_and_grad(
    lambda p: _linen_loss(state, p, state.batch_stats, batch), has_aux=True
  )(state.params)
  return state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"]), loss


def test_linen_dropped_collection_is_an_error():
  def step(state, batch):
    def loss_fn(params):
      return _linen_loss(state, params, state.batch_stats, batch)

    (loss, _), grads = gpp_jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}

  state = _linen_state()
  before = jax.tree.map(np.array, (state.params, state.batch_stats))
  pp = gpp_jax.graph_pipeline(step, num_microbatches=M, devices=jax.devices()[:2])
  with pytest.raises(CaptureError, match=r"batch_stats/block0/BatchNorm_0/mean.*never returns"):
    pp(state, _batch(0))
  assert max_diff(before, (state.params, state.batch_stats)) == 0.0
  assert int(state.step) == 0


# ---------------------------------------------------------------------------------- NNX


class NNXNet(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(5, 16, use_bias=False, rngs=rngs)
    self.bn1 = nnx.BatchNorm(16, momentum=0.8, rngs=rngs)
    self.do1 = nnx.Dropout(0.2, rngs=rngs)
    self.l2 = nnx.Linear(16, 16, use_bias=False, rngs=rngs)
    self.bn2 = nnx.BatchNorm(16, momentum=0.8, rngs=rngs)
    self.do2 = nnx.Dropout(0.2, rngs=rngs)
    self.head = nnx.Linear(16, 3, rngs=rngs)

  def __call__(self, x):
    h = self.do1(jax.nn.relu(self.bn1(self.l1(x))))
    h = self.do2(jax.nn.relu(self.bn2(self.l2(h))))
    return self.head(h)


def _nnx_loss(model, batch):
  return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def nnx_step(model, optimizer, batch):
  loss, grads = gpp_jax.value_and_grad(lambda m: _nnx_loss(m, batch))(model)
  optimizer.update(model, grads)
  return loss


@nnx.jit
def nnx_reference(model, optimizer, batch):
  """Gradient accumulation: batch statistics and Rngs counters advance per micro-batch."""
  loss, grads = 0.0, None
  for mb in _split(batch):
    l, g = nnx.value_and_grad(lambda m, b=mb: _nnx_loss(m, b))(model)
    loss += l / M
    grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
  optimizer.update(model, jax.tree.map(lambda g: g / M, grads))
  return loss


def _nnx_fresh():
  model = NNXNet(nnx.Rngs(0, dropout=1))
  return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def _no_keys(model):
  return nnx.state(model, nnx.Not(nnx.RngKey))


@pytest.mark.parametrize("planner", ["graphpipe", "pipedream"])
def test_nnx_batchnorm_and_dropout_match_accumulation(planner):
  batch = _batch(1)
  ref_model, ref_opt = _nnx_fresh()
  model, opt = _nnx_fresh()
  pp = gpp_jax.graph_pipeline(
    nnx_step, num_microbatches=M, devices=jax.devices()[:4], planner=planner
  )
  for _ in range(STEPS):
    lr = nnx_reference(ref_model, ref_opt, batch)
    lp = pp(model, opt, batch)
  assert pp.plan.num_stages > 1
  assert abs(float(lr) - float(lp)) <= TOL
  assert max_diff(_no_keys(ref_model), _no_keys(model)) <= TOL
  assert max_diff(nnx.state(ref_opt), nnx.state(opt)) <= TOL
  # Each dropout stream drew once per micro-batch, as in the reference loop.
  assert int(model.do1.rngs.count[...]) == int(model.do2.rngs.count[...]) == M * STEPS
  # Dropout is active: without it the loss differs.
  ref_model.do1.deterministic = ref_model.do2.deterministic = True
  assert abs(float(nnx.jit(_nnx_loss)(ref_model, batch)) - float(lr)) > 1e-3


class SharedStream(nnx.Module):
  """One Rngs stream drawn by two layers: each draw advances the one counter."""

  def __init__(self, rngs):
    self.a = nnx.Linear(5, 16, rngs=rngs)
    self.b = nnx.Linear(16, 3, rngs=rngs)
    self.rngs = rngs

  def __call__(self, x):
    h = nnx.Dropout(0.2)(jax.nn.relu(self.a(x)), rngs=self.rngs)
    return nnx.Dropout(0.2)(self.b(h), rngs=self.rngs)


def test_one_stream_drawn_in_two_stages_matches_accumulation():
  batch = _batch(2)

  def fresh():
    model = SharedStream(nnx.Rngs(0, dropout=1))
    return model, nnx.Optimizer(model, optax.sgd(1e-1), wrt=nnx.Param)

  ref_model, ref_opt = fresh()
  model, opt = fresh()
  pp = gpp_jax.graph_pipeline(
    nnx_step,
    num_microbatches=M,
    devices=jax.devices()[:2],
    planner=gpp_jax.manual_plan({"a": 0, "b": 1}),
    remat=True,  # the backward recomputes the forward from the state it was given
  )
  for _ in range(2):
    lr = nnx_reference(ref_model, ref_opt, batch)
    lp = pp(model, opt, batch)
  assert abs(float(lr) - float(lp)) <= TOL
  assert max_diff(_no_keys(ref_model), _no_keys(model)) <= TOL
  assert int(model.rngs.dropout.count[...]) == 2 * M * 2


def test_state_read_and_updated_in_different_stages_is_an_error():
  """A stage reading state another stage updates could not see the previous micro-batch's
  value in time; the runner refuses it by name."""
  from types import SimpleNamespace as NS

  from gpp_jax.runtime.loss_state import StatePair, state_carries

  staged = NS(
    stages=[
      NS(index=0, inputs=[NS(kind="data", index=3)]),
      NS(index=1, inputs=[NS(kind="data", index=3)]),
    ],
    loss_outputs=[(1, 0), (1, 1)],
  )
  assert state_carries(staged, [StatePair(None, 1, "bn/mean")]) == {}
  with pytest.raises(PlanError, match=r"bn/mean is updated in stage 1 but also read by stage"):
    state_carries(staged, [StatePair(3, 1, "bn/mean")])


def test_rngs_outside_the_module_is_an_error():
  class Plain(nnx.Module):
    def __init__(self, rngs):
      self.a = nnx.Linear(5, 3, rngs=rngs)
      self.drop = nnx.Dropout(0.2)

    def __call__(self, x, rngs):
      return self.drop(self.a(x), rngs=rngs)

  def step(model, optimizer, rngs, batch):
    loss, grads = gpp_jax.value_and_grad(
      lambda m: jnp.mean((m(batch["x"], rngs) - batch["y"]) ** 2)
    )(model)
    optimizer.update(model, grads)
    return loss

  model = Plain(nnx.Rngs(0))
  opt = nnx.Optimizer(model, optax.sgd(1e-2), wrt=nnx.Param)
  rngs = nnx.Rngs(dropout=3)
  before = jax.tree.map(np.array, _no_keys(model))
  pp = gpp_jax.graph_pipeline(step, num_microbatches=M, devices=jax.devices()[:2])
  with pytest.raises(CaptureError, match=r"not part of the differentiated module"):
    pp(model, opt, rngs, _batch(3))
  assert max_diff(before, _no_keys(model)) == 0.0
  assert int(rngs.dropout.count[...]) == 0


class ScannedBNBlock(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    h = nn.BatchNorm(use_running_average=False)(nn.Dense(8, use_bias=False)(x))
    return x + nn.relu(h), None


class ScannedBN(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(8, name="inp")(x)
    Layers = nn.scan(
      ScannedBNBlock,
      variable_axes={"params": 0, "batch_stats": 0},
      split_rngs={"params": True},
      length=4,
    )
    x, _ = Layers(name="layers")(x, None)
    return nn.Dense(3, name="head")(x)


def test_batch_stats_stacked_along_a_cut_scan_match_accumulation():
  """Batch statistics stacked along nn.scan are sliced per layer like the parameters."""
  model = ScannedBN()
  variables = model.init(jax.random.key(0), jnp.ones((2, 5)))

  def fresh():
    return BNState.create(
      apply_fn=model.apply,
      params=variables["params"],
      batch_stats=variables["batch_stats"],
      tx=optax.adam(1e-2),
    )

  plan = gpp_jax.manual_plan(
    {
      "ScannedBN/inp": 0,
      **{f"ScannedBN/layers/{i}": int(i >= 2) for i in range(4)},
      "ScannedBN/head": 1,
    }
  )
  pp = gpp_jax.graph_pipeline(
    linen_step, num_microbatches=M, devices=jax.devices()[:2], planner=plan, layer_depth=3
  )
  batch = _batch(4)
  dev0 = jax.devices()[0]
  ref, state = jax.device_put(fresh(), dev0), fresh()
  with jax.transfer_guard("disallow"):
    for _ in range(2):
      ref, rm = linen_reference(ref, jax.device_put(batch, dev0))
      state, pm = pp(state, batch)
  assert abs(float(rm["loss"]) - float(pm["loss"])) <= TOL
  assert max_diff(ref.params, state.params) <= TOL
  assert max_diff(ref.batch_stats, state.batch_stats) <= TOL
  assert state.batch_stats["layers"]["BatchNorm_0"]["mean"].shape == (4, 8)


class ScannedDropoutNet(nnx.Module):
  """Blocks stacked with nnx.vmap and run with nnx.scan, each with its own dropout stream."""

  def __init__(self, rngs):
    self.inp = nnx.Linear(5, 8, rngs=rngs)

    @nnx.split_rngs(splits=4)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def blocks(rngs):
      return ScannedDropoutBlock(rngs)

    self.blocks = blocks(rngs)
    self.head = nnx.Linear(8, 3, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(h, block):
      return block(h)

    return self.head(body(self.inp(x), self.blocks))


class ScannedDropoutBlock(nnx.Module):
  def __init__(self, rngs):
    self.fc = nnx.Linear(8, 8, rngs=rngs)
    self.drop = nnx.Dropout(0.2, rngs=rngs)

  def __call__(self, x):
    return x + self.drop(jnp.tanh(self.fc(x)))


def test_dropout_streams_stacked_along_a_cut_nnx_scan_match_accumulation():
  def fresh():
    model = ScannedDropoutNet(nnx.Rngs(0, dropout=1))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  ref_model, ref_opt = fresh()
  model, opt = fresh()
  rules = {"inp": 0, **{f"blocks/fc/{i}": int(i >= 2) for i in range(4)}, "head": 1}
  pp = gpp_jax.graph_pipeline(
    nnx_step,
    num_microbatches=M,
    devices=jax.devices()[:2],
    planner=gpp_jax.manual_plan(rules),
  )
  batch = _batch(5)
  for _ in range(2):
    lr = nnx_reference(ref_model, ref_opt, batch)
    lp = pp(model, opt, batch)
  assert abs(float(lr) - float(lp)) <= TOL
  assert max_diff(_no_keys(ref_model), _no_keys(model)) <= TOL
  # Every scanned block's stream drew once per micro-batch and step.
  assert model.blocks.drop.rngs.count[...].tolist() == [2 * M] * 4
