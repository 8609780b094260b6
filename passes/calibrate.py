"""Calibration pass: LayerGraph -> LayerGraph with measured ``time_f`` / ``time_b`` per layer.

Each layer is cut out of the loss with the staging pass (one stage per layer), jitted on the
given device like a real stage, and timed (forward, and backward with its vjp) on inputs of the
right shapes. The times are for the traced micro-batch size, the LayerGraph's ``batch_size``.
"""

from __future__ import annotations

import functools
import statistics
import time

import jax
import jax.numpy as jnp
import networkx as nx
import numpy as np

from gpp_jax.ir.layer_graph import topo_layers
from gpp_jax.ir.plan import Plan, Stage
from gpp_jax.passes.staging import stage_functions, stage_program


def _example(aval, device, rng):
  if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.prng_key):
    return jax.device_put(jax.random.key(0), device)
  if jnp.issubdtype(aval.dtype, jnp.floating):
    x = rng.standard_normal(aval.shape).astype(aval.dtype)
  else:
    x = np.zeros(aval.shape, aval.dtype)
  return jax.device_put(x, device)


def _median_time(fn, repeats):
  jax.block_until_ready(fn())
  ts = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    ts.append(time.perf_counter() - t)
  return statistics.median(ts)


def calibrate_layers(
  closed, eqn_layer, param_layer, graph: nx.DiGraph, device, repeats: int = 5
) -> nx.DiGraph:
  """Returns a copy of ``graph`` with ``time_f`` and ``time_b`` (seconds) for every layer."""
  layers = topo_layers(graph)
  index = {l: i for i, l in enumerate(layers)}
  stages = tuple(Stage(i, (l,), (0,)) for i, l in enumerate(layers))
  edges = tuple(sorted({(index[u], index[v]) for u, v in graph.edges}))
  staged = stage_program(closed, eqn_layer, param_layer, Plan(stages, edges, 1))
  out = graph.copy()
  rng = np.random.default_rng(0)
  for st in staged.stages:
    fns = stage_functions(st)
    avals = [v.aval for v in st.jaxpr.jaxpr.invars]
    args = [_example(a, device, rng) for a in avals]
    diff = [a for a, r in zip(args, st.inputs) if r.diff]
    nondiff = [a for a, r in zip(args, st.inputs) if not r.diff]
    outs, res = fns.fwd(diff, nondiff)
    cts = [
      (jax.device_put(jnp.ones_like(o), device),) if r.diff else ()
      for o, r in zip(outs, st.outputs)
    ]
    zeros = jax.jit(fns.zeros_acc, out_shardings=jax.sharding.SingleDeviceSharding(device))
    t_f = _median_time(functools.partial(fns.fwd, diff, nondiff), repeats)
    t_b = _median_time(  # includes a tiny zeros()
      lambda fns=fns, res=res, cts=cts, zeros=zeros: fns.bwd(res, cts, zeros()), repeats
    )
    node = out.nodes[layers[st.index]]
    node["time_f"], node["time_b"] = t_f, t_b
  return out
