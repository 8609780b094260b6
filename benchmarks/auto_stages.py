"""What ``stages_per_device="auto"`` costs and chooses, against one stage per device.

GraphPipe on MMT and DLRM (the paper's shapes, batch 256) on 32 V100s (the preset), at few
and many micro-batches, in one process: the v = 1 plan and its search seconds, the plan
``"auto"`` keeps (v, predicted ms) and its search seconds, and the v = 1 plan's smallest
stage bubble, which decides whether ``"auto"`` searches at all
(``passes.partition.shared.bubble_leaves_room``). Predictions are modelled; the seconds are
measured on this machine.

  python benchmarks/auto_stages.py
  python benchmarks/auto_stages.py --devices=64 --microbatches=8,128
"""

from __future__ import annotations

import time

from absl import app, flags

from gpp_jax.cost.cluster import v100_cluster
from gpp_jax.experiments import model_graphs as mg
from gpp_jax.passes.partition import PLANNERS

FLAGS = flags.FLAGS
flags.DEFINE_integer("devices", 32, "V100s")
flags.DEFINE_integer("batch_size", 256, "samples per step")
flags.DEFINE_list("microbatches", ["4", "64"], "micro-batch counts")
flags.DEFINE_list("models", ["mmt", "dlrm"], "model_graphs builders")


def main(argv) -> None:
  del argv
  B = FLAGS.batch_size
  cluster = v100_cluster(FLAGS.devices)
  planner = PLANNERS["graphpipe"]
  print(
    f"{'model':6s} {'M':>4s} {'v=1 ms':>9s} {'search s':>8s} {'auto v':>6s} {'auto ms':>9s} "
    f"{'search s':>8s} {'x v=1':>6s} {'min bubble':>10s}"
  )
  for name in FLAGS.models:
    g = getattr(mg, name)(batch_size=B)
    for M in map(int, FLAGS.microbatches):
      t = time.perf_counter()
      one = planner(g, cluster, B, num_microbatches=M)
      t1 = time.perf_counter() - t
      t = time.perf_counter()
      auto = planner(g, cluster, B, num_microbatches=M, stages_per_device="auto")
      t2 = time.perf_counter() - t
      print(
        f"{name:6s} {M:4d} {one.predicted['iteration_time'] * 1e3:9.2f} {t1:8.2f} "
        f"{auto.stages_per_device:6d} {auto.predicted['iteration_time'] * 1e3:9.2f} {t2:8.2f} "
        f"{t2 / t1:6.1f} {min(one.predicted['bubble']):10.3f}",
        flush=True,
      )


if __name__ == "__main__":
  app.run(main)
