"""Scans over stacked layers (Linen nn.scan, nnx.scan, jax.lax.scan) split into layers."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import nnx
from flax.training import train_state
from harness import compare_steps, max_diff

import gpp_jax
from gpp_jax.ir.program import Op

TOL = 1e-5
D, T, NL, V = 8, 4, 6, 11  # width, sequence length, layers, vocabulary


def _tokens(seed=0, n=8):
  rng = np.random.default_rng(seed)
  return {
    "x": rng.integers(0, V, size=(n, T)).astype(np.int32),
    "y": rng.integers(0, V, size=(n, T)).astype(np.int32),
  }


def _xent(logits, y):
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _scanned_stages(plan, pattern):
  """Stages holding layers of the scan (layer names matching ``pattern`` with an index)."""
  return {s.index for s in plan.stages for l in s.layers if re.search(pattern, l)}


# ---------------------------------------------------------------------------------- Linen


class LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    h = nn.LayerNorm(name="ln1")(x)
    q, k, v = (nn.Dense(D, use_bias=False, name=n)(h) for n in ("q", "k", "v"))
    att = jax.nn.softmax(jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(D), axis=-1)
    x = x + nn.Dense(D, name="o")(jnp.einsum("bts,bsd->btd", att, v))
    h = nn.LayerNorm(name="ln2")(x)
    return x + nn.Dense(D, name="down")(jax.nn.gelu(nn.Dense(2 * D, name="up")(h))), None


class LinenTransformer(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(V, D, name="embed")(tokens)
    Layers = nn.scan(
      LinenBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=NL
    )
    x, _ = Layers(name="layers")(x, None)
    return nn.Dense(V, name="head")(nn.LayerNorm(name="ln_f")(x))


def linen_step(state, batch):
  def loss_fn(params):
    return _xent(state.apply_fn(params, batch["x"]), batch["y"])

  loss, grads = gpp_jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {"loss": loss}


def test_linen_nn_scan_is_cut_between_layers():
  model = LinenTransformer()
  params = model.init(jax.random.key(0), jnp.zeros((2, T), jnp.int32))
  assert params["params"]["layers"]["q"]["kernel"].shape == (NL, D, D)
  state = train_state.TrainState.create(
    apply_fn=model.apply,
    params=params,
    tx=optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
  )
  r, p, pp = compare_steps(
    linen_step,
    (state,),
    _tokens(0),
    num_microbatches=2,
    devices=jax.devices()[:2],
    planner="balanced",
    layer_depth=3,
  )
  # One layer per scan iteration (sub-modules merged by layer_depth); the plan puts them on
  # several stages.
  assert "LinenTransformer/layers/5" in pp.layer_graph.nodes
  assert len(_scanned_stages(pp.plan, r"/layers/\d+$")) > 1
  assert abs(float(r[1]["loss"]) - float(p[1]["loss"])) <= TOL
  assert max_diff(r[0].params, p[0].params) <= TOL
  assert max_diff(r[0].opt_state, p[0].opt_state) <= TOL
  # The stacked parameters come back stacked.
  assert p[0].params["params"]["layers"]["q"]["kernel"].shape == (NL, D, D)


# ---------------------------------------------------------------------------------- NNX


class NNXBlock(nnx.Module):
  def __init__(self, rngs):
    self.ln = nnx.LayerNorm(D, rngs=rngs)
    self.qkv = nnx.Linear(D, 3 * D, use_bias=False, rngs=rngs)
    self.up = nnx.Linear(D, 2 * D, rngs=rngs)
    self.down = nnx.Linear(2 * D, D, rngs=rngs)

  def __call__(self, x):
    q, k, v = jnp.split(self.qkv(self.ln(x)), 3, axis=-1)
    att = jax.nn.softmax(jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(D), axis=-1)
    x = x + jnp.einsum("bts,bsd->btd", att, v)
    return x + self.down(jax.nn.gelu(self.up(x)))


class NNXTransformer(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(V, D, rngs=rngs)

    @nnx.split_rngs(splits=NL)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def blocks(rngs):
      return NNXBlock(rngs)

    self.blocks = blocks(rngs)
    self.head = nnx.Linear(D, V, rngs=rngs)

  def __call__(self, tokens):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(x, block):
      return block(x)

    return self.head(body(self.embed(tokens), self.blocks))


def nnx_step(model, optimizer, batch):
  loss, grads = gpp_jax.value_and_grad(lambda m: _xent(m(batch["x"]), batch["y"]))(model)
  optimizer.update(model, grads)
  return loss


def test_nnx_scan_is_cut_between_layers():
  def fresh():
    m = NNXTransformer(nnx.Rngs(0))
    return m, nnx.Optimizer(m, optax.adamw(1e-2), wrt=nnx.Param)

  ref_model, ref_opt = fresh()
  # Committed to the device where the jitted step leaves them: one compile, not two.
  for obj in (ref_model, ref_opt):
    nnx.update(obj, jax.device_put(nnx.state(obj), jax.devices()[0]))
  model, opt = fresh()
  ref = nnx.jit(nnx_step_plain)
  pp = gpp_jax.graph_pipeline(
    nnx_step, num_microbatches=2, devices=jax.devices()[:2], planner="balanced"
  )
  batch = _tokens(1)
  for _ in range(3):
    lr = ref(ref_model, ref_opt, batch)
    lp = pp(model, opt, batch)
  assert "blocks/5" in pp.layer_graph.nodes
  assert len(_scanned_stages(pp.plan, r"^blocks/\d+$")) > 1
  assert abs(float(lr) - float(lp)) <= TOL
  assert max_diff(nnx.state(ref_model), nnx.state(model)) <= TOL
  assert max_diff(nnx.state(ref_opt), nnx.state(opt)) <= TOL
  assert model.blocks.up.kernel[...].shape == (NL, D, 2 * D)


def nnx_step_plain(model, optimizer, batch):
  loss, grads = nnx.value_and_grad(lambda m: _xent(m(batch["x"]), batch["y"]))(model)
  optimizer.update(model, grads)
  return loss


# ---------------------------------------------------------------------------------- lax.scan


def _stacked_params():
  keys = jax.random.split(jax.random.key(0), 3)
  return {
    "inp": jax.random.normal(keys[0], (5, D)) / 3,
    "blocks": {
      "w": jax.random.normal(keys[1], (NL, D, D)) / 3,
      "b": jnp.zeros((NL, D)),
    },
    "out": jax.random.normal(keys[2], (D, 3)) / 3,
  }


def _stacked_model(p, x):
  def layer(h, blk):
    return jnp.tanh(h @ blk["w"] + blk["b"]) + h, jnp.mean(h)

  h, _ = jax.lax.scan(layer, x @ p["inp"], p["blocks"])
  return h @ p["out"]


def _stacked_step(tx):
  def step(params, opt_state, batch):
    loss, grads = gpp_jax.value_and_grad(
      lambda p: jnp.mean((_stacked_model(p, batch["x"]) - batch["y"]) ** 2)
    )(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def _stacked_batch(seed=3):
  rng = np.random.default_rng(seed)
  return {
    "x": rng.normal(size=(8, 5)).astype(np.float32),
    "y": rng.normal(size=(8, 3)).astype(np.float32),
  }


STACKED_PLAN = gpp_jax.manual_plan(
  {"inp": 0, **{f"blocks/{i}": int(i >= 2) for i in range(NL)}, "out": 1}
)


def test_lax_scan_over_stacked_pytree_with_a_manual_cut():
  params = _stacked_params()
  tx = optax.adam(1e-2)
  r, p, pp = compare_steps(
    _stacked_step(tx),
    (params, tx.init(params)),
    _stacked_batch(),
    num_microbatches=2,
    devices=jax.devices()[:2],
    planner=STACKED_PLAN,
  )
  assert sorted(pp.plan.stages[0].layers) == ["blocks/0", "blocks/1", "inp"]
  assert abs(float(r[-1]) - float(p[-1])) <= TOL
  assert max_diff(r[0], p[0]) <= TOL
  assert max_diff(r[1], p[1]) <= TOL


def test_stale_weight_stream_over_a_scan_split_across_stages_equals_calls():
  """2BW's K steps as one program (slices of the stacked weights unstacked on their home,
  sent to their stages, their gradients stacked back) equal K calls of the step."""
  params = _stacked_params()
  tx = optax.adam(1e-2)
  batches = [_stacked_batch(10 + t) for t in range(3)]
  kw = dict(num_microbatches=2, devices=jax.devices()[:2], planner=STACKED_PLAN, schedule="2bw")
  one = gpp_jax.graph_pipeline(_stacked_step(tx), **kw)
  p, o = params, tx.init(params)
  losses = []
  for b in batches:
    p, o, loss = one(p, o, b)
    losses.append(float(loss))
  many = gpp_jax.graph_pipeline(_stacked_step(tx), **kw)
  sp, so, slosses = many.run_steps(params, tx.init(params), batches, stream=True)
  assert many.program.count(Op.UNSTACK) >= 1
  assert any(e.microbatch >= 2 for e in many.timeline.events if e.action == "F")  # one stream
  assert max_diff(p, sp) <= TOL and max_diff(o, so) <= TOL
  assert max(abs(a - float(b)) for a, b in zip(losses, slosses)) <= TOL


def test_split_scans_pass_keeps_values_and_slices_parameters():
  """The pass alone: a reversed scan with a stacked parameter and a scanned-over data input."""
  from jax.extend import core as xc

  from gpp_jax.passes.capture import scope_path
  from gpp_jax.passes.scan_split import split_scans

  def loss(w, b, x, seq):
    def layer(h, inp):
      wi, si = inp
      return jnp.tanh(h @ wi + si) + b, h.sum()

    h, ys = jax.lax.scan(layer, x, (w, seq), reverse=True)
    return jnp.mean(h) + jnp.mean(ys) + jnp.sum(w) * 1e-3  # w is also read whole

  args = (
    jax.random.normal(jax.random.key(1), (3, D, D)),
    jnp.ones((D,)),
    jax.random.normal(jax.random.key(2), (2, D)),
    jax.random.normal(jax.random.key(3), (3, 2, D)),
  )
  closed = jax.make_jaxpr(loss)(*args)
  split, paths, info = split_scans(closed, 2, ["blocks", "b"])
  assert info.parts == ((0, 1, 2), (3,), (4,), (5,))  # parameters, then the data inputs
  assert info.stacked == {0: (0, 1, 2)}
  assert info.out_parts == ((0,),)
  assert paths == ["blocks/0", "blocks/1", "blocks/2", "b"]
  assert [tuple(v.aval.shape) for v in split.jaxpr.invars[:4]] == [(D, D)] * 3 + [(D,)]
  assert not any(e.primitive.name == "scan" for e in split.jaxpr.eqns)
  scopes = {scope_path(e) for e in split.jaxpr.eqns}
  assert {"blocks/0", "blocks/1", "blocks/2"} <= scopes
  w, b, x, seq = args
  got = xc.jaxpr_as_fun(split)(*list(w), b, x, seq)[0]
  assert abs(float(got) - float(loss(*args))) <= 1e-6
