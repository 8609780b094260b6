"""IR round trips and the layering rules on small programs."""

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

from gpp_jax.ir import layer_graph as lg
from gpp_jax.ir.plan import Plan, validate_plan
from gpp_jax.passes.capture import inline_calls, op_graph
from gpp_jax.passes.layering import layer_program
from gpp_jax.passes.partition.balanced import balanced_plan
from gpp_jax.runtime.capture_step import layer_path


def _layered(fn, params, *data, depth=None):
  with_path, tree = jax.tree_util.tree_flatten_with_path(params)
  leaves = [x for _, x in with_path]
  closed = jax.make_jaxpr(
    lambda *a: fn(jax.tree.unflatten(tree, a[: len(leaves)]), *a[len(leaves) :])
  )(*leaves, *data)
  closed = inline_calls(closed)
  paths = [layer_path(p) for p, _ in with_path] + [None] * len(data)
  return closed, layer_program(closed, paths, batch_size=data[0].shape[0], layer_depth=depth)


def test_layer_path_forms():
  params = {"params": {"block0": {"fc": {"kernel": 1}}}, "w": 2}
  paths = [layer_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  assert paths == ["block0/fc", "w"]


def test_nested_jit_is_inlined_with_name_stacks():
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(2, name="out")(jax.jit(jnp.tanh)(nn.Dense(4, name="inp")(x)))

  m = Net()
  x = jnp.ones((3, 5))
  p = m.init(jax.random.key(0), x)
  f = jax.jit(lambda p, x: jnp.sum(m.apply(p, x)))
  closed, L = _layered(lambda p, x: f(p, x), p, x)
  assert not any(e.primitive.name == "jit" for e in closed.jaxpr.eqns)
  assert set(L.graph.nodes) == {"Net/inp", "Net/out"}
  g = op_graph(closed)
  assert g.number_of_nodes() == len(closed.jaxpr.eqns)
  dots = [n for n, d in g.nodes(data=True) if d["primitive"] == "dot_general"]
  assert sorted(g.nodes[n]["flops"] for n in dots) == [2 * 3 * 4 * 2, 2 * 3 * 5 * 4]


def test_nnx_layers_from_parameter_paths_and_depth():
  class Block(nnx.Module):
    def __init__(self, rngs):
      self.a = nnx.Linear(4, 4, rngs=rngs)
      self.b = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
      return self.b(jnp.tanh(self.a(x))) + x

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.blocks = nnx.List([Block(rngs), Block(rngs)])

    def __call__(self, x):
      for b in self.blocks:
        x = b(x)
      return jnp.mean(x**2)

  model = Net(nnx.Rngs(0))
  gd, st = nnx.split(model)
  x = jnp.ones((2, 4))
  _, L = _layered(lambda s, x: nnx.merge(gd, s)(x), st, x)
  assert lg.topo_layers(L.graph) == ["blocks/0/a", "blocks/0/b", "blocks/1/a", "blocks/1/b"]
  _, L2 = _layered(lambda s, x: nnx.merge(gd, s)(x), st, x, depth=2)
  assert lg.topo_layers(L2.graph) == ["blocks/0", "blocks/1"]
  assert L2.graph.edges["blocks/0", "blocks/1"]["bytes"] == 2 * 4 * 4


def test_costs_and_json_round_trips():
  def f(p, x):
    h = jnp.tanh(x @ p["a"])
    return jnp.sum(h @ p["b"])

  p = {"a": jnp.ones((5, 7)), "b": jnp.ones((7, 3))}
  x = jnp.ones((4, 5))
  _, L = _layered(f, p, x)
  g = L.graph
  assert g.nodes["a"]["param_bytes"] == 5 * 7 * 4 and g.nodes["b"]["param_bytes"] == 7 * 3 * 4
  assert g.nodes["a"]["flops"] >= 2 * 4 * 5 * 7
  assert g.edges["a", "b"]["bytes"] == 4 * 7 * 4
  g2 = lg.from_json(lg.to_json(g))
  assert dict(g2.nodes(data=True)) == dict(g.nodes(data=True))
  plan = balanced_plan(g, 2, 4, num_microbatches=2)
  validate_plan(plan, g, 2)
  assert Plan.from_json(plan.to_json()) == plan
  assert "stage" in str(plan) and "a" in str(plan)


def test_an_edge_counts_the_arrays_it_carries():
  """Two arrays from layer a read by layer b: an edge of two arrays (each a transfer of its
  own between stages); an array read twice in b is one."""

  def f(p, x):
    h, g = x @ p["a"]["u"], x @ p["a"]["v"]
    return jnp.sum(h @ p["b"]["u"] + g @ p["b"]["v"] + h @ p["b"]["w"])

  p = {
    "a": {"u": jnp.ones((5, 7)), "v": jnp.ones((5, 7))},
    "b": {"u": jnp.ones((7, 3)), "v": jnp.ones((7, 3)), "w": jnp.ones((7, 3))},
  }
  _, L = _layered(f, p, jnp.ones((4, 5)), depth=1)
  crossing = [d for u, v, d in L.graph.edges(data=True) if (u, v) == ("a", "b")]
  assert crossing and crossing[0]["arrays"] == 2
  g2 = lg.from_json(lg.to_json(L.graph))
  assert g2.edges["a", "b"]["arrays"] == 2


def test_balanced_plan_balances_flops():
  g = lg.new_layer_graph("chain", 1)
  for i, f in enumerate([1, 1, 1, 1, 4, 4]):
    lg.add_layer(g, f"l{i}", lg.LayerCost(flops=f))
    if i:
      lg.add_edge(g, f"l{i - 1}", f"l{i}", 1)
  plan = balanced_plan(g, 3)
  assert [s.layers for s in plan.stages] == [("l0", "l1", "l2", "l3"), ("l4",), ("l5",)]


def test_calibration_times_every_layer():
  from gpp_jax.passes.calibrate import LayerTiming, calibrate_layers

  def f(p, x):
    return jnp.mean(jnp.tanh(jnp.tanh(x @ p["a"]) @ p["b"]))

  p = {"a": jnp.ones((5, 64)), "b": jnp.ones((64, 3))}
  closed, L = _layered(f, p, jnp.ones((32, 5)))
  g = calibrate_layers(closed, L, jax.devices()[0], LayerTiming(repeats=2))
  for n in g:
    assert g.nodes[n]["time_f"] > 0 and g.nodes[n]["time_b"] > 0
  assert "time_f" not in L.graph.nodes["a"]  # the input graph is left as it was


def test_layers_whose_first_equation_reads_only_inputs_and_parameters():
  # Each layer is one while loop reading the previous activation (the batch for the first)
  # and its parameters; none of them may be mistaken for weight preprocessing.
  def f(p, x):
    for k in ("l0", "l1", "l2"):
      w = p[k]
      x = jax.lax.fori_loop(0, 3, lambda i, h, w=w: jnp.tanh(h @ w), x)
    return jnp.sum(x)

  p = {k: jnp.ones((4, 4)) for k in ("l0", "l1", "l2")}
  _, L = _layered(f, p, jnp.ones((2, 4)))
  assert lg.topo_layers(L.graph) == ["l0", "l1", "l2"]
  assert all(L.graph.nodes[k]["param_bytes"] == 64 for k in ("l0", "l1", "l2"))
