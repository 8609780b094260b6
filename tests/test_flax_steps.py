"""Linen TrainState and NNX steps, dropout, pipelined vs one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from flax.training import train_state
from harness import compare_steps, max_diff

import gpp_jax
from gpp_jax.runtime import cached

TOL = 1e-5


class LinenNet(nn.Module):
  rate: float = 0.0

  @nn.compact
  def __call__(self, x, train: bool = False):
    h = nn.tanh(nn.Dense(16, name="fc1")(x))
    h = nn.Dropout(self.rate, deterministic=not train)(h)
    h = nn.tanh(nn.Dense(16, name="fc2")(h))
    return nn.Dense(3, name="head")(h)


def _batch(seed=0, n=16):
  rng = np.random.default_rng(seed)
  return {
    "x": rng.normal(size=(n, 5)).astype(np.float32),
    "y": rng.normal(size=(n, 3)).astype(np.float32),
  }


def test_linen_trainstate_step():
  model = LinenNet()
  params = model.init(jax.random.key(0), jnp.ones((1, 5)))
  state = train_state.TrainState.create(
    apply_fn=model.apply,
    params=params,
    tx=optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
  )

  def train_step(state, batch):
    def loss_fn(params):
      return jnp.mean((state.apply_fn(params, batch["x"]) - batch["y"]) ** 2)

    loss, grads = gpp_jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}

  plan = gpp_jax.manual_plan({"LinenNet/fc1": 0, "LinenNet/fc2": 1, "LinenNet/head": 2})
  r, p, pp = compare_steps(
    train_step, (state,), _batch(), num_microbatches=4, devices=jax.devices()[:3], planner=plan
  )
  # Linen names the layers by module path from the name stack.
  assert set(pp.layer_graph.nodes) == {"LinenNet/fc1", "LinenNet/fc2", "LinenNet/head"}
  assert int(p[0].step) == 3
  assert max_diff(r[0].params, p[0].params) <= TOL
  assert max_diff(r[0].opt_state, p[0].opt_state) <= TOL
  assert abs(float(r[1]["loss"]) - float(p[1]["loss"])) <= TOL


class NNXNet(nnx.Module):
  def __init__(self, rngs):
    self.enc = nnx.Linear(5, 16, rngs=rngs)
    self.mid = nnx.Linear(16, 16, rngs=rngs)
    self.head = nnx.Linear(16, 3, rngs=rngs)

  def __call__(self, x):
    return self.head(jnp.tanh(self.mid(jnp.tanh(self.enc(x)))))


def nnx_train_step(model, optimizer, batch):
  def loss_fn(model):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

  loss, grads = gpp_jax.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


def test_nnx_step_with_optimizer():
  def fresh():
    m = NNXNet(nnx.Rngs(0))
    return m, nnx.Optimizer(m, optax.adamw(1e-2), wrt=nnx.Param)

  ref_model, ref_opt = fresh()
  # Committed to the device where the jitted step leaves them: one compile, not two.
  for obj in (ref_model, ref_opt):
    nnx.update(obj, jax.device_put(nnx.state(obj), jax.devices()[0]))
  ref_step = nnx.jit(nnx_train_step)
  model, opt = fresh()
  pp = gpp_jax.graph_pipeline(
    nnx_train_step,
    num_microbatches=4,
    devices=jax.devices()[:3],
    planner=gpp_jax.manual_plan({"enc": 0, "mid": 1, "head": 2}),
  )
  batch = _batch(1)
  dbatch = jax.device_put(batch, jax.devices()[0])
  with jax.transfer_guard("disallow"):
    for _ in range(3):
      lr = ref_step(ref_model, ref_opt, dbatch)
      lp = pp(model, opt, batch)
  # NNX adds no names to the name stack: layers come from the parameters' paths.
  assert set(pp.layer_graph.nodes) == {"enc", "mid", "head"}
  assert abs(float(lr) - float(lp)) <= TOL
  assert max_diff(nnx.state(ref_model, nnx.Param), nnx.state(model, nnx.Param)) <= TOL
  assert max_diff(nnx.state(ref_opt), nnx.state(opt)) <= TOL
  assert int(opt.step[...]) == 3
  assert model.head.kernel[...].devices() == {jax.devices()[2]}


@pytest.mark.parametrize("devices", [1, 3])
def test_cached_partial_equals_the_full_call_and_sees_new_values(devices, monkeypatch):
  """``cached_partial(model, opt)`` skips the NNX split/update per call: bit-identical to the
  uncached pipeline over 3 steps (one fused stage and three stages), Variables written in
  place, values assigned between calls read, and other batch shapes taking the full path."""

  def fresh():
    m = NNXNet(nnx.Rngs(0))
    return m, nnx.Optimizer(m, optax.adamw(1e-2), wrt=nnx.Param)

  kw = dict(num_microbatches=4 if devices > 1 else 1, devices=jax.devices()[:devices])
  if devices > 1:
    kw["planner"] = gpp_jax.manual_plan({"enc": 0, "mid": 1, "head": 2})
  (m1, o1), (m2, o2) = fresh(), fresh()
  traversals = []
  real = cached.functionalize
  monkeypatch.setattr(cached, "functionalize", lambda *a: traversals.append(1) or real(*a))
  full = gpp_jax.graph_pipeline(nnx_train_step, **kw)
  fast = gpp_jax.graph_pipeline(nnx_train_step, **kw).cached_partial(m2, o2)
  kernel = m2.head.kernel
  for i in range(3):
    batch = _batch(10 + i)
    assert float(full(m1, o1, batch)) == float(fast(batch))
  assert len(traversals) == 1  # the first call only
  assert max_diff(nnx.state((m1, o1)), nnx.state((m2, o2))) == 0.0
  assert m2.head.kernel is kernel and int(o2.step[...]) == 3
  # A value assigned between calls is what the next call reads.
  for m in (m1, m2):
    m.mid.bias[...] = jnp.full((16,), 0.5)
  assert float(full(m1, o1, _batch(20))) == float(fast(_batch(20)))
  # Another batch size: the full path (compiles for the new shape), still the same result.
  assert float(full(m1, o1, _batch(21, n=8))) == float(fast(_batch(21, n=8)))
  assert len(traversals) == 2
  assert max_diff(nnx.state((m1, o1)), nnx.state((m2, o2))) == 0.0
  assert int(o2.step[...]) == 5
  # Replaced by a value of another dtype (written, say, by a restore): the full path again,
  # though every other Variable still holds what the last call wrote.
  for m in (m1, m2):
    m.mid.bias.set_value(jnp.full((16,), 0.25, jnp.bfloat16))
  assert float(full(m1, o1, _batch(22, n=8))) == float(fast(_batch(22, n=8)))
  assert len(traversals) == 3
  assert m2.mid.bias[...].dtype == m1.mid.bias[...].dtype
  assert max_diff(nnx.state((m1, o1)), nnx.state((m2, o2))) == 0.0


def test_plain_pytree_dropout_matches_gradient_accumulation():
  model = LinenNet(rate=0.3)
  params = model.init(jax.random.key(0), jnp.ones((1, 5)))
  tx = optax.adam(1e-2)
  M = 4

  def loss_of(params, x, y, key):
    out = model.apply(params, x, train=True, rngs={"dropout": key})
    return jnp.mean((out - y) ** 2)

  def step(params, opt_state, key, batch):
    loss, grads = gpp_jax.value_and_grad(lambda p: loss_of(p, batch["x"], batch["y"], key))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  @jax.jit
  def reference(params, opt_state, key, batch):
    """The documented reference: gradient accumulation with fold_in(key, micro-batch)."""
    xs = batch["x"].reshape(M, -1, 5)
    ys = batch["y"].reshape(M, -1, 3)
    loss, grads = 0.0, jax.tree.map(jnp.zeros_like, params)
    for m in range(M):
      l, g = jax.value_and_grad(loss_of)(params, xs[m], ys[m], jax.random.fold_in(key, m))
      loss += l / M
      grads = jax.tree.map(lambda a, b: a + b / M, grads, g)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  pp = gpp_jax.graph_pipeline(step, num_microbatches=M, devices=jax.devices()[:2], batch_argnums=3)
  batch = _batch(2)
  dev0 = jax.devices()[0]
  rp, ro = jax.device_put((params, tx.init(params)), dev0)
  pp_p, pp_o = params, tx.init(params)
  keys = [jax.random.key(10 + i) for i in range(3)]
  with jax.transfer_guard("disallow"):
    for key in keys:
      rp, ro, rl = reference(rp, ro, jax.device_put(key, dev0), jax.device_put(batch, dev0))
      pp_p, pp_o, pl = pp(pp_p, pp_o, key, batch)
  assert abs(float(rl) - float(pl)) <= TOL
  assert max_diff(rp, pp_p) <= TOL
  # Dropout really is active: without the fold-in the masks would repeat per micro-batch.
  no_drop = jax.jit(lambda p, b: jnp.mean((model.apply(p, b["x"]) - b["y"]) ** 2))
  assert (
    abs(
      float(no_drop(params, batch))
      - float(loss_of(params, batch["x"], batch["y"], jax.random.key(0)))
    )
    > 1e-3
  )
