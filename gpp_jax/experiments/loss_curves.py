"""Pipelined training vs the same training on one device: loss curves side by side.

  python -m gpp_jax.experiments.loss_curves --models=mmt,dlrm,candle_uno --steps=200

Each model (tiny preset) trains with the GraphPipe plan on 8 forced CPU devices and, from the
same initial state, undecorated on one device; prints the largest loss difference per model.

In float32 two correct implementations of the same step differ by rounding (~1e-7), and a
ReLU pre-activation that rounding puts on the other side of zero switches that unit's
gradient on or off, after which the curves separate; ``--dtype=float64`` runs both sides in
64-bit so such crossings are out of reach and the comparison shows the computation itself.
"""

from __future__ import annotations

import os

if __name__ == "__main__":
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  )

import dataclasses
import json
from typing import Any

import jax
import numpy as np
from absl import app, flags
from flax import nnx

import gpp_jax
from gpp_jax.experiments import zoo


@dataclasses.dataclass(frozen=True)
class CurveConfig:
  """The two runs ``loss_curves`` compares: ``batch_size`` samples a step from ``seed``, in
  ``dtype`` (as for ``zoo.setup``; float64 needs ``jax_enable_x64``); the pipelined run uses
  ``planner``'s plan over ``num_devices`` devices in ``num_microbatches`` micro-batches."""

  planner: Any = "graphpipe"
  num_devices: int = 8
  num_microbatches: int = 8
  batch_size: int = 32
  seed: int = 0
  dtype: Any = None


def loss_curves(model_name: str, steps: int, config: CurveConfig = CurveConfig()):
  """Returns (pipelined losses, one-device losses, plan) over ``steps`` steps of
  ``model_name`` (tiny preset) as ``config`` sets the runs up."""
  c = config
  seed, dtype, num_devices = c.seed, c.dtype, c.num_devices
  pipe_run = zoo.setup(model_name, seed=seed, dtype=dtype)
  ref_run = zoo.setup(model_name, seed=seed, dtype=dtype)
  data = pipe_run.batches(c.batch_size, 4)
  devices = jax.devices()[:num_devices]
  from gpp_jax.cost.cluster import cpu_cluster

  pp = gpp_jax.graph_pipeline(
    pipe_run.train_step,
    num_microbatches=c.num_microbatches,
    devices=devices,
    planner=c.planner,
    cluster=cpu_cluster(num_devices),
    layer_depth=pipe_run.spec.layer_depth,
  )
  ref = nnx.jit(ref_run.train_step)
  dev0 = devices[0]
  # The reference's state committed to its device as its own steps leave it: otherwise the
  # second step's arguments differ in placement from the first's and jit compiles it again.
  for obj in (ref_run.model, ref_run.optimizer):
    nnx.update(obj, jax.device_put(nnx.state(obj), dev0))
  ref_data = [jax.device_put(b, dev0) for b in data]
  pipe, one = [], []
  for i in range(steps):
    pipe.append(pp(pipe_run.model, pipe_run.optimizer, data[i % len(data)]))
    one.append(ref(ref_run.model, ref_run.optimizer, ref_data[i % len(data)]))
  return (np.array([float(x) for x in pipe]), np.array([float(x) for x in one]), pp.plan)


FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["mmt", "dlrm", "candle_uno"], "zoo models (tiny presets)")
flags.DEFINE_integer("steps", 200, "training steps")
flags.DEFINE_string("out", None, "write the curves as JSON here")
flags.DEFINE_enum(
  "dtype",
  "float32",
  ["float32", "float64"],
  "parameter and feature precision of both runs (float64 turns on jax_enable_x64)",
)


def main(_):
  if FLAGS.dtype == "float64":
    jax.config.update("jax_enable_x64", True)
  results = {}
  for name in FLAGS.models:
    pipe, one, plan = loss_curves(name, FLAGS.steps, CurveConfig(dtype=FLAGS.dtype))
    diff = float(np.max(np.abs(pipe - one)))
    results[name] = {
      "pipelined": pipe.tolist(),
      "one_device": one.tolist(),
      "max_diff": diff,
      "dtype": FLAGS.dtype,
      "stages": plan.num_stages,
      "depth": plan.depth(),
    }
    print(
      f"{name}: {plan.num_stages} stages (depth {plan.depth()}), loss {one[0]:.4f} -> "
      f"{one[-1]:.4f} over {FLAGS.steps} steps, max |pipelined - one device| = {diff:.2e}"
    )
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(results, f)


if __name__ == "__main__":
  app.run(main)
