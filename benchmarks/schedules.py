"""Simulated bubble fraction, throughput and peak activation memory of 1F1B, graph-1F1B and
zero-bubble on the MMT and CANDLE-Uno plans.

  python benchmarks/schedules.py [--devices=8] [--microbatches=8] [--cluster=v100]
  python benchmarks/schedules.py --measure [--measure_devices=4] [--repeats=5]

For each model, GraphPipe plans once (with 1F1B, ``--microbatches`` fixed); the same plan (the
same stages, devices and micro-batches) is then simulated under each schedule, side by side:
iteration time, throughput, bubble fraction (idle share, averaged over stages and on the
busiest stage, the one that sets the throughput; over the whole iteration and up to the last
F/B/W, i.e. without the gradient all-reduce and optimizer tail every schedule shares), and per
stage the peak micro-batches held against the schedule's bound (1F1B: its in-flight count;
zero-bubble: the memory bound from device memory, and again with the 1F1B counts as the bound,
ZB-H1's budget).

Then the steps in a row (``--stream_steps`` = K): 1F1B with its flush after every step (K
times one step) beside PipeDream's 1F1B without flushes (``pipedream-async`` over K steps,
``passes.schedules.stream_schedule``, what ``GraphPipeline.run_steps`` issues): time per step,
throughput and bubble over the K steps.

With ``--measure`` it also runs the tiny zoo MMT and CANDLE-Uno on forced CPU devices: one
GraphPipe plan per model, run under each schedule, the schedules interleaved step by step;
the median step time of ``--repeats`` steps (throughput) and, from as many steps with
``measure=True`` (each stage blocks on every action), the median measured bubble fraction per
stage (1 - busy / step span); and ``pipedream-async`` over K steps, as K calls and as one
``run_steps`` (no flush), each waiting for the devices once at the end.
"""

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import dataclasses
import statistics
import time

import numpy as np
from absl import app, flags

from gpp_jax.cost.cluster import make_cluster
from gpp_jax.cost.cost_model import plan_costs
from gpp_jax.experiments.model_graphs import model_graph
from gpp_jax.passes.inflight import inflight_counts
from gpp_jax.passes.partition import get_planner
from gpp_jax.passes.partition.plan_assembly import memory_bound
from gpp_jax.passes.schedules import make_schedule, stream_schedule
from gpp_jax.passes.simulation import simulate

FLAGS = flags.FLAGS
flags.DEFINE_integer("devices", 8, "devices of the cluster")
flags.DEFINE_integer("microbatches", 8, "micro-batches per iteration")
flags.DEFINE_string("cluster", "v100", "cluster preset (gpp_jax.cost.cluster.make_cluster)")
flags.DEFINE_list("models", ["mmt", "candle_uno"], "model graphs (experiments.model_graphs)")
flags.DEFINE_bool("measure", False, "also run the tiny zoo models on forced CPU devices")
flags.DEFINE_integer("measure_devices", 4, "forced CPU devices of the measured runs")
flags.DEFINE_integer("measure_batch", 32, "batch of the measured runs")
flags.DEFINE_integer("repeats", 9, "timed steps per schedule (median)")
flags.DEFINE_integer("stream_steps", 8, "steps in a row for the flush / no-flush comparison")
flags.DEFINE_bool(
  "stream_medium",
  False,
  "also time K calls vs one run_steps stream on CANDLE-Uno at the scaling benchmark's medium "
  "size, 2 stages on 2 forced CPU devices",
)
MEASURED_SCHEDULES = ("1f1b", "graph-1f1b", "zero-bubble", "pipedream-async")


def measured(name: str) -> None:
  """Runs the tiny zoo model under each schedule on one plan, the schedules interleaved step by
  step (so load from elsewhere on the machine hits all alike); prints medians."""
  import jax

  import gpp_jax
  from gpp_jax.experiments import zoo

  devices = jax.devices()[: FLAGS.measure_devices]
  plan = None
  print(f"{name} (tiny zoo model), {len(devices)} forced CPU devices, M={FLAGS.microbatches}:")
  runs = {}
  for sched in MEASURED_SCHEDULES:
    run = zoo.setup(name)
    (batch,) = run.batches(FLAGS.measure_batch, 1)
    pp = gpp_jax.graph_pipeline(
      run.train_step,
      num_microbatches=FLAGS.microbatches,
      devices=devices,
      planner=plan or "graphpipe",
      schedule=sched,
    )
    jax.block_until_ready(pp(run.model, run.optimizer, batch))
    plan = plan or pp.plan
    runs[sched] = (pp, run, batch)
  times: dict[str, list[float]] = {s: [] for s in runs}
  bubbles: dict[str, list[list[float]]] = {s: [] for s in runs}
  K = FLAGS.stream_steps
  times["pipedream-async, run_steps"] = []
  times["pipedream-async, K calls"] = []
  fast = None
  for _ in range(FLAGS.repeats):
    pp, run, batch = runs["pipedream-async"]
    pp.measure = False
    t = time.perf_counter()  # K steps as one stream, no flush between them
    jax.block_until_ready(pp.run_steps(run.model, run.optimizer, [batch] * K, stream=True))
    times["pipedream-async, run_steps"].append((time.perf_counter() - t) / K)
    fast = fast or pp.cached_partial(run.model, run.optimizer)  # no NNX walk per call
    t = time.perf_counter()  # K calls, waiting only after the last: a flush per step
    jax.block_until_ready([fast(batch) for _ in range(K)])
    times["pipedream-async, K calls"].append((time.perf_counter() - t) / K)
    for sched, (pp, run, batch) in runs.items():
      pp.measure = False
      t = time.perf_counter()
      jax.block_until_ready(pp(run.model, run.optimizer, batch))
      times[sched].append(time.perf_counter() - t)
      pp.measure = True  # one step blocking per action: the measured per-stage bubble
      jax.block_until_ready(pp(run.model, run.optimizer, batch))
      tl = pp.timeline
      busy = [0.0] * pp.plan.num_stages
      for e in tl.events:
        if e.action in ("F", "B", "W"):
          busy[e.stage] += e.end - e.start
      span = max(e.end for e in tl.events) - min(e.start for e in tl.events)
      bubbles[sched].append([1 - b / span for b in busy])
  for sched, (pp, _, _) in runs.items():
    step = statistics.median(times[sched])
    S = pp.plan.num_stages
    mean_b = statistics.median(sum(b) / S for b in bubbles[sched])
    busiest = statistics.median(min(b) for b in bubbles[sched])
    print(
      f"  {sched:12s} step median {step * 1e3:7.1f} ms (min {min(times[sched]) * 1e3:6.1f})  "
      f"{FLAGS.measure_batch / step:7.1f} samples/s  measured bubble mean {mean_b:6.1%} "
      f"busiest stage {busiest:6.1%} ({S} stages, depth {pp.plan.depth()})"
    )
  for what in ("K calls", "run_steps"):
    step = statistics.median(times[f"pipedream-async, {what}"])
    print(
      f"  pipedream-async, {K} steps as {what:9s} (one wait): step median {step * 1e3:7.1f} ms "
      f"{FLAGS.measure_batch / step:7.1f} samples/s"
    )


def stream_medium() -> None:
  """CANDLE-Uno at medium size (``benchmarks/scaling.py``), four branches per stage on 2 forced
  CPU devices, pipedream-async, M = 4: K ``cached_partial`` calls vs one ``run_steps``
  stream, each waiting once at the end, interleaved; also the host time inside the stream."""
  import jax
  from flax import nnx

  import gpp_jax
  from gpp_jax.experiments import zoo

  K = FLAGS.stream_steps
  run = zoo.setup("candle_uno", "paper", **zoo.MEDIUM["candle_uno"])
  (batch,) = run.batches(256, 1)
  plan = {f"branches/{i}": 0 for i in range(4)} | {"branches": 1, "head": 1}
  pp = gpp_jax.graph_pipeline(
    run.train_step,
    num_microbatches=4,
    devices=jax.devices()[:2],
    planner=gpp_jax.manual_plan(plan),
    layer_depth=run.spec.layer_depth,
    schedule="pipedream-async",
  )
  fast = pp.cached_partial(run.model, run.optimizer)
  state = nnx.state((run.model, run.optimizer))

  def wait(x):
    jax.block_until_ready((x, jax.tree.leaves(state)))

  wait(fast(batch))
  wait(pp.run_steps(run.model, run.optimizer, [batch] * K, stream=True))
  calls, streams, hosts = [], [], []
  for _ in range(FLAGS.repeats):
    t = time.perf_counter()
    wait([fast(batch) for _ in range(K)])
    calls.append((time.perf_counter() - t) / K)
    t = time.perf_counter()
    out = pp.run_steps(run.model, run.optimizer, [batch] * K, stream=True)
    hosts.append((time.perf_counter() - t) / K)
    wait(out)
    streams.append((time.perf_counter() - t) / K)
  # Why: the CPU client stops the issuing thread once a device has enough work queued.
  f = jax.jit(lambda a: (a @ a) * 1e-3)
  x = jax.device_put(np.ones((1024, 1024), np.float32), jax.devices()[0])
  jax.block_until_ready(f(x))
  for n in (16, 64):
    t = time.perf_counter()
    ys = [f(x) for _ in range(n)]
    issued = time.perf_counter() - t
    jax.block_until_ready(ys)
    print(
      f"  {n} jitted 1024^3 matmuls issued back to back on one CPU device: issuing took "
      f"{issued * 1e3:.1f} ms of {(time.perf_counter() - t) * 1e3:.1f} ms"
    )
  c, st = statistics.median(calls), statistics.median(streams)
  print(
    f"candle_uno (medium), 2 stages on 2 forced CPU devices, M=4, {K} steps: {K} calls "
    f"{c * 1e3:.1f} ms per step, run_steps {st * 1e3:.1f} ms per step (host "
    f"{statistics.median(hosts) * 1e3:.1f} ms of it), calls / stream {c / st:.3f}"
  )


def streamed(plan, g, cluster, B: int) -> None:
  """Simulated K steps in a row: 1F1B (a flush per step) and PipeDream's async 1F1B, which
  runs them as one stream."""
  K = FLAGS.stream_steps
  S, edges, M = plan.num_stages, tuple(plan.edges), plan.num_microbatches
  per_step = {}
  for name in ("1f1b", "pipedream-async"):
    multi = stream_schedule(make_schedule(name, S, edges, M), K)
    res = simulate(plan.replace(schedule=name), g, cluster, schedule=multi)
    per_step[name] = res.iteration_time / K
    print(
      f"  {K} steps of {name:16s} {per_step[name] * 1e3:8.2f} ms per step "
      f"{B / per_step[name]:8.1f} samples/s  bubble mean {sum(res.bubble) / S:5.1%} "
      f"busiest {min(res.bubble):5.1%}  peak held {list(res.peak_in_flight)}"
    )
  print(f"  no flush / flush per step: {per_step['pipedream-async'] / per_step['1f1b']:.3f}")


def row(name, res, batch, bound, act_per_mb):
  """Prints one schedule's line; returns its bubbles: (mean, busiest stage) over the whole
  iteration, and the same up to the last F/B/W (without the UPDATE tail)."""
  S = res.num_stages
  compute_end = max(a.end for a in res.actions if a.kind != "UPDATE")
  pipe = [1 - b / compute_end for b in res.busy]
  held = " ".join(f"{p}/{b}" for p, b in zip(res.peak_in_flight, bound))
  act = max(p * a for p, a in zip(res.peak_in_flight, act_per_mb)) / 2**20
  act_bound = max(b * a for b, a in zip(bound, act_per_mb)) / 2**20
  print(
    f"  {name:26s} iter {res.iteration_time * 1e3:8.2f} ms {res.throughput(batch):8.1f} "
    f"samples/s  bubble mean {sum(res.bubble) / S:5.1%} busiest {min(res.bubble):5.1%}  "
    f"without UPDATE mean {sum(pipe) / S:5.1%} busiest {min(pipe):5.1%}  "
    f"activations {act:6.1f} MiB (bound {act_bound:6.1f}), all {max(res.stage_memory) / 2**30:4.2f}"
    f" GiB  held/bound {held}"
  )
  return sum(res.bubble) / S, min(res.bubble), sum(pipe) / S, min(pipe)


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
    act_per_mb = plan_costs(plan, g, cluster).activation_memory
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
      res = simulate(p, g, cluster, schedule=sched)
      out[sched_name] = row(sched_name, res, B, bound, act_per_mb)
    whats = ("mean", "busiest-stage", "mean (without UPDATE)", "busiest-stage (without UPDATE)")
    for k, what in enumerate(whats):
      base = out["1f1b"][k]
      zb = [
        out[f"zero-bubble ({b} bound)"][k] / base if base else float("nan")
        for b in ("memory", "1F1B")
      ]
      print(
        f"  zero-bubble / 1F1B {what} bubble: {zb[0]:.2f} (memory bound), {zb[1]:.2f} (1F1B bound)"
      )
    streamed(plan, g, cluster, B)
  if FLAGS.measure:
    for name in FLAGS.models:
      measured(name)
  if FLAGS.stream_medium:
    stream_medium()


if __name__ == "__main__":
  app.run(main)
