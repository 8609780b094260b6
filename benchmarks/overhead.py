"""Host overhead of the decorated step against ``nnx.jit``: what a user pays per call.

NNX models of 10, 100 and 300 ``nnx.Linear`` layers (width ``--width``), adam, one device,
one micro-batch: per call, side by side in one run, in turns (``--rounds`` rounds of
``--calls`` calls each, the median of the per-round means):

  * ``nnx.jit`` of the step;
  * ``graph_pipeline`` of the step, decorated only (``num_microbatches=1``: plain jit chosen);
  * ``graph_pipeline(...).cached_partial(model, optimizer)``;
  * ``nnx.cached_partial(nnx.jit(step), model, optimizer)``;
  * bare ``jax.jit`` of the functional step (``nnx.split`` once, state in and out).

Printed: ms per call and the ratios decorated / nnx.jit, cached / nnx.cached_partial and
both against bare ``jax.jit`` (measured). Targets: decorated <= 1.0x nnx.jit, cached <=
nnx.cached_partial, and on a GPU cached <= 1.05x bare ``jax.jit``.

  python benchmarks/overhead.py
  python benchmarks/overhead.py --layers=100 --rounds=5
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from flax import nnx

import gpp_jax

FLAGS = flags.FLAGS
flags.DEFINE_list("layers", ["10", "100", "300"], "Linear layers per model")
flags.DEFINE_integer("width", 16, "layer width")
flags.DEFINE_integer("batch", 8, "examples per step")
flags.DEFINE_integer("calls", 30, "calls per round")
flags.DEFINE_integer("rounds", 5, "rounds (the configurations take turns)")


class Deep(nnx.Module):
  def __init__(self, n: int, width: int, rngs: nnx.Rngs):
    self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(n)])

  def __call__(self, x):
    for layer in self.layers:
      x = jnp.tanh(layer(x))
    return x


def step(model, optimizer, batch):
  def loss_fn(model):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

  loss, grads = gpp_jax.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


def nnx_step(model, optimizer, batch):
  def loss_fn(model):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


def fresh(n: int):
  model = Deep(n, FLAGS.width, nnx.Rngs(0))
  return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)


def configurations(n: int, batch) -> dict:
  """name -> a no-argument function running one step (each on its own model)."""
  dev = jax.devices()[0]
  out = {}
  m, o = fresh(n)
  jitted = nnx.jit(nnx_step)
  out["nnx.jit"] = lambda: jitted(m, o, batch)
  m2, o2 = fresh(n)
  pp = gpp_jax.graph_pipeline(step, num_microbatches=1, devices=[dev])
  out["graph_pipeline"] = lambda: pp(m2, o2, batch)
  m3, o3 = fresh(n)
  pc = gpp_jax.graph_pipeline(step, num_microbatches=1, devices=[dev]).cached_partial(m3, o3)
  out["graph_pipeline cached"] = lambda: pc(batch)
  m4, o4 = fresh(n)
  nc = nnx.cached_partial(nnx.jit(nnx_step), m4, o4)
  out["nnx.cached_partial"] = lambda: nc(batch)
  m5, o5 = fresh(n)
  graphdef, state = nnx.split((m5, o5))

  @jax.jit
  def functional(state, batch):
    model, opt = nnx.merge(graphdef, state)
    loss = nnx_step(model, opt, batch)
    return nnx.state((model, opt)), loss

  holder = [jax.device_put(state, dev)]

  def bare():
    holder[0], loss = functional(holder[0], batch)
    return loss

  out["jax.jit (functional)"] = bare
  return out


def main(argv) -> None:
  del argv
  rng = np.random.default_rng(0)
  batch = {
    "x": jnp.asarray(rng.normal(size=(FLAGS.batch, FLAGS.width)), jnp.float32),
    "y": jnp.asarray(rng.normal(size=(FLAGS.batch, FLAGS.width)), jnp.float32),
  }
  print(f"ms per call, one device ({jax.devices()[0].platform}), measured; median of rounds")
  for n in map(int, FLAGS.layers):
    confs = configurations(n, batch)
    for f in confs.values():  # compile and warm up
      for _ in range(3):
        jax.block_until_ready(f())
    per: dict[str, list[float]] = {k: [] for k in confs}
    for _ in range(FLAGS.rounds):
      for name, f in confs.items():
        t = time.perf_counter()
        for _ in range(FLAGS.calls):
          out = f()
        jax.block_until_ready(out)
        per[name].append((time.perf_counter() - t) / FLAGS.calls * 1e3)
    ms = {k: statistics.median(v) for k, v in per.items()}
    cells = "  ".join(f"{k} {v:.3f}" for k, v in ms.items())
    print(f"{n:4d} layers: {cells}")
    print(
      f"           decorated / nnx.jit {ms['graph_pipeline'] / ms['nnx.jit']:.2f}x, "
      f"cached / nnx.cached_partial "
      f"{ms['graph_pipeline cached'] / ms['nnx.cached_partial']:.2f}x, "
      f"decorated / jax.jit {ms['graph_pipeline'] / ms['jax.jit (functional)']:.2f}x, "
      f"cached / jax.jit {ms['graph_pipeline cached'] / ms['jax.jit (functional)']:.2f}x"
    )


if __name__ == "__main__":
  app.run(main)
