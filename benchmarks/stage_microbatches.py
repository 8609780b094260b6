"""Per-stage micro-batch sizes against one size, measured on forced CPU devices.

  python benchmarks/stage_microbatches.py [--batch=64] [--hidden=256] [--repeats=15]

A four-stage DAG (an input layer, two branches, a head that also reads the input layer's output
through a skip edge) on four forced CPU devices, 1F1B, run with three plans side by side: one
size for every stage (``--uniform`` micro-batches, and half as many), and per-stage sizes
(``--sizes``, one per stage). Prints each plan's first call (capture, staging and compilation:
per-stage sizes capture the step once per distinct size) and the median step time of
``--repeats`` steps, the plans interleaved step by step so that load from elsewhere on the
machine hits all alike, with ratios to the first plan.
"""

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
)

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

import gpp_jax

FLAGS = flags.FLAGS
flags.DEFINE_integer("batch", 64, "samples per step")
flags.DEFINE_integer("hidden", 256, "width of the layers")
flags.DEFINE_integer("uniform", 8, "micro-batches of the one-size plan")
flags.DEFINE_list("sizes", ["16", "8", "8", "16"], "per-stage micro-batch sizes")
flags.DEFINE_integer("repeats", 15, "timed steps per plan (median)")

RULES = {"inp": 0, "left": 1, "right": 2, "head": 3}


def _dense(key, a: int, b: int) -> dict:
  return {"w": jax.random.normal(key, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)}


def _model(p, x):
  h = jnp.tanh(x @ p["inp"]["w"] + p["inp"]["b"])
  a = jnp.tanh(h @ p["left"]["w"] + p["left"]["b"])
  b = jax.nn.relu(h @ p["right"]["w"] + p["right"]["b"])
  z = jnp.concatenate([a, b, h], axis=-1)
  return z @ p["head"]["w"] + p["head"]["b"]


def main(argv) -> None:
  del argv
  B, H = FLAGS.batch, FLAGS.hidden
  ks = jax.random.split(jax.random.key(0), 4)
  params = {
    "inp": _dense(ks[0], H, H),
    "left": _dense(ks[1], H, H),
    "right": _dense(ks[2], H, H),
    "head": _dense(ks[3], 3 * H, 8),
  }
  tx = optax.adam(1e-3)

  def step(params, opt_state, batch):
    def loss_fn(p):
      return jnp.mean((_model(p, batch["x"]) - batch["y"]) ** 2)

    loss, grads = gpp_jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  rng = np.random.default_rng(0)
  batch = {
    "x": rng.normal(size=(B, H)).astype(np.float32),
    "y": rng.normal(size=(B, 8)).astype(np.float32),
  }
  sizes = [int(s) for s in FLAGS.sizes]
  M = FLAGS.uniform
  plans = {
    f"one size {B // M} ({M} micro-batches)": (M, gpp_jax.manual_plan(RULES)),
    f"one size {2 * B // M} ({M // 2} micro-batches)": (M // 2, gpp_jax.manual_plan(RULES)),
    f"per-stage sizes {sizes}": (
      M,
      gpp_jax.manual_plan(RULES, microbatch_sizes=dict(enumerate(sizes))),
    ),
  }
  runs, state, first = {}, {}, {}
  for name, (m, plan) in plans.items():
    runs[name] = gpp_jax.graph_pipeline(
      step, num_microbatches=m, devices=jax.devices()[:4], planner=plan, schedule="1f1b"
    )
    t = time.perf_counter()
    state[name] = runs[name](params, tx.init(params), batch)
    jax.block_until_ready(state[name])
    first[name] = time.perf_counter() - t
  times: dict[str, list[float]] = {name: [] for name in plans}
  for _ in range(FLAGS.repeats):
    for name, run in runs.items():
      t = time.perf_counter()
      state[name] = run(state[name][0], state[name][1], batch)
      jax.block_until_ready(state[name])
      times[name].append(time.perf_counter() - t)
  base = next(iter(plans))
  print(f"batch {B}, hidden {H}, {FLAGS.repeats} steps per plan, 4 forced CPU devices, 1F1B")
  print(f"{'plan':40s} {'counts':>14s} {'first call s':>13s} {'step ms':>9s} {'ratio':>6s}")
  for name in plans:
    med = statistics.median(times[name])
    counts = str(list(runs[name].schedule.stage_counts))
    print(
      f"{name:40s} {counts:>14s} {first[name]:13.2f} {med * 1e3:9.2f} "
      f"{med / statistics.median(times[base]):6.2f}"
    )


if __name__ == "__main__":
  app.run(main)
