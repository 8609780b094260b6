"""Driver overhead and 2-device speed-up on the forced CPU devices.

  python benchmarks/driver.py

Prints, measured side by side in one run:
  * host-side driver overhead per action (µs) on a tiny model;
  * 1-stage pipelined step / plain jitted step running the same micro-batch loop (target <= 1.10);
  * a 2-stage chain of small ops on 2 devices vs the same pipeline on 1 device, 8 micro-batches
    (target >= 1.6 on 2 cores).
"""

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
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
flags.DEFINE_integer("repeats", 15, "timed steps per configuration (median reported)")
flags.DEFINE_integer("microbatches", 8, "micro-batches per step")
flags.DEFINE_integer("chain_width", 128, "width of the small-op chain (small enough for one core)")
flags.DEFINE_integer("chain_depth", 8, "layers of the small-op chain (half per stage)")
flags.DEFINE_integer("chain_microbatch", 32, "micro-batch size of the small-op chain")
flags.DEFINE_integer("chain_inner", 40, "small matmuls per layer of the chain (a fori_loop)")


def mlp_params(key, width, depth, din):
  ks = jax.random.split(key, depth)
  sizes = [din] + [width] * depth
  return {
    f"l{i:02d}": {
      "w": jax.random.normal(ks[i], (sizes[i], sizes[i + 1])) / np.sqrt(sizes[i]),
      "b": jnp.zeros(sizes[i + 1]),
    }
    for i in range(depth)
  }


def mlp(p, x, inner=1):
  for k in sorted(p):
    w, b = p[k]["w"], p[k]["b"]
    if inner == 1:
      x = jnp.tanh(x @ w + b)
    else:  # many small ops per layer: long single-core actions with few arguments
      x = jax.lax.fori_loop(0, inner, lambda i, h, w=w, b=b: jnp.tanh(h @ w + b), x)
  return x


def make_step(tx, inner=1):
  def step(params, opt_state, batch):
    loss, grads = gpp_jax.value_and_grad(
      lambda p: jnp.mean((mlp(p, batch["x"], inner) - batch["y"]) ** 2)
    )(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def plain_microbatch_loop(tx, M):
  """The reference: jitted grad per micro-batch, accumulated, then a jitted update."""

  @jax.jit
  def grad_mb(params, x, y, acc):
    l, g = jax.value_and_grad(lambda p: jnp.mean((mlp(p, x) - y) ** 2))(params)
    return l, jax.tree.map(lambda a, b: a + b / M, acc, g)

  @jax.jit
  def update(params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  zeros = jax.jit(lambda p: jax.tree.map(jnp.zeros_like, p))

  def step(params, opt_state, batch):
    xs = np.split(batch["x"], M)
    ys = np.split(batch["y"], M)
    acc = zeros(params)
    losses = []
    for m in range(M):
      l, acc = grad_mb(params, jax.device_put(xs[m]), jax.device_put(ys[m]), acc)
      losses.append(l)
    params, opt_state = update(params, opt_state, acc)
    return params, opt_state, sum(losses) / M

  return step


def timed(step, params, opt_state, batch, repeats):
  """Median step time; each step gets the state the previous one returned, as in training."""
  params, opt_state, loss = step(params, opt_state, batch)  # compile
  jax.block_until_ready(loss)
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    params, opt_state, loss = step(params, opt_state, batch)
    jax.block_until_ready((params, opt_state, loss))
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def batch_of(n, din, dout, seed=0):
  rng = np.random.default_rng(seed)
  return {
    "x": rng.normal(size=(n, din)).astype(np.float32),
    "y": rng.normal(size=(n, dout)).astype(np.float32),
  }


def main(_):
  M = FLAGS.microbatches
  devs = jax.devices()
  tx = optax.adam(1e-3)
  one = gpp_jax.manual_plan({"": 0})

  # 1. Overhead per action: a tiny model, so the step time is driver time.
  p = mlp_params(jax.random.key(0), 8, 2, 4)
  b = batch_of(8 * M, 4, 8)
  pp = gpp_jax.graph_pipeline(
    make_step(tx),
    num_microbatches=M,
    devices=devs[:2],
    planner=gpp_jax.manual_plan({"l00": 0, "l01": 1}),
  )
  t_tiny = timed(pp, p, tx.init(p), b, FLAGS.repeats)
  n_actions = sum(len(l) for l in pp.schedule.lanes)
  disp = [e.end - e.start for e in pp.timeline.events]
  print(
    f"driver: tiny 2-stage step {t_tiny * 1e3:.2f} ms for {n_actions} actions = "
    f"{t_tiny / n_actions * 1e6:.0f} us per action all-in; host dispatch per action "
    f"median {statistics.median(disp) * 1e6:.0f} us"
  )

  # 2. 1-stage pipeline vs plain jitted micro-batch loop, moderate compute.
  p = mlp_params(jax.random.key(1), 512, 4, 256)
  b = batch_of(64 * M, 256, 512)
  pp1 = gpp_jax.graph_pipeline(make_step(tx), num_microbatches=M, devices=devs[:1], planner=one)
  plain = plain_microbatch_loop(tx, M)
  t_plain = timed(
    plain, jax.device_put(p, devs[0]), jax.device_put(tx.init(p), devs[0]), b, FLAGS.repeats
  )
  t_pp1 = timed(pp1, p, tx.init(p), b, FLAGS.repeats)
  print(
    f"1-stage pipeline {t_pp1 * 1e3:.2f} ms vs plain jitted micro-batch loop "
    f"{t_plain * 1e3:.2f} ms: ratio {t_pp1 / t_plain:.3f} (target <= 1.10)"
  )

  # 3. 2-stage chain of small ops on 2 devices vs 1 device.
  w, depth = FLAGS.chain_width, FLAGS.chain_depth
  p = mlp_params(jax.random.key(2), w, depth, w)
  b = batch_of(FLAGS.chain_microbatch * M, w, w)
  half = {f"l{i:02d}": (0 if i < depth // 2 else 1) for i in range(depth)}
  step = make_step(tx, FLAGS.chain_inner)
  pp_2 = gpp_jax.graph_pipeline(
    step, num_microbatches=M, devices=devs[:2], planner=gpp_jax.manual_plan(half)
  )
  pp_1 = gpp_jax.graph_pipeline(step, num_microbatches=M, devices=devs[:1], planner=one)
  t1 = timed(pp_1, p, tx.init(p), b, FLAGS.repeats)
  t2 = timed(pp_2, p, tx.init(p), b, FLAGS.repeats)
  print(
    f"2-stage chain on 2 devices {t2 * 1e3:.2f} ms vs 1 device {t1 * 1e3:.2f} ms: "
    f"speed-up {t1 / t2:.2f}x (target >= 1.6; ideal 2M/(M+1) = {2 * M / (M + 1):.2f})"
  )


if __name__ == "__main__":
  app.run(main)
