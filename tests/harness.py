"""Shared helpers: tiny models as plain pytrees and a pipelined-vs-reference runner."""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gpp_jax

OPTIMIZERS = {
  "adamw": lambda: optax.adamw(1e-2, weight_decay=1e-2),
  "clip_adam": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
}


def dense(key, a, b):
  return {"w": jax.random.normal(key, (a, b)) / np.sqrt(a), "b": 0.1 * jnp.ones(b)}


def apply_dense(p, x):
  return x @ p["w"] + p["b"]


def make_batch(seed, batch, din, dout):
  rng = np.random.default_rng(seed)
  return {
    "x": rng.normal(size=(batch, din)).astype(np.float32),
    "y": rng.normal(size=(batch, dout)).astype(np.float32),
  }


# A four-stage DAG: an input layer, two branches, and a head that reads both branches and, over a
# skip edge, the input layer. Stage graph 0 -> 1, 0 -> 2, 0 -> 3, 1 -> 3, 2 -> 3.
DAG_STAGES = {"inp": 0, "left": 1, "right": 2, "head": 3}
DAG_EDGES = [(0, 1), (0, 2), (0, 3), (1, 3), (2, 3)]


def dag_model(p, x):
  h = jnp.tanh(apply_dense(p["inp"], x))
  a = jnp.tanh(apply_dense(p["left"], h))
  b = jax.nn.relu(apply_dense(p["right"], h))
  return apply_dense(p["head"], jnp.concatenate([a, b], axis=-1) + jnp.tile(h, 2))


def dag_params():
  """Parameters of ``dag_model`` for 5 inputs and 2 outputs."""
  ks = jax.random.split(jax.random.key(11), 4)
  return {
    "inp": dense(ks[0], 5, 6),
    "left": dense(ks[1], 6, 6),
    "right": dense(ks[2], 6, 6),
    "head": dense(ks[3], 12, 2),
  }


def mse_step(model_fn, tx):
  """A plain-pytree train step: MSE loss, optax update, loss metric."""

  def step(params, opt_state, batch):
    def loss_fn(p):
      return jnp.mean((model_fn(p, batch["x"]) - batch["y"]) ** 2)

    loss, grads = gpp_jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, {"loss": loss}

  return step


def child_env(**extra: str) -> dict[str, str]:
  """The environment for a subprocess that sets up its own devices (a launched process, the
  train program with its own count): this run's, with ``extra``, and the XLA flags of the run
  (conftest) without the forced device count."""
  env = dict(os.environ, **extra)
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
  env["XLA_FLAGS"] = " ".join(flags.split())
  return env


def max_diff(a, b) -> float:
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb), (len(la), len(lb))
  return max(
    float(
      np.max(
        np.abs(
          np.asarray(jax.device_get(x), np.float64) - np.asarray(jax.device_get(y), np.float64)
        )
      )
    )
    for x, y in zip(la, lb)
  )


def compare_steps(step, args, batch, steps=3, **pp_kwargs):
  """Runs ``step`` jitted on one device and pipelined; returns (ref outputs, pp outputs, pp).

  Both run under ``jax.transfer_guard("disallow")``; the pipelined one gets host batches.
  """
  ref = jax.jit(step)
  pp = gpp_jax.graph_pipeline(step, **pp_kwargs)
  dev0 = jax.devices()[0]
  r_args = jax.device_put(args, dev0)
  r_batch = jax.device_put(batch, dev0)
  p_args = args
  with jax.transfer_guard("disallow"):
    for _ in range(steps):
      r_out = ref(*r_args, r_batch)
      p_out = pp(*p_args, batch)
      r_args, p_args = r_out[:-1], p_out[:-1]
  return r_out, p_out, pp


def sequential_plan(layer_graph, cluster, batch_size, num_microbatches, stages, name):
  """What a user's planner (``planner=callable``) named ``name`` returns: ``stages`` ((layers,
  devices) each, in order) as a chain, the batch in ``num_microbatches`` micro-batches."""
  from gpp_jax.passes.partition.plan_assembly import StageLayout, assemble_plan
  from gpp_jax.passes.partition.problem import PlanningProblem

  return assemble_plan(
    PlanningProblem.build(layer_graph, cluster, batch_size),
    stages,
    microbatch=batch_size // num_microbatches,
    planner=name,
    layout=StageLayout(sequential=True),
  )


def accumulating_planner(width: int):
  """A user's planner (``planner=callable``) that returns the whole model as one stage over
  ``width`` devices in the step's micro-batches: gradient accumulation, planner "accumulate"."""

  def planner(layer_graph, cluster, batch_size, *, num_microbatches=None):
    from gpp_jax.ir.layer_graph import topo_layers

    stages = [(list(topo_layers(layer_graph)), width)]
    return sequential_plan(layer_graph, cluster, batch_size, num_microbatches, stages, "accumulate")

  return planner
