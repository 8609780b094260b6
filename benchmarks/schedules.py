"""Simulated bubble fraction, throughput and peak activation memory of 1F1B, graph-1F1B and
zero-bubble on the MMT and CANDLE-Uno plans.

  python benchmarks/schedules.py [--devices=8] [--microbatches=8] [--cluster=v100]

For each model, GraphPipe plans once (with 1F1B, ``--microbatches`` fixed); the same plan (the
same stages, devices and micro-batches) is then simulated under each schedule, side by side:
iteration time, throughput, bubble fraction (idle share of the iteration, averaged over stages
and on the busiest stage, the one that sets the throughput), and per stage the peak micro-batches held against the schedule's bound
(1F1B: its in-flight count; zero-bubble: the memory bound from device memory, and again with
the 1F1B counts as the bound, ZB-H1's budget).
"""

from __future__ import annotations

import dataclasses
import time

from absl import app, flags

from gpp_jax.cost.cluster import make_cluster
from gpp_jax.cost.simulator import simulate
from gpp_jax.experiments.model_graphs import model_graph
from gpp_jax.passes.inflight import inflight_counts
from gpp_jax.passes.partition import get_planner
from gpp_jax.passes.partition.plan_assembly import memory_bound
from gpp_jax.passes.schedules import make_schedule

FLAGS = flags.FLAGS
flags.DEFINE_integer("devices", 8, "devices of the cluster")
flags.DEFINE_integer("microbatches", 8, "micro-batches per iteration")
flags.DEFINE_string("cluster", "v100", "cluster preset (gpp_jax.cost.cluster.make_cluster)")
flags.DEFINE_list("models", ["mmt", "candle_uno"], "model graphs (experiments.model_graphs)")


def row(name, res, batch, bound):
  mean_bubble = sum(res.bubble) / len(res.bubble)
  held = " ".join(f"{p}/{b}" for p, b in zip(res.peak_in_flight, bound))
  act = max(res.stage_memory) / 2**30
  print(
    f"  {name:24s} iter {res.iteration_time * 1e3:9.2f} ms  {res.throughput(batch):9.1f} "
    f"samples/s  bubble mean {mean_bubble:6.1%} busiest stage {min(res.bubble):6.1%}  "
    f"peak mem {act:6.2f} GiB  held/bound {held}"
  )
  return mean_bubble, min(res.bubble)


def main(argv):
  del argv
  cluster = make_cluster(FLAGS.cluster, FLAGS.devices)
  M = FLAGS.microbatches
  for name in FLAGS.models:
    g = model_graph(name)
    B = int(g.graph["batch_size"])
    t0 = time.perf_counter()
    plan = get_planner("graphpipe")(g, cluster, B, num_microbatches=M)
    print(
      f"{name}: batch {B}, {plan.num_stages} stages (depth {plan.depth()}), M={M}, "
      f"{FLAGS.cluster} x{FLAGS.devices}, planned in {time.perf_counter() - t0:.1f} s"
    )
    S, edges = plan.num_stages, tuple(plan.edges)
    L = inflight_counts(S, edges, num_microbatches=M).microbatches
    mem = memory_bound(plan, g, cluster)
    out = {}
    for sched_name, bound in (
      ("1f1b", L),
      ("graph-1f1b", L),
      ("zero-bubble (1F1B bound)", L),
      ("zero-bubble (memory bound)", mem),
    ):
      gen = sched_name.split(" ")[0]
      sched = make_schedule(gen, S, edges, M, memory_bound=bound if gen == "zero-bubble" else None)
      p = plan.replace(
        schedule=gen,
        stages=tuple(dataclasses.replace(s, in_flight=b) for s, b in zip(plan.stages, bound)),
      )
      out[sched_name] = row(sched_name, simulate(p, g, cluster, schedule=sched), B, bound)
    for k, what in enumerate(("mean", "busiest-stage")):
      base = out["1f1b"][k]
      zb = [out[f"zero-bubble ({b} bound)"][k] / base if base else float("nan") for b in ("memory", "1F1B")]
      print(
        f"  zero-bubble / 1F1B {what} bubble: {zb[0]:.2f} (memory bound), {zb[1]:.2f} (1F1B bound)"
      )


if __name__ == "__main__":
  app.run(main)
