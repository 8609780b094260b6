"""Several stages per device on the multi-branch models: what interleaving gains, simulated.

For MMT, DLRM, CANDLE-Uno and the branch sweep's CANDLE-Uno of 8 towers, at the paper's shapes
on the V100 preset, at 16, 32 and 64 devices and few micro-batches (the bubble's regime),
plans side by side in one process:

  * GraphPipe with one stage per device (v = 1) and with v = 2 and 4 (``stages_per_device``:
    the planner's plan on a virtual cluster of v x N devices folded onto N, or its own plan
    with each stage cut into v, whichever is predicted faster), the best v > 1 against v = 1;
  * PipeDream (a chain: the graph linearised) with the same v, the DAG plan against the best
    chain linearisation with the same v.

Every figure is the simulator's prediction (modelled, nothing runs), each plan within the
preset's 16 GiB per device, memory per device the sum of its stages'. The question: on
multi-branch models with m <= p micro-batches, does v = 2 pay, and does the DAG keep its
lead over the chain once both interleave.

  python benchmarks/shared_devices.py
  python benchmarks/shared_devices.py --models=mmt --devices=16 --microbatches=2,4

``--measured``: on forced CPU devices (``--cpu_devices``, default 4), a chain of 16 dense
layers trained with one stage per device (v = 1, 1F1B) and with two (v = 2, interleaved 1F1B,
stage s on device s mod 4), each in its own process: the measured step time (median of
``--timed_steps``) and peak memory per device beside the predictions (the planner's modelled
time; the program's predicted peak), and the values against the plain step.

  python benchmarks/shared_devices.py --measured
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from absl import app, flags

from gpp_jax.cost.cluster import v100_cluster
from gpp_jax.errors import PlanError
from gpp_jax.experiments.planner_runs import build_graph, default_batch_size
from gpp_jax.passes.partition import PLANNERS

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["mmt", "dlrm", "candle_uno", "branches"], "models to plan")
flags.DEFINE_list("devices", ["16", "32", "64"], "device counts")
flags.DEFINE_list("microbatches", ["2", "4", "8"], "micro-batch counts")
flags.DEFINE_bool("measured", False, "measure v = 1 and v = 2 on forced CPU devices instead")
flags.DEFINE_integer("cpu_devices", 4, "--measured: forced CPU devices")
flags.DEFINE_integer("timed_steps", 20, "--measured: steps timed per configuration")
flags.DEFINE_integer("width", 512, "--measured: the dense layers' width")
flags.DEFINE_string("child", None, "internal: run one measured configuration (JSON)")

GRAPHS = {"branches": ("candle_uno", {"branches": 8})}


def best_time(planner: str, graph, cluster, batch: int, M: int, vs) -> tuple[float, int]:
  """The lowest predicted iteration time of ``planner`` over ``vs`` (and the v it used)."""
  best = (float("inf"), 0)
  for v in vs:
    try:
      plan = PLANNERS[planner](
        graph, cluster, batch, num_microbatches=M, **({} if v == 1 else {"stages_per_device": v})
      )
    except PlanError:
      continue
    if plan.predicted.get("memory_ok", True):
      best = min(best, (plan.predicted["iteration_time"], plan.stages_per_device))
  return best


def _measure(cfg: dict) -> dict:
  """One measured configuration, in its own process: v stages per device of a 16-layer chain."""
  import statistics

  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  import gpp_jax

  L, n, v, W, B, M = 16, cfg["devices"], cfg["v"], cfg["width"], 64, 4
  keys = jax.random.split(jax.random.key(0), L)
  params = {
    f"l{i:02d}": {"w": jax.random.normal(keys[i], (W, W)) / np.sqrt(W), "b": jnp.zeros(W)}
    for i in range(L)
  }
  tx = optax.adam(1e-3)

  def step(params, opt_state, batch):
    def loss_fn(p):
      x = batch["x"]
      for i in range(L):
        x = jnp.tanh(x @ p[f"l{i:02d}"]["w"] + p[f"l{i:02d}"]["b"])
      return jnp.mean((x - batch["y"]) ** 2)

    loss, grads = gpp_jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  S = n * v
  rules = {f"l{i:02d}": i * S // L for i in range(L)}
  plan = gpp_jax.manual_plan(rules, devices={s: [s % n] for s in range(S)})
  pp = gpp_jax.graph_pipeline(
    step,
    num_microbatches=M,
    devices=jax.devices()[:n],
    planner=plan,
    schedule="interleaved-1f1b" if v > 1 else "1f1b",
    calibrate=False,
  )
  rng = np.random.default_rng(0)
  batch = {
    "x": rng.normal(size=(B, W)).astype(np.float32),
    "y": rng.normal(size=(B, W)).astype(np.float32),
  }
  state = jax.tree.map(np.asarray, (params, tx.init(params)))  # on the host, not on a device
  ref = jax.jit(step)(*state, batch)
  out = pp(*state, batch)
  diff = max(
    float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(ref[0]), jax.tree.leaves(out[0]))
  )
  del ref, out  # only the pipeline's arrays on the devices while memory is measured
  times = []
  for _ in range(cfg["timed"]):
    t = time.perf_counter()
    jax.block_until_ready(pp(*state, batch))
    times.append(time.perf_counter() - t)
  pp.measure_memory(*state, batch)
  rep = pp.memory
  return {
    "v": v,
    "stages": S,
    "measured_ms": statistics.median(times) * 1e3,
    "modelled_ms": (pp.compiled.planned.predicted_s or float("nan")) * 1e3,
    "max_measured": max(d.measured_peak_bytes for d in rep.devices),
    "max_predicted": max(d.predicted_peak_bytes for d in rep.devices),
    "max_diff": diff,
  }


def measured() -> None:
  rows = []
  for v in (1, 2):
    cfg = dict(devices=FLAGS.cpu_devices, v=v, width=FLAGS.width, timed=FLAGS.timed_steps)
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
      env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={FLAGS.cpu_devices}"
    )
    out = subprocess.run(
      [sys.executable, __file__, f"--child={json.dumps(cfg)}"],
      env=env,
      capture_output=True,
      text=True,
      check=True,
    )
    rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
  print(
    f"{'v':>2s} {'stages':>6s} {'measured ms':>11s} {'modelled ms':>11s} "
    f"{'peak MiB meas.':>14s} {'peak MiB pred.':>14s} {'vs plain':>9s}"
  )
  for r in rows:
    print(
      f"{r['v']:2d} {r['stages']:6d} {r['measured_ms']:11.2f} {r['modelled_ms']:11.2f} "
      f"{r['max_measured'] / 2**20:14.2f} {r['max_predicted'] / 2**20:14.2f} {r['max_diff']:9.1e}"
    )
  a, b = rows
  print(
    f"\nv = 2 against v = 1: measured {a['measured_ms'] / b['measured_ms']:.3f}x, modelled "
    f"{a['modelled_ms'] / b['modelled_ms']:.3f}x (above 1: v = 2 faster); peak memory "
    f"{b['max_measured'] / a['max_measured']:.3f}x measured. Measured on {FLAGS.cpu_devices} "
    "forced CPU devices; 'vs plain' is the largest parameter difference from jax.jit's step."
  )


def main(argv) -> None:
  del argv
  if FLAGS.child:
    print(json.dumps(_measure(json.loads(FLAGS.child))))
    return
  if FLAGS.measured:
    measured()
    return
  print(
    f"{'model':11s} {'N':>3s} {'M':>3s} {'GP v=1 ms':>10s} {'GP v>1 ms':>10s} {'v':>2s} "
    f"{'v>1 gain':>8s} {'PD same v':>10s} {'DAG/chain':>9s} {'s':>5s}"
  )
  for model in FLAGS.models:
    base, shape = GRAPHS.get(model, (model, {}))
    for n in map(int, FLAGS.devices):
      batch = default_batch_size(base, n)
      graph = build_graph(base, "paper", batch, **shape)
      cluster = v100_cluster(n)
      for M in map(int, FLAGS.microbatches):
        if batch % M:
          continue
        t0 = time.perf_counter()
        one, _ = best_time("graphpipe", graph, cluster, batch, M, [1])
        many, v = best_time("graphpipe", graph, cluster, batch, M, [2, 4])
        chain, _ = best_time("pipedream", graph, cluster, batch, M, [v] if v else [2])
        print(
          f"{model:11s} {n:3d} {M:3d} {one * 1e3:10.2f} {many * 1e3:10.2f} {v:2d} "
          f"{one / many:8.3f} {chain * 1e3:10.2f} {chain / many:9.3f} "
          f"{time.perf_counter() - t0:5.1f}",
          flush=True,
        )
  print(
    "\nGP: GraphPipe; PD: PipeDream (the chain linearisation); v: stages per device of the best "
    "v > 1 plan (1 where none was found to fold); gain and DAG/chain are ratios of predicted "
    "iteration times (above 1: the v > 1 plan, the DAG plan is faster). Modelled, not measured."
  )


if __name__ == "__main__":
  app.run(main)
