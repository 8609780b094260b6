"""Sensitivity of the predictions to a shared network interface per node.

The simulator gives every stage pair a link of its own. On a real cluster the transfers that
enter one node share its InfiniBand interface. For MMT, DLRM (as the paper describes it) and
CANDLE-Uno on the V100 preset, this plans with GraphPipe and with PipeDream (published and
polished) as usual, then simulates each plan twice: with a link per stage pair (what the
planners saw) and with one shared inbound interface per node (``simulate(shared_nic=True)``),
and prints the throughputs and their ratio (shared / per-pair).

  python benchmarks/shared_nic.py
  python benchmarks/shared_nic.py --models=mmt --devices=32
"""

from __future__ import annotations

from typing import Any

from absl import app, flags

from gpp_jax.cost.cluster import v100_cluster
from gpp_jax.experiments.planner_runs import PER_DEVICE_BATCH, build_graph
from gpp_jax.passes.partition import PLANNERS
from gpp_jax.passes.simulation import simulate

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["mmt", "dlrm", "candle_uno"], "Model presets to plan.")
flags.DEFINE_list("devices", ["16", "32"], "Device counts.")

PLANS: tuple[tuple[str, str, dict[str, Any]], ...] = (
  ("GraphPipe", "graphpipe", {}),
  ("PD pub", "pipedream", {"selection": "published"}),
  ("PD", "pipedream", {}),
)


def main(argv):
  del argv
  print(
    f"{'model':10s} {'dev':>3s} {'planner':9s} {'stages':>6s} {'per-pair/s':>10s} "
    f"{'shared/s':>9s} {'shared / per-pair':>17s} {'vs PD pub (shared)':>18s}"
  )
  for model in FLAGS.models:
    for k in map(int, FLAGS.devices):
      batch = PER_DEVICE_BATCH[model] * k
      graph = build_graph(model, "paper", batch)
      cluster = v100_cluster(k)
      out = {}
      for label, name, opts in PLANS:
        plan = PLANNERS[name](graph, cluster, batch, **opts)
        shared = simulate(plan, graph, cluster, shared_nic=True)
        out[label] = (plan, batch / plan.predicted["iteration_time"], shared.throughput(batch))
      for label, (plan, own, shared) in out.items():
        print(
          f"{model:10s} {k:3d} {label:9s} {plan.num_stages:6d} {own:10.1f} {shared:9.1f} "
          f"{shared / own:17.3f} {shared / out['PD pub'][2]:18.3f}",
          flush=True,
        )


if __name__ == "__main__":
  app.run(main)
