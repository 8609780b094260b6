"""Manual plans over tied embeddings: a ``#k`` use of a module (the output head that reads the
embedding again, ``embed.attend``) whose module's rule would close a stage cycle joins the stage
of its inputs, a rule naming the use still wins, and rules naming layers of an earlier
layering (``#k`` uses that are now part of their module, einsum specs) say so."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from harness import compare_steps, max_diff

import gpp_jax
from gpp_jax.errors import PlanError
from gpp_jax.ir import layer_graph as lg

TOL = 1e-5
V, D = 16, 8


def _tokens(seed=0, n=8):
  rng = np.random.default_rng(seed)
  return {
    "x": rng.integers(0, V, (n, 5)).astype(np.int32),
    "y": rng.integers(0, V, (n, 4)).astype(np.int32),
  }


# Flax's WMT Transformer, tiny: the root module creates the embedding and hands it to the
# encoder (embeds the inputs) and the decoder (embeds the targets, and its ``attend`` gives
# the logits after the decoder's last norm).
class Encoder(nn.Module):
  shared_embedding: nn.Module

  @nn.compact
  def __call__(self, x):
    h = self.shared_embedding(x)
    h = h + nn.Dense(D, name="encoderblock_0")(jnp.tanh(h))
    return nn.LayerNorm(name="encoder_norm")(h)


class Decoder(nn.Module):
  shared_embedding: nn.Module

  @nn.compact
  def __call__(self, encoded, y):
    h = self.shared_embedding(y) + encoded.mean(axis=1, keepdims=True)
    h = h + nn.Dense(D, name="encoderdecoderblock_0")(jnp.tanh(h))
    h = nn.LayerNorm(name="encoderdecoder_norm")(h)
    return self.shared_embedding.attend(h) / jnp.sqrt(D)


class Transformer(nn.Module):
  def setup(self):
    self.shared_embedding = nn.Embed(V, D, embedding_init=nn.initializers.normal(1.0))
    self.encoder = Encoder(self.shared_embedding)
    self.decoder = Decoder(self.shared_embedding)

  def encode(self, x):
    return self.encoder(x)

  def decode(self, encoded, y):
    return self.decoder(encoded, y)

  def __call__(self, x, y):
    return self.decode(self.encode(x), y)


def _linen_step(model, tx):
  def step(params, opt_state, batch):
    def loss_fn(p):
      logits = model.apply({"params": p}, batch["x"], batch["y"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = gpp_jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


@pytest.fixture(scope="module")
def wmt():
  """(step, params, optimizer state, batch) of the tiny WMT Transformer."""
  model, tx, batch = Transformer(), optax.adam(1e-2), _tokens()
  params = model.init(jax.random.key(0), batch["x"][:1], batch["y"][:1])["params"]
  return _linen_step(model, tx), params, tx.init(params), batch


@pytest.fixture(scope="module")
def wmt_graph(wmt):
  step, params, opt_state, batch = wmt
  pp = gpp_jax.graph_pipeline(step, num_microbatches=2, devices=jax.devices()[:2])
  return pp.layer_graph_for(params, opt_state, batch)


def _use(g, module):
  """The one ``#k`` use of ``module`` (by its parameter-tree path) among the layers."""
  (use,) = [l for l in g if g.nodes[l].get("param_path", l).startswith(module + "#")]
  return use


def _owner_and_readers(pp, shape):
  """The stage owning the parameter of ``shape`` and the stages that read it (the owner among
  them; another receives a copy once per step and sends its gradient back)."""
  staged = pp.compiled.staged.staged
  closed = pp.compiled.captured.loss
  (i,) = [
    i
    for i, o in enumerate(staged.param_owner)
    if o >= 0 and closed.jaxpr.invars[i].aval.shape == shape
  ]
  readers = {s.index for s in staged.stages for r in s.inputs if r.kind == "param" and r.index == i}
  return staged.param_owner[i], readers


def test_wmt_tied_embedding_under_the_first_plan(wmt, wmt_graph):
  step, params, opt_state, batch = wmt
  head = _use(wmt_graph, "shared_embedding")
  plan = gpp_jax.manual_plan({"encoder": 0, "decoder": 1})
  # The embedding's module, first called inside the encoder, goes with "encoder" (or its own
  # rule); its ``attend`` use follows the decoder's last norm onto stage 1 instead of closing
  # a cycle.
  for p in (plan, gpp_jax.manual_plan({"shared_embedding": 0, "encoder": 0, "decoder": 1})):
    where = p.resolve(wmt_graph, 2).stage_of_layer()
    assert where[head] == 1
    assert where[head.partition("#")[0]] == 0
  r, p, pp = compare_steps(
    step,
    (params, opt_state),
    batch,
    steps=2,
    num_microbatches=2,
    devices=jax.devices()[:2],
    planner=plan,
  )
  assert pp.plan.num_stages == 2
  assert pp.plan.stage_of_layer()[head] == 1
  # Stage 0 owns the embedding; stage 1 reads it too and sends its gradient back.
  assert _owner_and_readers(pp, (V, D)) == (0, {0, 1})
  assert p[0]["shared_embedding"]["embedding"].devices() == {jax.devices()[0]}
  assert max_diff(r[:2], p[:2]) <= TOL
  assert abs(float(r[2]) - float(p[2])) <= TOL


# Gemma, tiny: an ``embedder`` module encodes the tokens at the start and decodes the final
# norm's output into logits with the transposed embedding.
class Embedder(nnx.Module):
  def __init__(self, rngs):
    self.input_embedding = nnx.Param(jax.random.normal(rngs.params(), (V, D)))

  def encode(self, x):
    return self.input_embedding[...][(x,)] * jnp.sqrt(D)

  def decode(self, x):
    return jnp.dot(x, self.input_embedding[...].T)


class Block(nnx.Module):
  def __init__(self, rngs):
    self.mlp = nnx.Linear(D, D, rngs=rngs)

  def __call__(self, x):
    return x + self.mlp(jnp.tanh(x))


class Gemma(nnx.Module):
  def __init__(self, rngs):
    self.embedder = Embedder(rngs)
    self.layers = nnx.List([Block(rngs), Block(rngs)])
    self.final_norm = nnx.RMSNorm(D, rngs=rngs)

  def __call__(self, tokens):
    x = self.embedder.encode(tokens)
    for layer in self.layers:
      x = layer(x)
    return self.embedder.decode(self.final_norm(x))


def _gemma_loss(model, batch):
  logits = model(batch["x"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["x"]).mean()


def _gemma_step(model, optimizer, batch):
  loss, grads = gpp_jax.value_and_grad(_gemma_loss)(model, batch)
  optimizer.update(model, grads)
  return loss


@nnx.jit
def _gemma_ref_step(model, optimizer, batch):
  loss, grads = nnx.value_and_grad(_gemma_loss)(model, batch)
  optimizer.update(model, grads)
  return loss


def test_gemma_embedder_at_both_ends_nnx():
  def fresh():
    m = Gemma(nnx.Rngs(0))
    return m, nnx.Optimizer(m, optax.adam(1e-2), wrt=nnx.Param)

  ref_model, ref_opt = fresh()
  for obj in (ref_model, ref_opt):
    nnx.update(obj, jax.device_put(nnx.state(obj), jax.devices()[0]))
  model, opt = fresh()
  # The final norm goes with the last stage, whichever layer holds it (its scale is read
  # through a reshape, which joins the layer that consumes it: here the decode).
  plan = gpp_jax.manual_plan({"embedder": 0, "layers/0": 0, "layers/1": 1}, default_stage=1)
  pp = gpp_jax.graph_pipeline(
    _gemma_step, num_microbatches=2, devices=jax.devices()[:2], planner=plan
  )
  batch = {"x": _tokens(1)["x"]}
  dbatch = jax.device_put(batch, jax.devices()[0])
  with jax.transfer_guard("disallow"):
    for _ in range(2):
      lr = _gemma_ref_step(ref_model, ref_opt, dbatch)
      lp = pp(model, opt, batch)
  # NNX names layers by parameter path: the decode use is the embedder's second use.
  assert "embedder#2" in pp.layer_graph
  assert pp.plan.stage_of_layer()["embedder#2"] == 1
  assert pp.plan.stage_of_layer()["embedder"] == 0
  assert _owner_and_readers(pp, (V, D)) == (0, {0, 1})
  assert abs(float(lr) - float(lp)) <= TOL
  assert max_diff(nnx.state(ref_model, nnx.Param), nnx.state(model, nnx.Param)) <= TOL
  assert max_diff(nnx.state(ref_opt), nnx.state(opt)) <= TOL


def test_a_rule_naming_the_use_wins(wmt_graph):
  head = _use(wmt_graph, "shared_embedding")  # params/shared_embedding#2
  rules = {"encoder": 0, "decoder": 1}
  for name in ("shared_embedding#2", "params/shared_embedding#2", head):
    where = gpp_jax.manual_plan({**rules, name: 2}).resolve(wmt_graph, 2).stage_of_layer()
    assert where[head] == 2
  # Even where it closes the cycle the module's rule would: the plan error names it.
  with pytest.raises(PlanError, match=r"stage 0 is not convex.*encoderdecoder_norm -> "):
    gpp_jax.manual_plan({**rules, "shared_embedding#2": 0}).resolve(wmt_graph, 2)
  # A longer rule naming the module only does not name the use.
  long = head.partition("#")[0]
  where = gpp_jax.manual_plan({**rules, long: 0}).resolve(wmt_graph, 2).stage_of_layer()
  assert where[head] == 1


def _graph(edges, param_paths=None, free=()):
  g = lg.new_layer_graph("g", 4)
  for n in dict.fromkeys(x for e in edges for x in e):
    lg.add_layer(g, n, free=n in free)
    if param_paths and n in param_paths:
      g.nodes[n]["param_path"] = param_paths[n]
  for u, v in edges:
    lg.add_edge(g, u, v, 4)
  return g


def test_a_use_joins_the_latest_stage_of_its_inputs():
  # The head reads two stages (a skip from stage 0, the trunk's stage 2): it joins stage 2.
  g = _graph([("embed", "a"), ("a", "b"), ("b", "c"), ("a", "embed#2"), ("c", "embed#2")])
  rules = {"embed": 0, "a": 0, "b": 1, "c": 2}
  assert gpp_jax.manual_plan(rules).resolve(g, 2).stage_of_layer()["embed#2"] == 2
  # The default stage places a use no rule names the same way.
  where = gpp_jax.manual_plan({"a": 0, "b": 1, "c": 2}, default_stage=0).resolve(g, 2)
  assert where.stage_of_layer()["embed#2"] == 2
  # A layer that reads no parameter between the trunk and the head does not hide the cycle.
  g = _graph([("embed", "a"), ("a", "loss"), ("loss", "embed#2")], free={"loss"})
  where = gpp_jax.manual_plan({"embed": 0, "a": 1}).resolve(g, 2).stage_of_layer()
  assert where["embed#2"] == 1 and where["loss"] == 1


def test_stale_rules_say_their_layer_is_now_part_of_its_module():
  g = _graph(
    [("ResNet/conv_init", "ResNet/block"), ("ResNet/block", "ResNet/head")],
    {"ResNet/conv_init": "conv_init", "ResNet/block": "block", "ResNet/head": "head"},
  )
  rules = {"ResNet/conv_init": 0, "ResNet/block": 1, "ResNet/head": 1}
  msg = r"rules \['ResNet/conv_init#2'\] match no layer.*#2 use of module 'ResNet/conv_init'"
  with pytest.raises(PlanError, match=msg + r".*the rule can go"):
    gpp_jax.manual_plan({**rules, "ResNet/conv_init#2": 1}).resolve(g, 2)
  spec = "ResNet/block/BTD,DH->BTH"
  msg = rf"match no layer.*{re.escape(spec)!s}.*part of the layer of its module 'ResNet/block'"
  with pytest.raises(PlanError, match=msg + r".*the rule can go"):
    gpp_jax.manual_plan({**rules, spec: 1}).resolve(g, 2)
  with pytest.raises(PlanError, match=r"'BTD,DH->BTH'.*named by module path"):
    gpp_jax.manual_plan({**rules, "BTD,DH->BTH": 1}).resolve(g, 2)
  # A rule for a module the model lacks is only that.
  with pytest.raises(PlanError, match=r"rules \['decoder#2'\] match no layer") as err:
    gpp_jax.manual_plan({**rules, "decoder#2": 1}).resolve(g, 2)
  assert "can go" not in str(err.value)
