"""Model zoo: shapes, losses, trainability, parameter counts and branch independence."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from gpp_jax.models import candle_uno, dlrm, mmt
from gpp_jax.models.registry import MODELS, PRESETS, get_config, get_model

NAMES = ("mmt", "dlrm", "candle_uno", "gpt")
BATCH = 16


# Compilation dominates these tests, so they trade the speed of the compiled tiny programs
# for compile time: XLA's cheapest backend settings, and "rbg" PRNG keys, whose random-number
# programs XLA:CPU compiles in a fraction of the time of threefry's.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
fast_jit = functools.partial(jax.jit, compiler_options=FAST_COMPILE)


def rbg_key(seed: int) -> jax.Array:
  return jax.random.key(seed, impl="rbg")


@dataclasses.dataclass(frozen=True)
class Tiny:
  """A tiny-preset model, its batch, and its split (graphdef, params)."""

  spec: Any
  config: Any
  batch: dict
  graphdef: Any
  params: Any

  def merge(self, params=None, config=None):
    """The model rebuilt from ``params``, optionally under another config (same tree)."""
    graphdef = self.graphdef if config is None else _graphdef(self.spec.name, config)
    return nnx.merge(graphdef, self.params if params is None else params)


@functools.cache
def _graphdef(name: str, config) -> Any:
  return nnx.split(MODELS[name].abstract_model(config), nnx.Param)[0]


@functools.cache
def tiny(name: str, **overrides) -> Tiny:
  """Built once per test session: construction and compilation dominate the test time."""
  spec = MODELS[name]
  config = spec.preset("tiny", **overrides)
  # make_model runs under jit (one compilation instead of one per eager operation).
  graphdef, params = fast_jit(
    lambda: nnx.split(spec.make_model(config, nnx.Rngs(rbg_key(0))), nnx.Param)
  )()
  batch = fast_jit(spec.synthetic_batch, static_argnums=(0, 1))(config, BATCH, rbg_key(1))
  return Tiny(spec, config, batch, graphdef, params)


@functools.cache
def evaluate(name: str):
  """Jitted ``(params, batch) -> (outputs, loss)``, compiled once per model."""
  t = tiny(name)

  def run(params, batch):
    model = nnx.merge(t.graphdef, params)
    return t.spec.forward(model, batch), t.spec.loss_fn(model, batch)

  return fast_jit(run)


def _paths(state) -> dict[str, jax.Array]:
  return {"/".join(map(str, p)): v for p, v in nnx.to_flat_state(state)}


def _path_str(key_path) -> str:
  """``[DictKey('head'), DictKey('layers'), DictKey(0), DictKey('kernel'), .value]`` ->
  ``head/layers/0/kernel``."""
  return "/".join(str(k.key) for k in key_path if isinstance(k, jax.tree_util.DictKey))


# ---------------------------------------------------------------------------------- registry


def test_registry_lists_the_four_models_with_both_presets():
  assert set(MODELS) == set(NAMES)
  for name in NAMES:
    spec = get_model(name)
    assert spec.name == name
    for preset in PRESETS:
      config = spec.preset(preset)
      assert isinstance(config, spec.config_cls)
      assert get_config(name, preset) == config
    with pytest.raises(dataclasses.FrozenInstanceError):
      config.dropout = 0.5  # configs are frozen


def test_registry_rejects_unknown_names_and_bad_configs():
  with pytest.raises(ValueError, match="known models"):
    get_model("resnet")
  with pytest.raises(ValueError, match="preset"):
    MODELS["gpt"].preset("huge")
  with pytest.raises(ValueError, match="divisible"):
    get_config("mmt", hidden=30, num_heads=4)
  with pytest.raises(ValueError, match="entries for 3 branches"):
    get_config("candle_uno", feature_dims=(4, 4))
  with pytest.raises(ValueError, match="bag_combine"):
    get_config("dlrm", bag_combine="max")
  assert get_config("gpt", "tiny", tie_embeddings=True).tie_embeddings


# ------------------------------------------------------------------------- shapes and losses


def _expected_output_shape(name, config):
  return {
    "mmt": lambda: (BATCH, config.num_classes),
    "dlrm": lambda: (BATCH,),
    "candle_uno": lambda: (BATCH,),
    "gpt": lambda: (BATCH, config.seq_len, config.vocab_size),
  }[name]()


@pytest.mark.parametrize("name", NAMES)
def test_synthetic_batch_has_batch_dim_and_realistic_dtypes(name):
  t = tiny(name)
  c = t.config
  int_keys = {
    "mmt": lambda: {"labels"},
    "candle_uno": set,
    "gpt": lambda: {"tokens", "targets"},
    "dlrm": lambda: {f"sparse_{i}" for i in range(c.num_sparse_branches)},
  }[name]()
  for key, x in t.batch.items():
    assert x.shape[0] == BATCH, key
    assert x.dtype == (jnp.int32 if key in int_keys else jnp.float32), key
  if name == "dlrm":
    for i, rows in enumerate(c.branch_num_embeddings):
      ids = t.batch[f"sparse_{i}"]
      assert ids.shape == (BATCH, c.bag_size)
      assert int(ids.min()) >= 0 and int(ids.max()) < rows
  if name == "gpt":  # targets are the inputs shifted by one position
    np.testing.assert_array_equal(t.batch["targets"][:, :-1], t.batch["tokens"][:, 1:])


@pytest.mark.parametrize("name", NAMES)
def test_output_shape_and_finite_scalar_loss(name):
  t = tiny(name)
  out, loss = evaluate(name)(t.params, t.batch)
  assert out.shape == _expected_output_shape(name, t.config)
  assert bool(jnp.all(jnp.isfinite(out)))
  assert loss.shape == () and loss.dtype == jnp.float32
  assert bool(jnp.isfinite(loss)) and float(loss) > 0.0


@pytest.mark.parametrize("name", NAMES)
def test_loss_is_a_mean_over_examples(name):
  # The pipeline's micro-batch contract: the loss of a batch is the mean of the losses of
  # its equal halves (a sum, or a per-batch normalisation, would fail this).
  t = tiny(name)
  half = BATCH // 2
  whole = evaluate(name)(t.params, t.batch)[1]
  first, second = (
    evaluate(name)(t.params, jax.tree.map(lambda x, s=s: x[s], t.batch))[1]
    for s in (slice(0, half), slice(half, BATCH))
  )
  assert float(first) != float(second)
  np.testing.assert_allclose(whole, (first + second) / 2, rtol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_dropout_takes_an_explicit_key_and_mutates_nothing(name):
  t = tiny(name)
  config = dataclasses.replace(t.config, dropout=0.3)
  model = t.merge(config=config)
  assert not jax.tree.leaves(nnx.state(model, nnx.Not(nnx.Param)))  # parameters only
  graphdef, state = nnx.split(model)  # all of its state, not only the parameters

  @fast_jit
  def loss_and_state_after(state, key):  # what nnx.jit does to carry mutations out
    model = nnx.merge(graphdef, state)
    return t.spec.loss_fn(model, t.batch, key), nnx.state(model)

  k1, k2 = rbg_key(7), rbg_key(8)
  with_k1, after = loss_and_state_after(state, k1)
  assert float(with_k1) != float(loss_and_state_after(state, k2)[0])
  assert float(loss_and_state_after(state, k1)[0]) == float(with_k1)
  assert jax.tree.all(jax.tree.map(np.array_equal, state, after))

  # Without a key the program is the deterministic one: the same as without dropout.
  def program(cfg, key):
    return str(jax.make_jaxpr(lambda p: t.spec.loss_fn(t.merge(p, cfg), t.batch, key))(t.params))

  assert program(config, None) == program(t.config, None)
  assert program(config, k1) != program(t.config, k1)


# ------------------------------------------------------------------------------- training


@pytest.mark.parametrize("name", NAMES)
def test_twenty_adam_steps_decrease_the_loss(name):
  t = tiny(name)
  opt = optax.adam(1e-2)

  @fast_jit
  def step(params, opt_state):
    loss, grads = jax.value_and_grad(lambda p: t.spec.loss_fn(nnx.merge(t.graphdef, p), t.batch))(
      params
    )
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  params, opt_state = t.params, opt.init(t.params)
  losses = []
  for _ in range(21):  # 20 updates; the 21st call reports the loss
    params, opt_state, loss = step(params, opt_state)
    losses.append(float(loss))
  assert np.all(np.isfinite(losses))
  assert losses[-1] < 0.5 * losses[0], losses


# --------------------------------------------------------------------- paper parameter counts


def _linear(a, b):
  return a * b + b


def _dense_stack(dims):
  return sum(_linear(a, b) for a, b in itertools.pairwise(dims))


def _transformer_block(h, ffn):
  layer_norms = 2 * 2 * h
  return layer_norms + _linear(h, 3 * h) + _linear(h, h) + _linear(h, ffn) + _linear(ffn, h)


def _closed_form(name, c) -> int:
  if name == "mmt":
    branches = sum(
      f * c.hidden
      + c.hidden
      + s * c.hidden  # input, positions
      + c.num_layers * _transformer_block(c.hidden, c.ffn)
      + 2 * c.hidden  # final LayerNorm
      for f, s in zip(c.branch_feature_dims, c.branch_seq_lens)
    )
    return branches + _dense_stack((c.num_branches * c.hidden, *c.head_dims, c.num_classes))
  if name == "dlrm":
    dense = sum(
      _dense_stack((d, *[c.dense_width] * c.dense_layers, c.interaction_dim))
      for d in c.branch_dense_dims
    )
    bag = c.embedding_dim * (c.bag_size if c.bag_combine == "concat" else 1)
    proj = 0 if bag == c.interaction_dim else _linear(bag, c.interaction_dim)
    sparse = sum(rows * c.embedding_dim + proj for rows in c.branch_num_embeddings)
    n = c.num_dense_branches + c.num_sparse_branches
    top_in = c.num_dense_branches * c.interaction_dim + n * (n - 1) // 2
    return dense + sparse + _dense_stack((top_in, *[c.top_width] * c.top_layers, 1))
  if name == "candle_uno":
    branches = sum(
      _dense_stack((f, *[c.branch_width] * c.branch_layers)) for f in c.branch_feature_dims
    )
    head = _dense_stack((c.num_branches * c.branch_width, *[c.head_width] * c.head_layers, 1))
    return branches + head
  if name == "gpt":
    head = 0 if c.tie_embeddings else c.hidden * c.vocab_size
    return (
      c.vocab_size * c.hidden
      + c.seq_len * c.hidden
      + c.num_layers * _transformer_block(c.hidden, c.ffn)
      + 2 * c.hidden
      + head
    )
  raise AssertionError(name)


@pytest.mark.parametrize("name", NAMES)
def test_paper_param_count_matches_closed_form(name):
  spec = MODELS[name]
  config = spec.preset("paper")
  abstract = spec.abstract_model(config)
  leaves = jax.tree.leaves(nnx.state(abstract, nnx.Param))
  assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)  # no allocation
  assert spec.num_params(config) == _closed_form(name, config)


def test_paper_presets_have_the_published_shapes():
  c = mmt.MMTConfig.paper()
  assert (c.num_branches, c.num_layers, c.branch_seq_lens[0], c.hidden, c.num_heads, c.ffn) == (
    4,
    8,
    256,
    1024,
    16,
    4096,
  )
  d = dlrm.DLRMConfig.paper()
  assert (
    d.num_dense_branches,
    d.dense_layers,
    d.dense_width,
    d.num_sparse_branches,
    d.embedding_dim,
    d.bag_size,
    d.branch_num_embeddings[0],
    d.top_width,
  ) == (7, 4, 4096, 7, 64, 100, 1_000_000, 4096)
  u = candle_uno.CandleUnoConfig.paper()
  assert (u.num_branches, u.branch_layers, u.branch_width) == (7, 4, 4096)
  # A hand-checked total, so a change to the preset or to the closed form is noticed.
  assert _closed_form("mmt", c) == 413_554_664


@pytest.mark.parametrize(
  "name, overrides",
  [
    ("dlrm", {"bag_combine": "concat"}),  # bags of 4 x 8 projected to 8
    ("dlrm", {"interaction_dim": 12}),  # sum-combined bags projected 8 -> 12
    ("gpt", {"tie_embeddings": True}),
    ("mmt", {"head_dims": ()}),
  ],
)
def test_variant_param_counts_match_closed_form(name, overrides):
  spec = MODELS[name]
  config = spec.preset("tiny", **overrides)
  assert spec.num_params(config) == _closed_form(name, config)
  # The variant also composes: its loss traces to a scalar (shapes only, nothing compiled).
  batch = jax.eval_shape(lambda: spec.synthetic_batch(config, BATCH, rbg_key(1)))
  loss = nnx.eval_shape(lambda b: spec.loss_fn(spec.make_model(config, nnx.Rngs(0)), b), batch)
  assert loss.shape == () and loss.dtype == jnp.float32


# ------------------------------------------------------------------------- branch structure


def _branches(name, config):
  """(batch keys, parameter path prefixes) of each branch, in branch order."""
  if name == "dlrm":
    keys = [f"dense_{i}" for i in range(config.num_dense_branches)] + [
      f"sparse_{i}" for i in range(config.num_sparse_branches)
    ]
    prefixes = [f"dense/{i}/" for i in range(config.num_dense_branches)] + [
      f"sparse/{i}/" for i in range(config.num_sparse_branches)
    ]
    return keys, prefixes
  n = config.num_branches
  return [f"features_{i}" for i in range(n)], [f"branches/{i}/" for i in range(n)]


def _branch_outputs(name, model, batch) -> list[jax.Array]:
  if name == "dlrm":
    dense, sparse = model.branch_outputs(*dlrm.inputs_of(batch, model.config))
    return dense + sparse
  module = {"mmt": mmt, "candle_uno": candle_uno}[name]
  return model.branch_outputs(module.features_of(batch, model.config))


BRANCHED = ("mmt", "dlrm", "candle_uno")


@pytest.mark.parametrize("name", BRANCHED)
def test_parameters_live_under_their_branch_or_the_head(name):
  t = tiny(name)
  paths = _paths(t.params)
  _, prefixes = _branches(name, t.config)
  assert len(prefixes) >= 3  # the tiny presets exercise more than two branches
  head = "top/" if name == "dlrm" else "head/"
  for prefix in prefixes:
    assert any(p.startswith(prefix) for p in paths), prefix
  assert not [p for p in paths if not p.startswith((*prefixes, head))]


@pytest.mark.parametrize("name", BRANCHED)
def test_changing_one_branch_input_changes_only_that_branch(name):
  t = tiny(name)
  keys, _ = _branches(name, t.config)
  outputs = fast_jit(lambda p, b: _branch_outputs(name, t.merge(p), b))
  base = outputs(t.params, t.batch)
  assert len(base) == len(keys)
  for k, key in enumerate(keys):
    x = t.batch[key]
    changed = jnp.zeros_like(x) if x.dtype == jnp.float32 else (x + 1) % 2
    outs = outputs(t.params, {**t.batch, key: changed})
    for i, (a, b) in enumerate(zip(base, outs)):
      if i == k:
        assert not np.allclose(a, b), f"branch {i} ignores its input {key}"
      else:
        np.testing.assert_array_equal(a, b, err_msg=f"branch {i} reads {key}")


def _reads(jaxpr, out_index: int) -> set[int]:
  """Indices of the jaxpr inputs that output ``out_index`` depends on (data flow; an
  equation's outputs are taken to depend on all of its inputs, nested calls included)."""
  needed = {jaxpr.outvars[out_index]}
  for eqn in reversed(jaxpr.eqns):
    if any(v in needed for v in eqn.outvars):
      needed.update(v for v in eqn.invars if not hasattr(v, "val"))  # skip literals
  return {i for i, v in enumerate(jaxpr.invars) if v in needed}


@pytest.mark.parametrize("name", BRANCHED)
def test_each_branch_output_reads_only_its_own_parameters_and_input(name):
  t = tiny(name)
  keys, prefixes = _branches(name, t.config)
  param_paths = [_path_str(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(t.params)[0]]
  batch_keys = sorted(t.batch)  # flattening order of the dict
  closed = jax.make_jaxpr(lambda p, b: _branch_outputs(name, t.merge(p), b))(t.params, t.batch)
  jaxpr = closed.jaxpr
  assert len(jaxpr.invars) == len(param_paths) + len(batch_keys)
  for k, (key, prefix) in enumerate(zip(keys, prefixes)):
    reads = _reads(jaxpr, k)
    params = {param_paths[i] for i in reads if i < len(param_paths)}
    inputs = {batch_keys[i - len(param_paths)] for i in reads if i >= len(param_paths)}
    assert inputs == {key}, (k, inputs)
    assert params and all(p.startswith(prefix) for p in params), (prefix, sorted(params))
    owned = {p for p in param_paths if p.startswith(prefix)}
    assert params == owned, sorted(owned - params)  # every branch parameter does work


@pytest.mark.parametrize("name", BRANCHED)
def test_merge_is_filed_under_the_head(name):
  t = tiny(name)
  jaxpr = jax.make_jaxpr(lambda p: t.spec.loss_fn(t.merge(p), t.batch))(t.params)
  merges = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "concatenate"]
  assert merges
  scope = "top/layers/0" if name == "dlrm" else "head/layers/0"
  assert all(str(e.source_info.name_stack) == scope for e in merges)


def test_gpt_is_causal():
  t = tiny("gpt")
  pos = t.config.seq_len // 2
  tokens = t.batch["tokens"]
  edited = tokens.at[:, pos].set((tokens[:, pos] + 1) % t.config.vocab_size)
  a = evaluate("gpt")(t.params, t.batch)[0]
  b = evaluate("gpt")(t.params, {**t.batch, "tokens": edited})[0]
  np.testing.assert_array_equal(a[:, :pos], b[:, :pos])
  assert not np.allclose(a[:, pos:], b[:, pos:])


@pytest.mark.parametrize("tie", [False, True])
def test_gpt_tied_head_reads_the_token_embedding(tie):
  name = "gpt"
  t = tiny(name, tie_embeddings=tie) if tie else tiny(name)
  assert ("head/kernel" in _paths(t.params)) != tie
  # With input tokens from the lower half of the vocabulary, the upper-half rows of the
  # token embedding reach the logits only through the output head, i.e. only when tied.
  half = t.config.vocab_size // 2
  batch = {k: v % half for k, v in t.batch.items()}
  bumped = jax.tree.map(lambda x: x, t.params)  # a copy: new Variables
  bumped["embed"]["tokens"][...] = t.params["embed"]["tokens"][...].at[half:].add(1.0)
  forward = fast_jit(lambda p: t.spec.forward(t.merge(p), batch))
  assert (not np.allclose(forward(t.params), forward(bumped))) == tie


# --------------------------------------------------------------------------- partition specs

P = jax.sharding.PartitionSpec

# Megatron-style specs of every transformer block, by the path's tail; everything else P().
BLOCK_SPECS = {
  "attn/qkv/kernel": P(None, "model"),  # column-parallel
  "attn/qkv/bias": P("model"),
  "attn/out/kernel": P("model", None),  # row-parallel
  "attn/out/bias": P(None),
  "ffn/up/kernel": P(None, "model"),  # column-parallel
  "ffn/up/bias": P("model"),
  "ffn/down/kernel": P("model", None),  # row-parallel
  "ffn/down/bias": P(None),
}
GPT_SPECS = {
  **BLOCK_SPECS,
  "embed/tokens": P("model", None),  # vocab-parallel
  "head/kernel": P(None, "model"),  # column-parallel over the vocabulary
}


def _specs(state) -> dict[str, P]:
  """Parameter path -> its partition spec (``P()`` where it has none: replicated)."""
  flat = nnx.to_flat_state(nnx.get_partition_spec(state))
  return {"/".join(map(str, p)): v.get_value() for p, v in flat}


def _expected_specs(paths, by_tail: dict[str, P]) -> dict[str, P]:
  def spec(path):
    tails = [t for t in by_tail if path == t or path.endswith("/" + t)]
    return by_tail[tails[0]] if tails else P()

  return {p: spec(p) for p in paths}


def test_gpt_parameters_carry_megatron_partition_specs():
  t = tiny("gpt")
  specs = _specs(t.params)
  assert specs == _expected_specs(specs, GPT_SPECS)
  # Every annotated group is there, in every block, and only as metadata.
  for tail in GPT_SPECS:
    hits = [p for p in specs if p.endswith(tail)]
    assert len(hits) == (1 if tail in ("embed/tokens", "head/kernel") else t.config.num_layers)
  assert specs["embed/positions"] == P() and specs["norm/scale"] == P()
  md = t.merge().blocks[0].attn.qkv.kernel.get_metadata()
  assert md["out_sharding"] == (None, "model") and md["eager_sharding"] is False


def test_mmt_towers_carry_megatron_partition_specs():
  t = tiny("mmt")
  specs = _specs(t.params)
  assert specs == _expected_specs(specs, BLOCK_SPECS)
  per_block = t.config.num_branches * t.config.num_layers
  for tail in BLOCK_SPECS:
    assert len([p for p in specs if p.endswith(tail)]) == per_block
  # Input embeddings and the head stay replicated.
  assert specs["branches/0/input/kernel"] == P() and specs["head/layers/0/kernel"] == P()


def test_gpt_builds_under_a_mesh_and_runs_outside_it():
  """The specs are metadata only: a model created under a ("data", "model") mesh builds (and
  draws the same values) as without one, and its forward runs after the mesh is gone."""
  spec = MODELS["gpt"]
  config = spec.preset("tiny")
  with jax.set_mesh(jax.make_mesh((4, 2), ("data", "model"))):
    model = spec.make_model(config, nnx.Rngs(rbg_key(0)))
  plain = spec.make_model(config, nnx.Rngs(rbg_key(0)))
  params, plain_params = nnx.state(model, nnx.Param), nnx.state(plain, nnx.Param)
  assert _specs(params) == _specs(plain_params) == _expected_specs(_specs(params), GPT_SPECS)
  jax.tree.map(np.testing.assert_array_equal, params, plain_params)
  batch = tiny("gpt").batch
  forward = fast_jit(spec.forward)
  logits = forward(model, batch)
  assert logits.shape == (BATCH, config.seq_len, config.vocab_size)
  np.testing.assert_array_equal(logits, forward(plain, batch))
