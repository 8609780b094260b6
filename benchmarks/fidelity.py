"""Simulator fidelity: predicted vs measured step time of the tiny zoo models on forced CPU
devices, after calibrating every layer's forward and backward time on the device.

  python benchmarks/fidelity.py

For each model (GraphPipe plan, 8 devices, 8 micro-batches) prints the measured median step
time and two predictions side by side:
  devices   the simulator as the planners use it: each device computes independently;
  host      the same schedule issued by one host thread in the driver's dispatch order, at
            the measured host cost per action, on the machine's cores (forced CPU devices
            share them), plus the measured host time the step spends outside the pipeline.
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
from gpp_jax.cli.reporting import host_aware_time, predicted_timeline
from gpp_jax.cost.cluster import cpu_cluster
from gpp_jax.experiments import zoo

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["mmt", "dlrm", "candle_uno"], "tiny zoo models")
flags.DEFINE_integer("batch_size", 64, "examples per step")
flags.DEFINE_integer("microbatches", 8, "micro-batches per step")
flags.DEFINE_integer("repeats", 10, "timed steps")


def measure(model_name):
  run = zoo.setup(model_name)
  data = run.batches(FLAGS.batch_size, 2)
  n = 8
  cluster = cpu_cluster(n)
  pp = gpp_jax.graph_pipeline(
    run.train_step,
    num_microbatches=FLAGS.microbatches,
    devices=jax.devices()[:n],
    planner="graphpipe",
    cluster=cluster,
    calibrate=True,
    layer_depth=run.spec.layer_depth,
  )
  for i in range(3):
    jax.block_until_ready(pp(run.model, run.optimizer, data[i % 2]))
  wall, host_out, dispatch = [], [], []
  for i in range(FLAGS.repeats):
    t = time.perf_counter()
    loss = pp(run.model, run.optimizer, data[i % 2])
    t_host = time.perf_counter() - t
    jax.block_until_ready((loss, jax.tree.leaves(run.model)))
    wall.append(time.perf_counter() - t)
    tl = pp.timeline
    host_out.append(t_host - tl.total)
    dispatch.extend(e.end - e.start for e in tl.events)
  plain = predicted_timeline(pp, cluster).iteration_time
  d = statistics.median(dispatch)
  hosted = host_aware_time(
    pp, cluster, d, statistics.median(host_out), len(os.sched_getaffinity(0))
  )
  return pp.plan, statistics.median(wall), plain, hosted, d


def main(_):
  print(
    f"{'model':12s} {'stages':>6s} {'depth':>5s} {'measured':>10s} {'devices':>10s} {'err':>6s} "
    f"{'host':>10s} {'err':>6s}  host us/action"
  )
  for name in FLAGS.models:
    plan, meas, plain, hosted, d = measure(name)
    print(
      f"{name:12s} {plan.num_stages:6d} {plan.depth():5d} {meas * 1e3:8.1f}ms "
      f"{plain * 1e3:8.1f}ms {abs(plain - meas) / meas * 100:5.0f}% {hosted * 1e3:8.1f}ms "
      f"{abs(hosted - meas) / meas * 100:5.0f}%  {d * 1e6:.0f}"
    )


if __name__ == "__main__":
  app.run(main)
