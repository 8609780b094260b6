"""Flax models named as their users see them: loss terms over early modules, weight penalties,
einsum layers, Linen parameter-tree paths and BatchNorm's axis_name, each planned as a user
writes the plan first and equal to the undecorated step on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from flax.training import train_state
from harness import dense

import gpp_jax
from gpp_jax.errors import PlanError

RTOL = 1e-5


def _batch(seed=0, n=8, d=6):
  return {"x": np.random.default_rng(seed).normal(size=(n, d)).astype(np.float32)}


def _close(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=RTOL, atol=1e-6)


def _compare_nnx(make_step, fresh, plan, steps=2, num_microbatches=2):
  """The step with nnx.value_and_grad on one device, and with gpp_jax.value_and_grad
  pipelined over two devices; returns the pipeline after comparing losses and states."""
  ref_model, ref_opt = fresh()
  # Committed to the device where the jitted step leaves them: one compile, not two.
  for obj in (ref_model, ref_opt):
    nnx.update(obj, jax.device_put(nnx.state(obj), jax.devices()[0]))
  ref = nnx.jit(make_step(nnx.value_and_grad))
  model, opt = fresh()
  pp = gpp_jax.graph_pipeline(
    make_step(gpp_jax.value_and_grad),
    num_microbatches=num_microbatches,
    devices=jax.devices()[:2],
    planner=plan,
  )
  for i in range(steps):
    batch = _batch(i)
    lr = ref(ref_model, ref_opt, jax.device_put(batch, jax.devices()[0]))
    lp = pp(model, opt, batch)
    np.testing.assert_allclose(float(lp), float(lr), rtol=RTOL)
  _close(nnx.state(ref_model, nnx.Param), nnx.state(model, nnx.Param))
  _close(nnx.state(ref_opt), nnx.state(opt))
  return pp


class Encoder(nnx.Module):
  def __init__(self, rngs):
    self.hidden = nnx.Linear(6, 8, rngs=rngs)
    self.linear_mean = nnx.Linear(8, 3, rngs=rngs)
    self.linear_std = nnx.Linear(8, 3, rngs=rngs)

  def __call__(self, x):
    h = jax.nn.relu(self.hidden(x))
    return self.linear_mean(h), self.linear_std(h)


class Decoder(nnx.Module):
  def __init__(self, rngs):
    self.hidden = nnx.Linear(3, 8, rngs=rngs)
    self.out = nnx.Linear(8, 6, rngs=rngs)

  def __call__(self, z):
    return self.out(jax.nn.relu(self.hidden(z)))


class VAE(nnx.Module):
  def __init__(self, rngs):
    self.encoder = Encoder(rngs)
    self.decoder = Decoder(rngs)

  def __call__(self, x, eps):
    mean, logstd = self.encoder(x)
    return self.decoder(mean + jnp.exp(logstd) * eps), mean, logstd


def _vae_step(value_and_grad):
  def step(model, opt, batch):
    def loss_fn(model):
      eps = 0.1 * jnp.cos(batch["x"][:, :3])
      logits, mean, logstd = model(batch["x"], eps)
      rec = jnp.mean((logits - batch["x"]) ** 2)
      kl = jnp.mean(jnp.sum(mean**2 + jnp.exp(2 * logstd) - 2 * logstd - 1, axis=-1))
      return rec + 0.1 * kl

    loss, grads = value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss

  return step


def test_vae_kl_term_goes_with_the_encoder_plan():
  def fresh():
    m = VAE(nnx.Rngs(0))
    return m, nnx.Optimizer(m, optax.adam(1e-2), wrt=nnx.Param)

  plan = gpp_jax.manual_plan({"encoder": 0, "decoder": 1})
  pp = _compare_nnx(_vae_step, fresh, plan)
  assert not any("#" in l for l in pp.layer_graph)
  assert pp.plan.edges == ((0, 1),)


class AutoEncoder(nnx.Module):
  def __init__(self, rngs):
    self.encoder = nnx.Linear(6, 8, rngs=rngs)
    self.decoder = nnx.Linear(8, 6, rngs=rngs)

  def __call__(self, x):
    return self.decoder(jnp.tanh(self.encoder(x)))


def _penalty_step(value_and_grad):
  """A weight penalty over every parameter, and a loss over an encoder output and the
  decoder's output."""

  def step(model, opt, batch):
    def loss_fn(model):
      code = jnp.tanh(model.encoder(batch["x"]))
      y = model.decoder(code)
      penalty = sum(jnp.sum(p**2) for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
      agree = jnp.mean((code[:, :6] - y) ** 2)
      return jnp.mean((y - batch["x"]) ** 2) + 0.1 * agree + 1e-3 * penalty

    loss, grads = value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss

  return step


def test_weight_penalty_over_all_parameters():
  def fresh():
    m = AutoEncoder(nnx.Rngs(1))
    return m, nnx.Optimizer(m, optax.adamw(1e-2), wrt=nnx.Param)

  pp = _compare_nnx(_penalty_step, fresh, gpp_jax.manual_plan({"encoder": 0, "decoder": 1}))
  assert set(pp.layer_graph) == {"encoder", "decoder"}


class EinsumNet(nnx.Module):
  def __init__(self, rngs):
    self.encoder = nnx.Einsum("bi,io->bo", (6, 8), (8,), rngs=rngs)
    self.heads = nnx.Einsum("bd,ndh->bnh", (4, 8, 2), (4, 2), rngs=rngs)
    self.decoder = nnx.Einsum("bi,io->bo", (8, 6), (6,), rngs=rngs)

  def __call__(self, x):
    h = jnp.tanh(self.encoder(x))
    h = h + jnp.tanh(self.heads(h)).reshape(h.shape)
    return self.decoder(h)


def _mse_step(value_and_grad):
  def step(model, opt, batch):
    def loss_fn(model):
      return jnp.mean((model(batch["x"]) - batch["x"]) ** 2)

    loss, grads = value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss

  return step


def test_einsum_layers_named_by_module_path():
  def fresh():
    m = EinsumNet(nnx.Rngs(2))
    return m, nnx.Optimizer(m, optax.adam(1e-2), wrt=nnx.Param)

  plan = gpp_jax.manual_plan({"encoder": 0, "heads": 0, "decoder": 1})
  pp = _compare_nnx(_mse_step, fresh, plan)
  assert set(pp.layer_graph) == {"encoder", "heads", "decoder"}


class LinenEncoder(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.tanh(nn.Dense(8)(x))


class LinenDecoder(nn.Module):
  @nn.compact
  def __call__(self, h):
    return nn.Dense(6)(nn.tanh(nn.Dense(8)(h)))


class Transformer(nn.Module):
  """Shaped like the Flax WMT example: encode() and decode() methods over submodules."""

  def setup(self):
    self.encoder = LinenEncoder()
    self.decoder = LinenDecoder()

  def encode(self, x):
    return self.encoder(x)

  def decode(self, h):
    return self.decoder(h)

  def __call__(self, x):
    return self.decode(self.encode(x))


def _linen_step(value_and_grad):
  def step(state, batch):
    def loss_fn(params):
      return jnp.mean((state.apply_fn({"params": params}, batch["x"]) - batch["x"]) ** 2)

    loss, grads = value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}

  return step


def test_linen_plan_from_the_parameter_tree():
  model = Transformer()
  params = model.init(jax.random.key(0), jnp.ones((1, 6)))["params"]
  state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))
  rules = {k: s for s, k in enumerate(params.keys())}  # the plan written from params.keys()
  assert rules == {"encoder": 0, "decoder": 1}
  pp = gpp_jax.graph_pipeline(
    _linen_step(gpp_jax.value_and_grad),
    num_microbatches=2,
    devices=jax.devices()[:2],
    planner=gpp_jax.manual_plan(rules),
  )
  ref = jax.jit(_linen_step(jax.value_and_grad))
  r_state, p_state = jax.device_put(state, jax.devices()[0]), state
  for i in range(2):
    batch = _batch(i)
    r_state, r_m = ref(r_state, jax.device_put(batch, jax.devices()[0]))
    p_state, p_m = pp(p_state, batch)
    np.testing.assert_allclose(float(p_m["loss"]), float(r_m["loss"]), rtol=RTOL)
  _close(r_state.params, p_state.params)
  _close(r_state.opt_state, p_state.opt_state)
  where = pp.plan.stage_of_layer()
  assert where["Transformer/Transformer.encode/encoder/Dense_0"] == 0
  assert pp.layer_graph.nodes["Transformer/Transformer.decode/decoder/Dense_1"]["param_path"] == (
    "decoder/Dense_1"
  )
  assert "(params/decoder/Dense_1)" in pp.explain()
  # A rule may also carry the collection's name, as the variables dict spells it.
  plan = gpp_jax.manual_plan({"params/encoder": 0, "params/decoder": 1})
  assert plan.resolve(pp.layer_graph, 2).stage_of_layer() == where


class LinenBN(nn.Module):
  """The Flax ImageNet example's BatchNorm, with its axis name a field: 'batch' under
  pmap/shard_map, None under gpp_jax (data parallelism inside a stage is by sharding, so the
  statistics already cover the whole micro-batch) and under plain jit."""

  axis_name: str | None = "batch"

  @nn.compact
  def __call__(self, x, train: bool = True):
    h = nn.Dense(8, name="stem")(x)
    h = nn.BatchNorm(
      use_running_average=not train, momentum=0.9, axis_name=self.axis_name, name="bn"
    )(h)
    return nn.Dense(6, name="head")(nn.relu(h))


class BNState(train_state.TrainState):
  batch_stats: dict


def _bn_step(value_and_grad):
  def step(state, batch):
    def loss_fn(params):
      y, updates = state.apply_fn(
        {"params": params, "batch_stats": state.batch_stats}, batch["x"], mutable=["batch_stats"]
      )
      return jnp.mean((y - batch["x"]) ** 2), updates

    (loss, updates), grads = value_and_grad(loss_fn, has_aux=True)(state.params)
    state = state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"])
    return state, {"loss": loss}

  return step


def test_batchnorm_axis_name_none_under_gpp_jax():
  x = jnp.ones((2, 6))
  v = LinenBN().init(jax.random.key(0), x)
  with pytest.raises(NameError, match="unbound axis name: batch"):
    LinenBN().apply(v, x, mutable=["batch_stats"])  # 'batch' needs pmap or shard_map to bind
  model = LinenBN(axis_name=None)
  state = BNState.create(
    apply_fn=model.apply, params=v["params"], batch_stats=v["batch_stats"], tx=optax.adam(1e-2)
  )
  pp = gpp_jax.graph_pipeline(
    _bn_step(gpp_jax.value_and_grad),
    num_microbatches=1,  # one micro-batch: statistics over the whole batch, as the plain step
    devices=jax.devices()[:2],
    planner=gpp_jax.manual_plan({"stem": 0, "bn": 0, "head": 1}),
  )
  ref = jax.jit(_bn_step(jax.value_and_grad))
  r_state, p_state = jax.device_put(state, jax.devices()[0]), state
  for i in range(2):
    batch = _batch(i)
    r_state, r_m = ref(r_state, jax.device_put(batch, jax.devices()[0]))
    p_state, p_m = pp(p_state, batch)
    np.testing.assert_allclose(float(p_m["loss"]), float(r_m["loss"]), rtol=RTOL)
  _close(r_state.params, p_state.params)
  _close(r_state.batch_stats, p_state.batch_stats)
  assert pp.plan.num_stages == 2


def tied_model(p, tokens):
  h = p["embed"][tokens].mean(axis=1)
  h = jnp.tanh(h @ p["mid"]["w"] + p["mid"]["b"])
  return h @ p["embed"].T


def _tied_graph():
  ks = jax.random.split(jax.random.key(4), 2)
  params = {"embed": jax.random.normal(ks[0], (11, 6)), "mid": dense(ks[1], 6, 6)}

  def step(params, batch):
    def loss_fn(p):
      logits = tied_model(p, batch["x"])
      return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][:, None], 1))

    loss, grads = gpp_jax.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda a, g: a - 0.1 * g, params, grads), loss

  rng = np.random.default_rng(4)
  batch = {"x": rng.integers(0, 11, (8, 3)), "y": rng.integers(0, 11, (8,))}
  pp = gpp_jax.graph_pipeline(step, num_microbatches=2, devices=jax.devices()[:3])
  return pp.layer_graph_for(params, batch)


def test_sibling_layers_follow_their_module_rule_and_cycles_name_layers():
  g = _tied_graph()
  assert set(g) == {"embed", "mid", "embed#2"}  # the tied head reads the embedding again
  plan = gpp_jax.manual_plan({"embed": 0, "mid": 1, "embed#2": 2}).resolve(g, 2)
  assert plan.stage_of_layer()["embed#2"] == 2
  where = gpp_jax.manual_plan({"embed": 0, "mid": 1}).resolve(g, 2).stage_of_layer()
  assert where["embed#2"] == 1  # the module's rule would close a cycle: the use joins its input
  with pytest.raises(PlanError, match=r"mid -> embed#2 \(1 -> 0\)"):
    gpp_jax.manual_plan({"embed": 0, "mid": 1, "embed#2": 0}).resolve(g, 2)
