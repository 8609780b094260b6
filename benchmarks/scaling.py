"""Real scaling: processes on their own cores, pipelined plans vs plain jit and data parallel.

  python benchmarks/scaling.py --processes=1,2 --models=candle_uno,mmt,dlrm

For each model (the zoo models at a medium size, a step of 50-500 ms on one core) and each
process count N, measured side by side in one run (the median of ``--steps`` timed steps after
``--warmup``), every process pinned to its own block of ``--cores_per_process`` cores and owning
one device:

  plain_1     plain ``jax.jit`` of the step in one process (the unit of the scaling)
  plain_N     the same process given all N processes' cores (what XLA's own threads make of them)
  dp          JAX data parallel over the N processes (batch sharded over a global mesh,
              parameters replicated, gradients all-reduced by XLA over gloo)
  graphpipe   what ``graph_pipeline(planner="graphpipe", calibrate=True)`` runs over the N
              processes' devices: the planner's pipeline, or plain jit / jit data parallel
              where the host-aware prediction says one is faster (layer times, each process's
              host and those two steps measured)
  pipedream   the same with the PipeDream planner

and prints samples/s, the ratios the targets name, what was chosen (its stages, width and
micro-batches) and the one prediction it was chosen by beside each measurement. Each planner's
row is the fastest of its runs with the micro-batch counts in ``--microbatches`` (all are kept
in the JSON). Every run takes the host batch each step, as a training loop fed by a data
loader does. With N = 1 the pipelined rows
are one stage on one device: one jitted step (``runtime.fused``) with M = 1.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from absl import app, flags

HERE = os.path.abspath(__file__)
FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["candle_uno", "mmt", "dlrm"], "zoo models")
flags.DEFINE_list("processes", ["1", "2"], "process counts N")
flags.DEFINE_integer("cores_per_process", 1, "cores each process is pinned to")
flags.DEFINE_integer("batch_size", 256, "examples per step")
flags.DEFINE_list(
  "microbatches", ["1", "4"], "micro-batch counts tried for each pipelined row (the best is shown)"
)
flags.DEFINE_integer("steps", 5, "timed steps (median reported)")
flags.DEFINE_integer("warmup", 2, "untimed steps after compilation")
flags.DEFINE_list("planners", ["graphpipe", "pipedream"], "planners of the pipelined rows")
flags.DEFINE_string("json_out", None, "also write the rows to this JSON file")
# Worker-side flags (set by the benchmark itself).
flags.DEFINE_enum("worker", None, ["plain", "dp", "pipe"], "run one measurement (internal)")
flags.DEFINE_string("model", None, "worker: the model")
flags.DEFINE_string("planner", None, "worker: the planner")
flags.DEFINE_integer("worker_microbatches", 1, "worker: micro-batches")

# ------------------------------------------------------------------ workers


def _setup(model_name):
  from gpp_jax.experiments import zoo

  run = zoo.setup(model_name, "paper", **zoo.MEDIUM[model_name])
  return run, run.batches(FLAGS.batch_size, 1)[0]


def _functional_step(run):
  """The zoo step as plain JAX: the NNX state and ``jit(state, batch) -> (new state, loss)``."""
  import jax
  from flax import nnx

  graphdef, state = nnx.split((run.model, run.optimizer))

  @jax.jit
  def step(state, batch):
    model, opt = nnx.merge(graphdef, state)
    loss = run.train_step(model, opt, batch)
    return nnx.state((model, opt)), loss

  return state, step


def _median_step(call, wait) -> float:
  for _ in range(FLAGS.warmup):
    wait(call())
  times = []
  for _ in range(FLAGS.steps):
    t = time.perf_counter()
    wait(call())
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def _report(**row) -> None:
  print("RESULT " + json.dumps(row), flush=True)


def worker_plain() -> None:
  import jax

  run, batch = _setup(FLAGS.model)
  state, step = _functional_step(run)
  holder = {"s": state}

  def call():  # the host batch each step, as the pipelined runs get it
    holder["s"], loss = step(holder["s"], batch)
    return loss

  t = _median_step(call, jax.block_until_ready)
  _report(kind="plain", seconds=t, cores=len(os.sched_getaffinity(0)))


def worker_dp() -> None:
  import jax

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  from gpp_jax import distributed

  distributed.initialize_from_env()
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  run, batch = _setup(FLAGS.model)
  mesh = Mesh(np.array(jax.devices()), ("data",))
  state, step = _functional_step(run)
  replicated = NamedSharding(mesh, P())

  def global_copy(x):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, replicated, lambda i: x[i])

  state = jax.tree.map(global_copy, state)
  n, k = jax.process_count(), jax.process_index()
  rows = FLAGS.batch_size // n

  def gbatch():  # each process puts its rows of the host batch, every step
    return {
      name: jax.make_array_from_process_local_data(
        NamedSharding(mesh, P("data")), np.asarray(x)[k * rows : (k + 1) * rows]
      )
      for name, x in batch.items()
    }

  holder = {"s": state}

  def call():
    holder["s"], loss = step(holder["s"], gbatch())
    return loss

  t = _median_step(call, jax.block_until_ready)
  if k == 0:
    _report(kind="dp", seconds=t, processes=n)


def worker_pipe() -> None:
  from gpp_jax import distributed

  distributed.initialize_from_env()
  import jax
  from flax import nnx

  import gpp_jax
  from gpp_jax.cli import reporting
  from gpp_jax.cost.cluster import process_cluster
  from gpp_jax.runtime.executor import wait_for

  run, batch = _setup(FLAGS.model)
  devices = jax.devices()
  cluster = process_cluster(devices)
  pp = gpp_jax.graph_pipeline(
    run.train_step,
    num_microbatches=FLAGS.worker_microbatches,
    devices=devices,
    planner=FLAGS.planner,
    cluster=cluster,
    calibrate=True,
    layer_depth=run.spec.layer_depth,
    timeout_s=600,
  )

  step = pp.cached_partial(run.model, run.optimizer)
  state = nnx.state((run.model, run.optimizer))  # its Variables: the values after each step

  def call():
    return step(batch)

  def wait(loss):
    wait_for((loss, jax.tree.leaves(state)), 600)

  wait(call())  # compiles
  t = _median_step(call, wait)
  # Host work per step: the device_put calls this process issues in one step.
  real_put, puts = jax.device_put, [0]

  def counting_put(*a, **k):
    puts[0] += 1
    return real_put(*a, **k)

  jax.device_put = counting_put
  try:
    wait(call())
  finally:
    jax.device_put = real_put
  if jax.process_index() == 0:
    planned = pp.compiled.planned
    devices_only = reporting.predicted_timeline(pp, cluster).iteration_time
    _report(
      kind="pipe",
      planner=FLAGS.planner,
      chosen=pp.plan.planner,
      seconds=t,
      predicted=planned.predicted_s if planned.predicted_s is not None else devices_only,
      devices_only=devices_only,
      stages=len(pp.plan.stages),
      width=len(pp.plan.stages[0].devices),
      microbatches=pp.plan.num_microbatches,
      asked_microbatches=FLAGS.worker_microbatches,
      alternatives=dict(planned.alternatives or {}),
      timed=dict(planned.measured),
      puts_per_step=puts[0],
    )


# ------------------------------------------------------------------ the benchmark


def _run(cmd, env, timeout=1800) -> list[dict]:
  r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
  rows = [json.loads(l.split("RESULT ", 1)[1]) for l in r.stdout.splitlines() if "RESULT " in l]
  if r.returncode != 0 or not rows:
    sys.stderr.write(r.stdout[-3000:] + r.stderr[-3000:])
    raise SystemExit(f"benchmark worker failed: {' '.join(cmd)}")
  return rows


def _single(args, cores, env) -> dict:
  """One worker process pinned to ``cores`` with one CPU device."""
  e = dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=1")
  cmd = ["taskset", "-c", ",".join(map(str, cores)), sys.executable, HERE, *args]
  return _run(cmd, e)[0]


def _launched(args, n, env) -> dict:
  cmd = [sys.executable, "-m", "gpp_jax.launch", f"--num_processes={n}", "--devices_per_process=1"]
  cmd += [f"--cpus_per_process={FLAGS.cores_per_process}", "--platform=cpu", "--"]
  return _run([*cmd, "python", HERE, *args], env)[0]


def measure(model: str, n: int, cores: list[int], env: dict) -> dict:
  base = [f"--model={model}", f"--batch_size={FLAGS.batch_size}", f"--steps={FLAGS.steps}"]
  base.append(f"--warmup={FLAGS.warmup}")
  row: dict = {"model": model, "N": n}
  row["plain_1"] = _single(["--worker=plain", *base], cores[: FLAGS.cores_per_process], env)
  if n > 1:
    row["plain_N"] = _single(["--worker=plain", *base], cores[: n * FLAGS.cores_per_process], env)
    row["dp"] = _launched(["--worker=dp", *base], n, env)
  for planner in FLAGS.planners:
    args = ["--worker=pipe", f"--planner={planner}", *base]
    runs = [_launched([*args, f"--worker_microbatches={m}"], n, env) for m in FLAGS.microbatches]
    row[planner] = min(runs, key=lambda r: r["seconds"])
    row[planner]["tried"] = {r["asked_microbatches"]: r["seconds"] for r in runs}
  return row


def _fmt(row: dict, key: str, batch: int) -> str:
  r = row.get(key)
  if r is None:
    return ""
  s = f"{batch / r['seconds']:8.0f}/s"
  if "predicted" in r:
    err = (r["predicted"] - r["seconds"]) / r["seconds"] * 100
    s += (
      f" ({r.get('chosen', '?')}: M={r['microbatches']}, {r['stages']} st x{r.get('width', '?')}"
      f", predicted {r['predicted'] * 1e3:.0f} ms {err:+.0f}%, {r.get('puts_per_step', '?')} "
      "puts/step)"
    )
    if r.get("timed"):
      s += "; timed while choosing: " + ", ".join(
        f"{k} {v * 1e3:.0f} ms" for k, v in r["timed"].items()
      )
  return s


def main(argv) -> None:
  del argv
  if FLAGS.worker:
    {"plain": worker_plain, "dp": worker_dp, "pipe": worker_pipe}[FLAGS.worker]()
    return
  cores = sorted(os.sched_getaffinity(0))
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  rows = []
  for model in FLAGS.models:
    for n in map(int, FLAGS.processes):
      if n * FLAGS.cores_per_process > len(cores):
        print(f"skipping N={n}: needs {n * FLAGS.cores_per_process} cores, {len(cores)} here")
        continue
      t0 = time.perf_counter()
      row = measure(model, n, cores, env)
      rows.append(row)
      b = FLAGS.batch_size
      plain = row["plain_1"]["seconds"]
      print(
        f"{model} N={n} ({time.perf_counter() - t0:.0f} s): plain_1 "
        f"{plain * 1e3:.0f} ms = {b / plain:.0f}/s"
      )
      for key in ("plain_N", "dp", *FLAGS.planners):
        if key in row:
          ratio = plain / row[key]["seconds"]
          print(f"  {key:<13s}{_fmt(row, key, b)}  {ratio:5.2f}x plain_1")
      if "graphpipe" in row and "pipedream" in row:
        gp_pd = row["pipedream"]["seconds"] / row["graphpipe"]["seconds"]
        print(f"  graphpipe / pipedream throughput: {gp_pd:.2f}x")
      if "graphpipe" in row and "dp" in row:
        gp_dp = row["dp"]["seconds"] / row["graphpipe"]["seconds"]
        print(f"  graphpipe / dp throughput: {gp_dp:.2f}x")
      sys.stdout.flush()
  if FLAGS.json_out:
    with open(FLAGS.json_out, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  app.run(main)
