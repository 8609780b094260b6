"""Several stages per device on the multi-branch models: what interleaving gains, simulated.

For MMT, DLRM, CANDLE-Uno and the branch sweep's CANDLE-Uno of 8 towers, at the paper's shapes
on the V100 preset, at 16, 32 and 64 devices and few micro-batches (the bubble's regime),
plans side by side in one process:

  * GraphPipe with one stage per device (v = 1), with v = 2, and the best of v = 2 and 4
    (``stages_per_device``: the planner's plan with each stage cut into v, its plan for v
    times as many micro-batches cut the same way, or its plan on a virtual cluster of v x N
    devices folded onto N, whichever is predicted fastest), against v = 1;
  * PipeDream (a chain: the graph linearised, its stages kept in one line when cut) with the
    same v, the DAG plan against the best chain linearisation with the same v.

Every figure is the simulator's prediction (modelled, nothing runs), each plan within the
preset's 16 GiB per device (equal memory budget), memory per device the sum of its stages'.
The question: on multi-branch models with m <= p micro-batches, does v = 2 pay, and does the
DAG keep its lead over the chain once both interleave.

  python benchmarks/shared_devices.py
  python benchmarks/shared_devices.py --models=mmt --devices=16 --microbatches=2,4
  python benchmarks/shared_devices.py --schedule=zero-bubble   # the backward split: v = 1
      zero-bubble against ZB-V (or interleaved 1F1B) with v > 1
  python benchmarks/shared_devices.py --breakdown              # where each plan's time goes
  python benchmarks/shared_devices.py --markdown=shared_devices.md

``--breakdown`` prints, for GraphPipe's v = 1 and v = 2 plans and PipeDream's v = 2 plan, the
busiest device's compute, the time with transfers and the update left out (compute and its
bubble alone), and what transfers and the update add (``breakdown``: the same simulation with
those costs set to zero, the cost model untouched). The reproduction
(``gpp_jax.experiments.reproduce``) puts ``rows``' table in its ``results.md``.

``--measured``: on forced CPU devices (``--cpu_devices``, default 4), a chain of 16 dense
layers trained with one stage per device (v = 1, 1F1B) and with two (v = 2, interleaved 1F1B,
stage s on device s mod 4), each in its own process: the measured step time (median of
``--timed_steps``) and peak memory per device beside the predictions (the planner's modelled
time; the program's predicted peak), and the values against the plain step.

  python benchmarks/shared_devices.py --measured
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from typing import Any, cast

from absl import app, flags

from gpp_jax.cost.cluster import v100_cluster
from gpp_jax.cost.simulator import plan_times
from gpp_jax.errors import PlanError
from gpp_jax.experiments.planner_runs import MODEL_LABELS, build_graph, default_batch_size
from gpp_jax.ir.plan import Plan
from gpp_jax.passes.partition import PLANNERS
from gpp_jax.passes.partition.plan_assembly import better
from gpp_jax.passes.schedules import plan_schedule
from gpp_jax.passes.simulation import HostSide, StageTimes, simulate_times

FLAGS = flags.FLAGS
MODELS = ("mmt", "dlrm", "candle_uno", "branches")
DEVICES = (16, 32, 64)
MICROBATCHES = (2, 4, 8)


def define_flags() -> None:
  """The script's flags (only when run as a program: the reproduction imports ``rows``)."""
  flags.DEFINE_list("models", list(MODELS), "models to plan")
  flags.DEFINE_list("devices", [str(n) for n in DEVICES], "device counts")
  flags.DEFINE_list("microbatches", [str(m) for m in MICROBATCHES], "micro-batch counts")
  flags.DEFINE_string(
    "schedule",
    None,
    "the schedule every plan is simulated with (default: the planners' own, interleaved-1f1b "
    "where stages share devices; zero-bubble: the backward split, ZB-V tried where they share)",
  )
  flags.DEFINE_bool("breakdown", False, "also print where each plan's time goes")
  flags.DEFINE_string("markdown", None, "also write the table as a markdown section here")
  flags.DEFINE_bool("measured", False, "measure v = 1 and v = 2 on forced CPU devices instead")
  flags.DEFINE_integer("cpu_devices", 4, "--measured: forced CPU devices")
  flags.DEFINE_integer("timed_steps", 20, "--measured: steps timed per configuration")
  flags.DEFINE_integer("width", 512, "--measured: the dense layers' width")
  flags.DEFINE_bool(
    "calibrate",
    False,
    "--measured: predict with the host's measured costs (calibrate=True), not devices only",
  )
  flags.DEFINE_string("child", None, "internal: run one measured configuration (JSON)")


GRAPHS = {"branches": ("candle_uno", {"branches": 8})}


def best_plan(planner: str, graph, cluster, batch: int, M: int, vs, schedule=None) -> Plan | None:
  """``planner``'s fastest predicted plan within memory over ``vs`` stages per device (None
  where it finds none)."""
  best = None
  for v in vs:
    kw: dict[str, Any] = {} if v == 1 else {"stages_per_device": v}
    if schedule is not None:
      kw["schedule"] = schedule
    try:
      plan = PLANNERS[planner](graph, cluster, batch, num_microbatches=M, **kw)
    except PlanError:
      continue
    if plan.predicted.get("memory_ok", True):
      best = better(best, plan)
  return best


def _ms(plan: Plan | None) -> float:
  return plan.predicted["iteration_time"] * 1e3 if plan is not None else math.nan


def row(model: str, n: int, M: int, schedule: str | None = None) -> dict[str, Any] | None:
  """One configuration: GraphPipe at v = 1, v = 2 and the best of 2 and 4, PipeDream at v = 2
  and at that best v, times in ms and the ratios (above 1: the v > 1 plan, the DAG plan is
  faster); None where M does not divide the model's mini-batch at n devices."""
  base, shape = GRAPHS.get(model, (model, {}))
  batch = default_batch_size(base, n)
  if batch % M:
    return None
  graph = build_graph(base, "paper", batch, **shape)
  cluster = v100_cluster(n)
  t0 = time.perf_counter()
  plans = {
    "gp_v1": best_plan("graphpipe", graph, cluster, batch, M, [1], schedule),
    "gp_v2": best_plan("graphpipe", graph, cluster, batch, M, [2], schedule),
    "gp_v4": best_plan("graphpipe", graph, cluster, batch, M, [4], schedule),
    "pd_v2": best_plan("pipedream", graph, cluster, batch, M, [2], schedule),
  }
  many = better(plans["gp_v2"], plans["gp_v4"])
  v = many.stages_per_device if many is not None else 0
  plans["pd_many"] = (
    plans["pd_v2"] if v == 2 else best_plan("pipedream", graph, cluster, batch, M, [v], schedule)
  )
  ms = {k: _ms(p) for k, p in plans.items()}
  r = {
    "model": model,
    "devices": n,
    "microbatches": M,
    "gp_v1": ms["gp_v1"],
    "gp_v2": ms["gp_v2"],
    "gain_v2": ms["gp_v1"] / ms["gp_v2"],
    "pd_v2": ms["pd_v2"],
    "chain_v2": ms["pd_v2"] / ms["gp_v2"],
    "gp_many": _ms(many),
    "v": v,
    "gain": ms["gp_v1"] / _ms(many),
    "pd_many": ms["pd_many"],
    "chain": ms["pd_many"] / _ms(many),
    "how_v2": (plans["gp_v2"].predicted.get("shared_devices", "") if plans["gp_v2"] else ""),
    "seconds": time.perf_counter() - t0,
    "plans": {"gp_v1": plans["gp_v1"], "gp_v2": plans["gp_v2"], "pd_v2": plans["pd_v2"]},
    "graph": graph,
    "cluster": cluster,
  }
  return r


def rows(
  models=MODELS, devices=DEVICES, microbatches=MICROBATCHES, schedule=None, progress=None
) -> list[dict[str, Any]]:
  """``row`` for every configuration (``progress(row)`` after each)."""
  out = []
  for model in models:
    for n in devices:
      for M in microbatches:
        r = row(model, int(n), int(M), schedule)
        if r is not None:
          out.append(r)
          if progress is not None:
            progress(r)
  return out


def breakdown(plan: Plan, graph, cluster) -> dict[str, float]:
  """Where ``plan``'s predicted time goes, in ms: ``total``; ``busiest``, the compute of the
  busiest device (its stages' forwards and backwards for every micro-batch); ``compute``, the
  simulated time with transfers and the update at zero (compute and its bubble alone);
  ``transfers`` and ``update``, what each adds to the total. The same schedule and simulator
  with those costs zeroed; the cost model is untouched."""
  sched = plan_schedule(plan)
  pt = plan_times(plan, graph, cluster, sched, None)
  pc = pt.costs

  def run(transfers: bool, update: bool) -> float:
    def tx(d):
      return d if transfers else dict.fromkeys(d, 0.0)

    return simulate_times(
      sched,
      StageTimes(
        pc.forward,
        pt.stages.backward,
        weight=pt.stages.weight,
        update=pc.update if update else [0.0] * plan.num_stages,
        activation_transfer=tx(pc.activation_transfer),
        cotangent_transfer=tx(pc.cotangent_transfer),
        stage_devices=pt.stages.stage_devices,
      ),
      HostSide(channels=pt.host.channels),
      timeline=False,
    ).iteration_time

  M = plan.num_microbatches
  per_device: dict[tuple[int, ...], float] = {}
  backward = cast("list[float]", pt.stages.backward)  # per stage, seconds of a B
  weight = cast("list[float] | None", pt.stages.weight)
  for s, st in enumerate(plan.stages):
    w = weight[s] if weight is not None else 0.0
    per_device[st.devices] = per_device.get(st.devices, 0.0) + M * (pc.forward[s] + backward[s] + w)
  total = run(True, True)
  compute = run(False, False)
  return {
    "total": total * 1e3,
    "busiest": max(per_device.values()) * 1e3,
    "compute": compute * 1e3,
    "transfers": (total - run(False, True)) * 1e3,
    "update": (total - run(True, False)) * 1e3,
  }


COLUMNS = (
  ("model", "model", "s"),
  ("devices", "N", "d"),
  ("microbatches", "M", "d"),
  ("gp_v1", "GP v=1 ms", ".2f"),
  ("gp_v2", "GP v=2 ms", ".2f"),
  ("gain_v2", "v=2 gain", ".3f"),
  ("pd_v2", "PD v=2 ms", ".2f"),
  ("chain_v2", "DAG/chain v=2", ".3f"),
  ("gp_many", "GP best v>1 ms", ".2f"),
  ("v", "v", "d"),
  ("gain", "v>1 gain", ".3f"),
  ("pd_many", "PD same v ms", ".2f"),
  ("chain", "DAG/chain", ".3f"),
)

LEGEND = (
  "GP: GraphPipe; PD: PipeDream (the chain linearisation); v=2: two stages per device; best "
  "v>1: the faster of v = 2 and 4 (v: which; 0 where none was found); gain: GP v=1 over the v "
  "> 1 plan; DAG/chain: PD over GP with the same v (above 1: the v > 1 plan, the DAG plan is "
  "faster). Every plan within 16 GiB per device. Modelled (the simulator's predictions), not "
  "measured."
)


def _cell(r: dict[str, Any], key: str, fmt: str) -> str:
  x = r[key]
  if key == "model":
    return "branches (8 towers)" if x == "branches" else MODEL_LABELS.get(x, x)
  if fmt == "s":
    return str(x)
  if isinstance(x, float) and math.isnan(x):
    return "-"
  return format(x, fmt)


def markdown(table: list[dict[str, Any]], command: str = "") -> str:
  """``rows``' table as markdown, with the legend (and ``command``, the line that made it)."""
  lines = [
    "| " + " | ".join(h for _, h, _ in COLUMNS) + " |",
    "|" + "|".join("---" for _ in COLUMNS) + "|",
  ]
  for r in table:
    lines.append("| " + " | ".join(_cell(r, k, f) for k, _, f in COLUMNS) + " |")
  out = "\n".join(lines) + "\n\n" + LEGEND
  if command:
    out += f" Made by `{command}`."
  return out + "\n"


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
    calibrate=cfg["calibrate"],
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
  carried = state  # as a training loop runs: each step takes the state the last one returned
  for _ in range(cfg["timed"]):
    t = time.perf_counter()
    *carried, _ = jax.block_until_ready(pp(*carried, batch))
    times.append(time.perf_counter() - t)
  del carried
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
    cfg = dict(
      devices=FLAGS.cpu_devices,
      v=v,
      width=FLAGS.width,
      timed=FLAGS.timed_steps,
      calibrate=FLAGS.calibrate,
    )
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
    f"modelled: {'host-aware (calibrated)' if FLAGS.calibrate else 'devices only'}\n"
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
    f"{'model':11s} {'N':>3s} {'M':>3s} {'GP v=1':>8s} {'GP v=2':>8s} {'gain':>6s} "
    f"{'PD v=2':>8s} {'DAG/ch':>6s} {'GP v>1':>8s} {'v':>2s} {'gain':>6s} {'PD same':>8s} "
    f"{'DAG/ch':>6s} {'s':>5s}"
  )

  def show(r: dict[str, Any]) -> None:
    print(
      f"{r['model']:11s} {r['devices']:3d} {r['microbatches']:3d} {r['gp_v1']:8.2f} "
      f"{r['gp_v2']:8.2f} {r['gain_v2']:6.3f} {r['pd_v2']:8.2f} {r['chain_v2']:6.3f} "
      f"{r['gp_many']:8.2f} {r['v']:2d} {r['gain']:6.3f} {r['pd_many']:8.2f} "
      f"{r['chain']:6.3f} {r['seconds']:5.1f}",
      flush=True,
    )
    if FLAGS.breakdown:
      for name, plan in r["plans"].items():
        if plan is None:
          continue
        b = breakdown(plan, r["graph"], r["cluster"])
        print(
          f"    {name}: {plan.num_stages} stages, {plan.schedule}; total {b['total']:.2f} ms = "
          f"compute {b['compute']:.2f} (busiest device {b['busiest']:.2f}, bubble "
          f"{b['compute'] / b['busiest'] - 1:.1%}) + transfers {b['transfers']:.2f} + update "
          f"{b['update']:.2f} (each alone; they overlap)"
          + (
            f" [{plan.predicted['shared_devices']}]" if "shared_devices" in plan.predicted else ""
          ),
          flush=True,
        )

  table = rows(FLAGS.models, FLAGS.devices, FLAGS.microbatches, FLAGS.schedule, progress=show)
  print("\n" + LEGEND)
  if FLAGS.markdown:
    with open(FLAGS.markdown, "w") as f:
      f.write(markdown(table, "python " + " ".join(sys.argv)))


if __name__ == "__main__":
  define_flags()
  app.run(main)
