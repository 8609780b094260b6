"""Planner benchmark: GraphPipe vs the sequential planners on the paper's models and cluster.

For MMT, DLRM and CANDLE-Uno at the paper's shapes on the V100 preset (4 GPUs per node,
NVLink, 100 Gb/s between nodes) at 4, 8, 16 and 32 devices, runs every planner, and prints
side by side the simulated throughput of GraphPipe's plan and of the best sequential plan
(PipeDream, Piper, BaPipe, Luo et al.), and each planner's search time.

  python benchmarks/planners.py
  python benchmarks/planners.py --models=candle_uno --devices=8,16 --json=/tmp/planners.json

The mini-batch grows with the device count (``--per_device_batch``), as the paper sizes
mini-batches "close to the memory limit"; the paper's exact sizes are not recoverable.
"""

from __future__ import annotations

import json

from absl import app, flags

from gpp_jax.cost.cluster import v100_cluster
from gpp_jax.experiments.planner_runs import (
  PER_DEVICE_BATCH,
  best_row,
  build_graph,
  run_planner,
  short_error,
)
from gpp_jax.passes.partition import SEQUENTIAL_PLANNERS

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["mmt", "dlrm", "candle_uno"], "Model presets to plan.")
flags.DEFINE_list("devices", ["4", "8", "16", "32"], "Device counts.")
flags.DEFINE_list("planners", list(SEQUENTIAL_PLANNERS), "Sequential planners to compare.")
flags.DEFINE_string(
  "per_device_batch",
  ",".join(f"{m}={PER_DEVICE_BATCH[m]}" for m in ("mmt", "dlrm", "candle_uno")),
  "Samples per device of the mini-batch, per model.",
)
flags.DEFINE_integer("candle_branches", 7, "CANDLE-Uno branch count (the paper sweeps 2-16).")
flags.DEFINE_string("json", "", "Also write the results to this JSON file.")


def main(argv):
  del argv
  per_dev = dict(kv.split("=") for kv in FLAGS.per_device_batch.split(","))
  rows = []
  header = (
    f"{'model':11s} {'dev':>3s} {'batch':>5s} | {'GraphPipe/s':>11s} {'S/D':>5s} "
    f"{'mb':>4s} | {'best seq/s':>10s} {'by':>9s} {'S':>3s} {'mb':>4s} | {'GP/seq':>6s} | "
    + " ".join(f"{n[:9]:>9s}" for n in ["graphpipe"] + FLAGS.planners)
    + "  (search s)"
  )
  print(header)
  print("-" * len(header))
  for model in FLAGS.models:
    for k in map(int, FLAGS.devices):
      batch = int(per_dev[model]) * k
      shape = {"branches": FLAGS.candle_branches} if model == "candle_uno" else {}
      graph = build_graph(model, "paper", batch, **shape)
      cluster = v100_cluster(k)
      results = [run_planner("graphpipe", graph, cluster, batch)]
      results += [run_planner(n, graph, cluster, batch) for n in FLAGS.planners]
      for r in results:
        if "error" in r:
          r["error"] = short_error(r)
      gp = results[0]
      best = best_row(results[1:], FLAGS.planners)
      times = " ".join(
        f"{r['seconds']:9.2f}" if "throughput" in r else f"{'limit':>9s}" for r in results
      )
      if "throughput" in gp and best:
        ratio = gp["throughput"] / best["throughput"]
        print(
          f"{model:11s} {k:3d} {batch:5d} | {gp['throughput']:11.1f} "
          f"{gp['stages']:2d}/{gp['depth']:<2d} {gp['microbatch']:4d} | "
          f"{best['throughput']:10.1f} {best['planner']:>9s} {best['stages']:3d} "
          f"{best['microbatch']:4d} | {ratio:6.3f} | {times}",
          flush=True,
        )
      else:
        print(
          f"{model:11s} {k:3d} {batch:5d} | no comparison: "
          f"{gp.get('error') or 'no sequential plan'} | {times}",
          flush=True,
        )
      rows.append({"model": model, "devices": k, "batch": batch, "results": results})
  gp_times = [r["results"][0]["seconds"] for r in rows]
  print(
    f"\nGraphPipe search time: max {max(gp_times):.2f} s, mean "
    f"{sum(gp_times) / len(gp_times):.2f} s over {len(rows)} configurations"
  )
  for r in rows:
    for x in r["results"]:
      if "error" in x:
        print(f"  {r['model']} x{r['devices']}: {x['error']}")
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  app.run(main)
