"""Stages over the rows of a user's mesh, with the model's own partition specs inside each.

Every layout is checked exact against the plain step on one device (``jax.grad`` + optax),
and each test asserts the shards it expects on the devices it expects.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from flax.training import train_state
from harness import max_diff
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gpp_jax

TOL = 1e-5
D, H, OUT = 8, 16, 4


def _init(spec):
  return nnx.with_partitioning(nnx.initializers.lecun_normal(), spec, eager_sharding=False)


def _bias(spec):
  return nnx.with_partitioning(nnx.initializers.zeros_init(), spec, eager_sharding=False)


class Block(nnx.Module):
  """Megatron's MLP: up column-parallel, down row-parallel (or FSDP over the rows)."""

  def __init__(self, rngs, up=(None, "model"), down=("model", None), up_bias=("model",)):
    self.up = nnx.Linear(D, H, kernel_init=_init(up), bias_init=_bias(up_bias), rngs=rngs)
    self.down = nnx.Linear(H, D, kernel_init=_init(down), rngs=rngs)

  def __call__(self, x):
    return x + self.down(jnp.tanh(self.up(x)))


class Chain(nnx.Module):
  def __init__(self, rngs, **block):
    self.a = Block(rngs, **block)
    self.b = Block(rngs, **block)
    self.c = Block(rngs, **block)
    self.head = nnx.Linear(D, OUT, kernel_init=_init(("data", None)), rngs=rngs)

  def __call__(self, x):
    return self.head(self.c(self.b(self.a(x))))


class Branches(nnx.Module):
  """A DAG: two towers from one input, joined at the head."""

  def __init__(self, rngs):
    self.inp = Block(rngs)
    self.left = Block(rngs)
    self.right = Block(rngs)
    self.head = nnx.Linear(2 * D, OUT, kernel_init=_init(("data", None)), rngs=rngs)

  def __call__(self, x):
    h = self.inp(x)
    return self.head(jnp.concatenate([self.left(h), self.right(h)], axis=-1))


def mse(model, batch):
  return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def nnx_step(model, optimizer, batch):
  loss, grads = gpp_jax.value_and_grad(mse)(model, batch)
  optimizer.update(model, grads)
  return loss


def batch(seed=0, n=16):
  rng = np.random.default_rng(seed)
  return {
    "x": rng.normal(size=(n, D)).astype(np.float32),
    "y": rng.normal(size=(n, OUT)).astype(np.float32),
  }


def run_nnx(make, tx, plan, mesh, steps=2, microbatches=4, ref_make=None, **kw):
  """The same NNX model and optimizer, one copy stepped with ``nnx.jit`` on one device, the
  other pipelined over ``mesh``; returns (reference model, pipelined model, its optimizer,
  the pipeline)."""
  ref_model, model = (ref_make or make)(), make()
  ref_opt = nnx.Optimizer(ref_model, tx, wrt=nnx.Param)
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def ref_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(mse)(model, batch)
    optimizer.update(model, grads)
    return loss

  pp = gpp_jax.graph_pipeline(
    nnx_step, num_microbatches=microbatches, mesh=mesh, planner=plan, **kw
  )
  for t in range(steps):
    b = batch(t)
    ref_loss = ref_step(ref_model, ref_opt, jax.device_put(b, jax.devices()[0]))
    with jax.transfer_guard("disallow"):
      loss = pp(model, opt, b)
    assert abs(float(ref_loss) - float(loss)) <= TOL
  assert max_diff(nnx.state(ref_model, nnx.Param), nnx.state(model, nnx.Param)) <= TOL
  assert max_diff(nnx.state(ref_opt), nnx.state(opt)) <= TOL
  return ref_model, model, opt, pp


def make_chain(**block):
  return lambda: Chain(nnx.Rngs(0), **block)


def shards(x):
  """The shape of each device's shard and the devices holding ``x``."""
  s = x.sharding
  assert isinstance(s, NamedSharding), s
  return s.shard_shape(x.shape), {d.id for d in s.device_set}


def test_pp2_dp2_tp2_nnx():
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  plan = gpp_jax.manual_plan({"a": 0, "b": 0, "c": 1, "head": 1}, devices={0: [0, 1], 1: [2, 3]})
  _, model, opt, pp = run_nnx(make_chain(), optax.adam(1e-2), plan, mesh)
  rows = np.asarray(mesh.devices)
  stage0 = {d.id for d in rows[:2].flat}
  stage1 = {d.id for d in rows[2:].flat}
  # Column-parallel up, row-parallel down: halves over "model" on the stage's 4 devices.
  assert shards(model.a.up.kernel[...]) == ((D, H // 2), stage0)
  assert shards(model.a.up.bias[...]) == ((H // 2,), stage0)
  assert shards(model.a.down.kernel[...]) == ((H // 2, D), stage0)
  assert shards(model.c.down.kernel[...]) == ((H // 2, D), stage1)
  # A spec naming the first axis shards over the stage's rows (FSDP inside the stage).
  assert shards(model.head.kernel[...]) == ((D // 2, OUT), stage1)
  assert model.a.down.bias[...].sharding.spec == P()
  # The optimizer state is sharded like its parameter.
  mu = opt.opt_state[0].mu
  assert shards(mu.a.up.kernel[...]) == ((D, H // 2), stage0)
  assert shards(mu.head.kernel[...]) == ((D // 2, OUT), stage1)
  assert [len(s.devices) for s in pp.plan.stages] == [2, 2]


def test_three_stages_of_1_1_2_rows_tp2_nnx():
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  plan = gpp_jax.manual_plan(
    {"a": 0, "b": 1, "c": 2, "head": 2}, devices={0: [0], 1: [1], 2: [2, 3]}
  )
  _, model, _, _ = run_nnx(make_chain(), optax.sgd(0.1, momentum=0.9), plan, mesh)
  rows = np.asarray(mesh.devices)
  assert shards(model.a.up.kernel[...]) == ((D, H // 2), {d.id for d in rows[0]})
  assert shards(model.b.up.kernel[...]) == ((D, H // 2), {d.id for d in rows[1]})
  assert shards(model.c.up.kernel[...]) == ((D, H // 2), {d.id for d in rows[2:].flat})
  assert shards(model.head.kernel[...])[0] == (D // 2, OUT)


def test_pp2_dp4_fsdp_nnx():
  mesh = jax.make_mesh((8, 1), ("data", "model"))
  fsdp = dict(up=("data", None), down=("data", None), up_bias=(None,))
  plan = gpp_jax.manual_plan(
    {"a": 0, "b": 0, "c": 1, "head": 1}, devices={0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
  )
  _, model, opt, _ = run_nnx(make_chain(**fsdp), optax.adamw(1e-2), plan, mesh)
  first = {d.id for d in np.asarray(mesh.devices)[:4].flat}
  assert shards(model.a.up.kernel[...]) == ((D // 4, H), first)
  assert shards(model.a.down.kernel[...]) == ((H // 4, D), first)
  assert shards(model.head.kernel[...])[0] == (D // 4, OUT)
  assert shards(opt.opt_state[0].nu.a.down.kernel[...]) == ((H // 4, D), first)


def test_dag_with_sharded_stages_nnx():
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  plan = gpp_jax.manual_plan(
    {"inp": 0, "left": 1, "right": 2, "head": 2}, devices={0: [0], 1: [1], 2: [2, 3]}
  )
  _, model, _, pp = run_nnx(lambda: Branches(nnx.Rngs(1)), optax.adam(1e-2), plan, mesh)
  assert sorted(pp.plan.edges) == [(0, 1), (0, 2), (1, 2)]
  assert shards(model.left.up.kernel[...])[0] == (D, H // 2)
  assert shards(model.head.kernel[...])[0] == (2 * D // 2, OUT)


def test_global_norm_clipping_across_sharded_stages_nnx():
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  plan = gpp_jax.manual_plan({"a": 0, "b": 0, "c": 1, "head": 1}, devices={0: [0], 1: [1, 2]})
  tx = optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2))
  _, model, _, _ = run_nnx(make_chain(), tx, plan, mesh)
  assert shards(model.c.up.kernel[...])[0] == (D, H // 2)


class Tied(nnx.Module):
  """A token embedding read at both ends (the output projection is its transpose)."""

  def __init__(self, rngs, vocab=16):
    init = nnx.with_partitioning(
      nnx.initializers.normal(0.5), ("model", None), eager_sharding=False
    )
    self.embed = nnx.Embed(vocab, D, embedding_init=init, rngs=rngs)
    self.block = Block(rngs)

  def __call__(self, tokens):
    return self.embed.attend(self.block(self.embed(tokens)))


def token_loss(model, batch):
  logits = model(batch["x"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def test_tied_parameter_between_differently_sharded_stages_nnx():
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  rng = np.random.default_rng(0)
  b = {"x": rng.integers(0, 16, size=(8, 3)), "y": rng.integers(0, 16, size=(8, 3))}
  tx = optax.adam(1e-2)
  ref_model, model = Tied(nnx.Rngs(0)), Tied(nnx.Rngs(0))
  ref_opt, opt = (
    nnx.Optimizer(ref_model, tx, wrt=nnx.Param),
    nnx.Optimizer(model, tx, wrt=nnx.Param),
  )

  def step(model, optimizer, batch):
    loss, grads = gpp_jax.value_and_grad(token_loss)(model, batch)
    optimizer.update(model, grads)
    return loss

  @nnx.jit
  def ref_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(token_loss)(model, batch)
    optimizer.update(model, grads)
    return loss

  # The embedding lives on stage 0 (one row); its transpose is read by stage 1 (two rows).
  plan = gpp_jax.manual_plan({"embed": 0, "block": 1, "embed#2": 1}, devices={0: [0], 1: [1, 2]})
  pp = gpp_jax.graph_pipeline(step, num_microbatches=2, mesh=mesh, planner=plan)
  for _ in range(2):
    r = ref_step(ref_model, ref_opt, jax.device_put(b, jax.devices()[0]))
    with jax.transfer_guard("disallow"):
      loss = pp(model, opt, b)
    assert abs(float(r) - float(loss)) <= TOL
  assert max_diff(nnx.state(ref_model, nnx.Param), nnx.state(model, nnx.Param)) <= TOL
  row0 = {d.id for d in np.asarray(mesh.devices)[0]}
  assert shards(model.embed.embedding[...]) == ((16 // 2, D), row0)


def test_model_created_under_set_mesh_nnx():
  """A model created under ``jax.set_mesh`` comes sharded over the whole mesh (eager
  sharding); its parameters move to their stages' sub-meshes with the same specs."""
  mesh = jax.make_mesh((4, 2), ("data", "model"))

  def make():
    with jax.set_mesh(mesh):
      return Chain(nnx.Rngs(0))

  with jax.set_mesh(mesh):
    probe = Chain(nnx.Rngs(0))
  assert probe.a.up.kernel[...].sharding.mesh.shape == {"data": 4, "model": 2}
  plan = gpp_jax.manual_plan({"a": 0, "b": 0, "c": 1, "head": 1}, devices={0: [0, 1], 1: [2, 3]})
  _, model, _, _ = run_nnx(make, optax.adam(1e-2), plan, mesh, ref_make=make_chain())
  assert shards(model.a.up.kernel[...]) == (
    (D, H // 2),
    {d.id for d in np.asarray(mesh.devices)[:2].flat},
  )


# ---------------------------------------------------------------------------- Linen


class LinenChain(nn.Module):
  """Two Megatron MLP blocks and a head, annotated with logical names (mapped by RULES) or
  physical ones; ``fsdp`` shards every kernel's first dimension over the rows instead."""

  logical: bool = True
  fsdp: bool = False

  @nn.compact
  def __call__(self, x):
    part = nn.with_logical_partitioning if self.logical else nn.with_partitioning
    col = ("embed", "mlp") if self.logical else (None, "model")
    row = ("mlp", "embed") if self.logical else ("model", None)
    if self.fsdp:
      col = row = ("rows", None) if self.logical else ("data", None)
    init = nn.initializers.lecun_normal()
    for name in ("a", "b"):
      h = nn.Dense(H, kernel_init=part(init, col), name=f"{name}_up")(x)
      x = x + nn.Dense(D, kernel_init=part(init, row), name=f"{name}_down")(jnp.tanh(h))
    return nn.Dense(OUT, name="head")(x)


def linen_steps(loss_of):
  """A TrainState step with ``loss_of(state, params, batch)``: (pipelined, reference)."""

  def steps(value_and_grad):
    def step(state, batch):
      loss, grads = value_and_grad(lambda p: loss_of(state, p, batch))(state.params)
      return state.apply_gradients(grads=grads), loss

    return step

  return steps(gpp_jax.value_and_grad), steps(jax.value_and_grad)


RULES = (("embed", None), ("mlp", "model"), ("rows", "data"))
LINEN_LAYOUTS = {
  # (pp, dp, tp) = (2, 2, 2): two stages of two rows, "model" of 2.
  "pp2-dp2-tp2": ((4, 2), False, {"a": 0, "b": 1, "head": 1}, {0: [0, 1], 1: [2, 3]}),
  # Three stages of 1, 1 and 2 rows, "model" of 2.
  "pp3-rows112-tp2": ((4, 2), False, {"a": 0, "b": 1, "head": 2}, {0: [0], 1: [1], 2: [2, 3]}),
  # (2, 4, 1), FSDP: the kernels sharded over each stage's 4 rows.
  "pp2-dp4-fsdp": ((8, 1), True, {"a": 0, "b": 1, "head": 1}, {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}),
}


@pytest.mark.parametrize("logical", [True, False])
@pytest.mark.parametrize("layout", list(LINEN_LAYOUTS))
def test_linen_layouts(layout, logical):
  mesh_shape, fsdp, stage_of, devices = LINEN_LAYOUTS[layout]
  model = LinenChain(logical, fsdp)
  params = model.init(jax.random.key(0), jnp.ones((1, D)))
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
  state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

  def loss_of(state, params, batch):
    return jnp.mean((state.apply_fn(params, batch["x"]) - batch["y"]) ** 2)

  step, ref_step = linen_steps(loss_of)

  mesh = jax.make_mesh(mesh_shape, ("data", "model"))
  rules = {}
  for prefix, stage in stage_of.items():
    for sub in ("_up", "_down") if prefix != "head" else ("",):
      rules[f"LinenChain/{prefix}{sub}"] = stage
  plan = gpp_jax.manual_plan(rules, devices=devices)
  pp = gpp_jax.graph_pipeline(step, num_microbatches=4, mesh=mesh, planner=plan)
  ref = jax.jit(ref_step)
  r_state, p_state = jax.device_put(state, jax.devices()[0]), state
  with nn.logical_axis_rules(RULES):
    for t in range(2):
      r_state, r_loss = ref(r_state, jax.device_put(batch(t), jax.devices()[0]))
      with jax.transfer_guard("disallow"):
        p_state, p_loss = pp(p_state, batch(t))
      assert abs(float(r_loss) - float(p_loss)) <= TOL
  assert max_diff(r_state.params, p_state.params) <= TOL
  assert max_diff(r_state.opt_state, p_state.opt_state) <= TOL
  got = nn.unbox(p_state.params)["params"]
  rows = np.asarray(mesh.devices)
  b_stage = stage_of["b"]
  b_devices = {d.id for r in devices[b_stage] for d in rows[r]}
  b_rows = len(devices[b_stage])
  if fsdp:
    assert shards(got["b_up"]["kernel"]) == ((D // b_rows, H), b_devices)
    assert shards(got["a_down"]["kernel"])[0] == (H // len(devices[0]), D)
  else:
    assert shards(got["b_up"]["kernel"]) == ((D, H // 2), b_devices)
    assert shards(got["a_down"]["kernel"])[0] == (H // 2, D)
  # The optimizer state (adam's mu, inside the clip's chain) is sharded like its parameter.
  mu = nn.unbox(p_state.opt_state[1][0].mu)["params"]["b_up"]["kernel"]
  assert mu.sharding == got["b_up"]["kernel"].sharding


class LinenBranches(nn.Module):
  """A DAG (two towers from a shared input layer, joined at the head) with a token embedding
  tied to the output projection: the embedding is read by the first and the last stage."""

  @nn.compact
  def __call__(self, tokens):
    part, init = nn.with_partitioning, nn.initializers.lecun_normal()
    embed = nn.Embed(16, D, embedding_init=part(nn.initializers.normal(0.5), ("model", None)))
    h = embed(tokens)
    h = nn.Dense(D, kernel_init=part(init, (None, "model")), name="inp")(h)
    left = nn.Dense(D, kernel_init=part(init, ("model", None)), name="left")(jnp.tanh(h))
    right = nn.Dense(D, kernel_init=part(init, (None, "model")), name="right")(jnp.tanh(h))
    return embed.attend(nn.Dense(D, name="head")(jnp.concatenate([left, right], -1)))


def test_linen_dag_with_a_tied_embedding_over_sharded_stages():
  model = LinenBranches()
  rng = np.random.default_rng(0)
  b = {"x": rng.integers(0, 16, size=(8, 3)), "y": rng.integers(0, 16, size=(8, 3))}
  params = model.init(jax.random.key(0), b["x"][:1])
  tx = optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2))
  state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

  def loss_of(state, params, batch):
    logits = state.apply_fn(params, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  step, ref_step = linen_steps(loss_of)

  mesh = jax.make_mesh((4, 2), ("data", "model"))
  p = "LinenBranches/"
  plan = gpp_jax.manual_plan(
    {p + "Embed_0": 0, p + "inp": 0, p + "left": 1, p + "right": 2, p + "head": 2,
     p + "Embed_0#2": 2},
    devices={0: [0], 1: [1], 2: [2, 3]},
  )  # fmt: skip
  pp = gpp_jax.graph_pipeline(step, num_microbatches=2, mesh=mesh, planner=plan)
  ref = jax.jit(ref_step)
  r_state, p_state = jax.device_put(state, jax.devices()[0]), state
  for _ in range(2):
    r_state, r_loss = ref(r_state, jax.device_put(b, jax.devices()[0]))
    with jax.transfer_guard("disallow"):
      p_state, p_loss = pp(p_state, b)
    assert abs(float(r_loss) - float(p_loss)) <= TOL
  assert max_diff(r_state.params, p_state.params) <= TOL
  assert sorted(pp.plan.edges) == [(0, 1), (0, 2), (1, 2)]
  got = nn.unbox(p_state.params)["params"]
  row0 = {d.id for d in np.asarray(mesh.devices)[0]}
  assert shards(got["Embed_0"]["embedding"]) == ((8, D), row0)
  assert shards(got["right"]["kernel"])[0] == (D, D // 2)


# ---------------------------------------------------------------------------- bad input


def _untouched(model, before):
  return max_diff(before, nnx.state(model, nnx.Param)) == 0.0


@pytest.mark.parametrize(
  "mesh_shape, spec, plan_devices, match",
  [
    ((4, 2), ("data", "tensor"), {0: [0, 1], 1: [2, 3]}, "names the axis 'tensor'"),
    ((2, 4), (None, "model"), {0: [0], 1: [1]}, r"does not divide"),
    ((2, 4), (None, "model"), None, r"2 rows"),
  ],
)
def test_bad_mesh_or_spec_names_the_fix_and_leaves_the_model(mesh_shape, spec, plan_devices, match):
  mesh = jax.make_mesh(mesh_shape, ("data", "model"))

  # H = 16 splits 4 ways, but 6 does not: a layer of width 6 sharded over "model" of 4.
  class Bad(nnx.Module):
    def __init__(self, rngs):
      self.a = nnx.Linear(D, 6, kernel_init=_init(spec), rngs=rngs)
      self.b = nnx.Linear(6, 4, rngs=rngs)
      self.c = nnx.Linear(4, OUT, rngs=rngs)

    def __call__(self, x):
      return self.c(jnp.tanh(self.b(jnp.tanh(self.a(x)))))

  model = Bad(nnx.Rngs(0))
  opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
  rules = {"a": 0, "b": 1} if plan_devices else {"a": 0, "b": 1, "c": 2}
  plan = gpp_jax.manual_plan(rules, devices=plan_devices)
  if plan_devices is None:
    plan = gpp_jax.manual_plan(rules, default_stage=2)
  else:
    plan = gpp_jax.manual_plan(rules, devices=plan_devices, default_stage=1)
  pp = gpp_jax.graph_pipeline(nnx_step, num_microbatches=2, mesh=mesh, planner=plan)
  with pytest.raises(gpp_jax.PlanError, match=match):
    pp(model, opt, batch())
  assert _untouched(model, before)


def test_mesh_and_devices_together_is_refused():
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  with pytest.raises(ValueError, match="devices= or mesh="):
    gpp_jax.graph_pipeline(nnx_step, num_microbatches=2, mesh=mesh, devices=jax.devices())


@pytest.fixture(scope="module")
def pipedream_on_mesh():
  """(the model, the pipeline) after one step of PipeDream's plan over ``"data:4,model:2"``."""
  model = Chain(nnx.Rngs(0))
  opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  pp = gpp_jax.graph_pipeline(
    nnx_step, num_microbatches=4, mesh="data:4,model:2", planner="pipedream"
  )
  pp(model, opt, batch())
  return model, pp


def test_mesh_string_and_candidates_of_jax_sharding(pipedream_on_mesh):
  """``mesh="data:4,model:2"``; the model's specs put "jit sharded" (and "jit fsdp") among
  the candidates a planner's pipeline competes with."""
  model, pp = pipedream_on_mesh
  alts = pp.compiled.planned.alternatives
  assert {"plain jit", "jit data parallel", "jit fsdp", "jit sharded", "pipeline"} <= set(alts)
  assert model.a.up.kernel[...].sharding.spec == P(None, "model")


def test_cost_model_holds_the_models_shards_per_device(pipedream_on_mesh):
  """The planners' memory terms: by the model's specs a stage holds 1/2 of each tensor-parallel
  kernel over "model" and 1/rows of the head (sharded over the rows), FSDP 1/n of all."""
  from gpp_jax.cost.cost_model import memory_terms
  from gpp_jax.ir import layer_graph as lg

  _, pp = pipedream_on_mesh
  planned = pp.compiled.planned
  graph = lg.scaled(planned.layer_graph, 16)
  cluster = gpp_jax.cost.cluster.devices_cluster(pp.devices)

  def held(name):  # parameter bytes per device
    return memory_terms(planned.candidates[name].plan, graph, cluster)[0][0]["parameters"]

  whole = sum(graph.nodes[l]["param_bytes"] for l in graph.nodes)
  replicated = held("jit data parallel")
  assert held("jit fsdp") == pytest.approx(replicated / 4)  # over the 4 rows the planner counts
  # Kernels and up biases halved over "model", the head's kernel quartered over 4 rows.
  block = (D * H + H) / 2 + H * D / 2 + D
  sharded = 4 * (3 * block + D * OUT / 4 + OUT)  # float32
  assert held("jit sharded") == pytest.approx(replicated * sharded / whole)


def test_main_example_pipelines_because_the_one_call_steps_do_not_fit():
  """The README's main example: tiny MMT, batch 64, 8 devices, 310 KiB per device. Plain jit,
  jit data parallel and jit fsdp are modelled over the budget and left out; the pipeline that
  runs fits it on every device as measured after a step (as the training program measures
  it, once the parameters live on their stages)."""
  from gpp_jax.experiments import zoo
  from gpp_jax.runtime.memory import OUTSIDE

  run = zoo.setup("mmt", "tiny")
  b = run.batches(64, 1)[0]
  budget = 310 * 1024
  pp = gpp_jax.graph_pipeline(
    run.train_step,
    num_microbatches=8,
    devices=jax.devices(),
    planner="graphpipe",
    memory_limit=budget,
    layer_depth=run.spec.layer_depth,
  )
  pp(run.model, run.optimizer, b)
  pp.measure_memory(run.model, run.optimizer, b)
  planned = pp.compiled.planned
  assert pp.plan.num_stages >= 2
  for name in ("plain jit", "jit data parallel", "jit fsdp"):
    assert planned.memory[name] > budget and name not in planned.alternatives
  # What the step holds: arrays other tests in this process left alive are not its own.
  held = [d.measured_peak_bytes - d.breakdown.get(OUTSIDE, 0) for d in pp.memory.devices]
  assert max(held) <= budget, held
  assert "left out: over the memory budget" in pp.explain()


def test_cost_model_prices_tensor_parallel_layers_by_their_specs(pipedream_on_mesh):
  """Column-parallel up: 1/2 of its work and its input cotangent all-reduced in the backward;
  row-parallel down: 1/2 and its output all-reduced in the forward (Megatron's f and g)."""
  import dataclasses

  from gpp_jax.cost.cluster import Link
  from gpp_jax.cost.cost_model import plan_costs
  from gpp_jax.ir import layer_graph as lg

  _, pp = pipedream_on_mesh
  planned = pp.compiled.planned
  tp = planned.layer_graph.graph["tensor_parallel"]
  row = 4 * D  # float32 activations of width D, per sample
  assert tp["b/up"] == (2, 0.0, row) and tp["b/down"] == (2, row, 0.0)
  assert tp["a/up"] == (2, 0.0, 0.0)  # the first layer's input is the batch: no cotangent
  assert "head" not in tp  # sharded over the rows only: no tensor parallelism
  graph = lg.scaled(planned.layer_graph, 16)
  cluster = gpp_jax.cost.cluster.devices_cluster(pp.devices)
  free = dataclasses.replace(cluster, intra_link=Link(0.0, 1e30))
  slow = dataclasses.replace(cluster, intra_link=Link(1.0, 1e30))  # a second per collective

  def times(name, c):
    pc = plan_costs(planned.candidates[name].plan, graph, c)
    return pc.forward[0], pc.backward[0]

  (fd, bd), (fs, bs) = times("jit data parallel", free), times("jit sharded", free)
  assert fs < fd and bs < bd  # the split layers' halves
  (fs2, bs2) = times("jit sharded", slow)
  # Three blocks: 3 forward all-reduces (down) and 2 backward ones (b/up, c/up), each a ring
  # over 2 devices: 2 (n - 1) latencies.
  assert fs2 - fs == pytest.approx(3 * 2.0) and bs2 - bs == pytest.approx(2 * 2.0)


def test_train_cli_prints_a_plan_error_without_a_traceback(tmp_path):
  """``gpp_jax.train --mesh=...`` with more stages asked for than the mesh has rows: the
  message, naming rows, and a non-zero exit; no traceback."""
  import subprocess
  import sys

  from harness import child_env

  r = subprocess.run(
    [sys.executable, "-m", "gpp_jax.train", "--model=gpt", "--mesh=data:2,model:4"]
    + ["--planner=balanced", "--min_stages=4", "--nocalibrate", "--steps=1"]
    + [f"--run_dir={tmp_path}"],
    capture_output=True,
    text=True,
    timeout=300,
    env=child_env(),
  )
  assert r.returncode == 1
  assert "PlanError: min_stages=4 asks for more stages than there are rows" in r.stderr
  assert "Traceback" not in r.stderr


def _all_reduces(compiled_text: str) -> int:
  return sum(
    1
    for line in compiled_text.splitlines()
    if " all-reduce(" in line or "all-reduce-start(" in line
  )


def test_data_parallel_stages_reduce_gradients_once_per_step():
  """Two stages of 4 devices each (``devices=``: one device a row, parameters replicated): a
  stage's backward has no all-reduce (each row adds its examples' gradients to its own slice
  of the sums), the UPDATE's reduction of the slices has one per parameter array, and the
  step is exact (``run_nnx``)."""
  model_kw = dict(up=(None, None), down=(None, None), up_bias=(None,))
  plan = gpp_jax.manual_plan(
    {"a": 0, "b": 0, "c": 1, "head": 1}, devices={0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
  )
  mesh = jax.make_mesh((8,), ("data",))
  _, _, _, pp = run_nnx(make_chain(**model_kw), optax.adam(1e-2), plan, mesh)
  for k in pp.compiled.kernels.stages:
    assert k.row_local and k.placement.rows == 4
    st, place = k.stage, k.placement
    avals = [v.aval for v in st.jaxpr.jaxpr.invars]

    def arg(r, a, place=place):
      batch = r.kind != "param" and a.ndim >= 1 and a.shape[0] == place.microbatch_size
      sharding = place.batched if batch else place.replicated
      return jax.device_put(np.zeros(a.shape, a.dtype), sharding)

    values = [arg(r, a) for r, a in zip(st.inputs, avals)]
    diff, nondiff = values[: st.num_diff], values[st.num_diff :]
    outs, res = k.fns.fwd(diff, nondiff)
    cts = [(jnp.zeros_like(o),) for o in outs]
    acc = k.zeros()
    backward = k.fns.bwd.lower(res, cts, acc).compile().as_text()
    assert _all_reduces(backward) == 0
    update = k.fns.acc_leaves.lower(acc).compile().as_text()
    assert _all_reduces(update) >= 1


def test_host_model_charges_a_stage_reducing_once_per_step_in_its_update():
  """With ``reduce_once`` on the layer graph (set at capture where stages sum per row), a
  stage over 2 devices pays the measured all-reduce once, in its UPDATE, not in every
  backward; under zero-bubble (the backward split) it pays it in every W as before."""
  import dataclasses

  from test_host_planning import chain, cpu_cluster, spmd_host

  from gpp_jax.ir.plan import Plan, Stage
  from gpp_jax.passes.simulation import simulate

  g = chain(10e-3, 4096)
  cluster = cpu_cluster(4)
  plan = Plan(
    (Stage(0, ("a",), (0, 1)), Stage(1, ("b",), (2,))), ((0, 1),), 4, planner="x", batch_size=8
  )
  host = dataclasses.replace(spmd_host({2: 3.0}), allreduce={2: 1e-9})

  def durations(graph, p):
    res = simulate(p, graph, cluster, host=host)
    return {(a.kind, a.stage): a.end - a.start for a in res.actions}

  per_call = durations(g, plan)
  once = g.copy()
  once.graph["reduce_once"] = True
  stepwise = durations(once, plan)
  reduce = per_call[("B", 0)] - stepwise[("B", 0)]
  assert reduce > 0
  assert stepwise[("UPDATE", 0)] == pytest.approx(per_call[("UPDATE", 0)] + reduce)
  assert stepwise[("B", 1)] == pytest.approx(per_call[("B", 1)])  # one device
  zb = plan.replace(schedule="zero-bubble")
  assert durations(once, zb)[("W", 0)] == pytest.approx(durations(g, zb)[("W", 0)])
