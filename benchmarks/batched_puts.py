"""Transfers between stages put together or one by one: the same plan's step, side by side.

  python benchmarks/batched_puts.py --models=mmt,dlrm --planner=balanced --devices=4

For each zoo model (tiny), one ``graph_pipeline`` of the planner's plan is built twice: as the
executor runs it (each run of consecutive transfers between stages one ``jax.device_put`` per
destination sharding, ``runtime.executor._batched_sends``) and with every transfer put on its
own. The two steps then take turns (``--steps`` each, after warm-up) so that a busy spell of
the machine falls on both; prints the median wall time of each and their ratio.
"""

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import statistics
import time

import jax
from absl import app, flags

import gpp_jax
from gpp_jax.experiments import zoo
from gpp_jax.runtime import executor

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["mmt", "dlrm", "candle_uno"], "zoo models (tiny)")
flags.DEFINE_string("planner", "balanced", "planner of the plan both steps run")
flags.DEFINE_integer("devices", 4, "forced CPU devices")
flags.DEFINE_integer("batch_size", 64, "examples per step")
flags.DEFINE_integer("microbatches", 4, "micro-batches per step")
flags.DEFINE_integer("steps", 15, "timed steps of each (median reported)")


def built(model: str, batched: bool):
  """(the cached step, its run, its batches), the executor batching transfers or not."""
  keep = executor._batched_sends
  if not batched:
    executor._batched_sends = lambda code, instrs: list(code)
  try:
    run = zoo.setup(model, "tiny")
    data = run.batches(FLAGS.batch_size, 2)
    pp = gpp_jax.graph_pipeline(
      run.train_step,
      num_microbatches=FLAGS.microbatches,
      devices=jax.devices()[: FLAGS.devices],
      planner=FLAGS.planner,
      layer_depth=run.spec.layer_depth,
    )
    train = pp.cached_partial(run.model, run.optimizer)
    for i in range(3):  # compiles, with the executor as set above
      jax.block_until_ready(train(data[i % 2]))
  finally:
    executor._batched_sends = keep
  return train, run, data, pp


def main(_):
  for model in FLAGS.models:
    steps = {"together": built(model, True), "one by one": built(model, False)}
    times: dict[str, list[float]] = {k: [] for k in steps}
    for i in range(FLAGS.steps):
      for name, (train, run, data, _) in steps.items():
        t = time.perf_counter()
        jax.block_until_ready((train(data[i % 2]), jax.tree.leaves(run.model)))
        times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    pp = steps["together"][3]
    shape = "+".join(str(len(s.devices)) for s in pp.plan.stages)
    print(
      f"{model} ({FLAGS.planner}, stages {shape}, M={FLAGS.microbatches}): "
      f"together {med['together']:.2f} ms, one by one {med['one by one']:.2f} ms, "
      f"ratio {med['together'] / med['one by one']:.2f}"
    )


if __name__ == "__main__":
  app.run(main)
