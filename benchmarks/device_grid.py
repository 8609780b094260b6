"""The DPs' coarse device grid against the exact DP: plans, search seconds, idle devices.

Above 32 (GraphPipe) and 64 (PipeDream) devices the DP planners count devices in slots of a
power of two (``device_grid``, ``problem.device_unit``), so their tables do not grow with the
cluster; the polish then moves single devices. This script plans each model at each device
count with GraphPipe and PipeDream twice, side by side in one process:

  * coarse: the defaults (GraphPipe ``device_grid=32``, its chain seeds and PipeDream seed at
    PipeDream's ``device_grid=64``; PipeDream ``device_grid=64``);
  * exact: ``device_grid=None`` everywhere (GraphPipe also ``chain_device_grid=None``), slots
    of one device.

It prints each plan's predicted iteration time (modelled: the simulator on the V100 preset,
nothing is run), the ratio coarse / exact (above 1: the coarse grid's plan is slower), the
search seconds of each (wall clock of the planner call, each on a fresh ``PlanningProblem``;
the coarse run goes first, so the exact one meets the process's caches warm), the idle
devices of each, and whether every stage of the exact plan has a multiple of the coarse DP's
slot of devices (``e in grid``: the coarse grid could express its stages); then the reasons
the planners give for idle devices (``predicted["idle_reason"]``).

  python benchmarks/device_grid.py
  python benchmarks/device_grid.py --models=dlrm --devices=64,128 --json=/tmp/device_grid.json

The exact DP grows with the cluster (its tables are devices x depth per sub-problem): it runs
only up to ``--exact_max_devices`` and each exact search is stopped after
``--exact_timeout`` seconds; the table says so where either applies. Models: MMT, DLRM (the
paper's concatenated bags) and CANDLE-Uno at the paper's shapes (``--preset=tiny``: the same
topologies, narrow), and GPT (a chain), from ``experiments.planner_runs.build_graph``; the
mini-batch is ``PER_DEVICE_BATCH`` samples per device, as in ``benchmarks/planners.py``
(``--batch_size``: one fixed mini-batch at every device count).
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

from absl import app, flags

from gpp_jax.cost.cluster import v100_cluster
from gpp_jax.experiments.planner_runs import PER_DEVICE_BATCH, build_graph, run_planner
from gpp_jax.passes.partition.problem import device_unit

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["mmt", "dlrm", "candle_uno", "gpt"], "Models to plan.")
flags.DEFINE_enum("preset", "paper", ["paper", "tiny"], "Their shapes (planner_runs.PRESETS).")
flags.DEFINE_list("devices", ["64", "128", "256"], "Device counts (V100 preset).")
flags.DEFINE_integer(
  "batch_size", 0, "A fixed mini-batch for every device count (0: PER_DEVICE_BATCH per device)."
)
flags.DEFINE_list("planners", ["graphpipe", "pipedream"], "Planners: graphpipe, pipedream.")
flags.DEFINE_integer(
  "exact_max_devices", 256, "Run the exact DP only up to this many devices (it grows with them)."
)
flags.DEFINE_integer("exact_timeout", 180, "Stop an exact search after this many seconds.")
flags.DEFINE_string("json", "", "Also write the rows to this JSON file (after every row).")

# Per planner: (its default grid, its options for the exact DP).
GRIDS: dict[str, tuple[int, dict[str, Any]]] = {
  "graphpipe": (32, {"device_grid": None, "chain_device_grid": None}),
  "pipedream": (64, {"device_grid": None}),
}


@contextlib.contextmanager
def time_limit(seconds: int) -> Iterator[None]:
  """Raises TimeoutError in the block after ``seconds`` (SIGALRM; the DPs are Python loops
  over numpy calls, which it interrupts between calls)."""

  def alarm(signum, frame):
    raise TimeoutError(f"over {seconds} s, stopped (--exact_timeout)")

  old = signal.signal(signal.SIGALRM, alarm)
  signal.alarm(seconds)
  try:
    yield
  finally:
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def plan_once(name: str, graph, cluster, batch: int, limit: int | None, **options) -> dict:
  """One planner run as a row (``run_planner``), with the plan's idle reason; ``limit``:
  seconds before it is stopped (a row with ``error``)."""
  t0 = time.perf_counter()
  try:
    with time_limit(limit) if limit else contextlib.nullcontext():
      row = run_planner(name, graph, cluster, batch, keep_plan=True, **options)
  except TimeoutError as e:
    return {"planner": name, "error": str(e), "seconds": time.perf_counter() - t0}
  plan = row.pop("plan", None)
  if plan is not None:
    row["idle_reason"] = plan.predicted.get("idle_reason")
    row["widths"] = [len(s.devices) for s in plan.stages]
  return row


def run_config(model: str, k: int, name: str) -> dict:
  """Coarse and exact plans of ``name`` for ``model`` on ``k`` V100s."""
  batch = FLAGS.batch_size or PER_DEVICE_BATCH[model] * k
  graph = build_graph(model, FLAGS.preset, batch)
  cluster = v100_cluster(k)
  grid, exact_options = GRIDS[name]
  row: dict[str, Any] = {
    "model": model,
    "devices": k,
    "batch": batch,
    "planner": name,
    "unit": device_unit(k, grid),
  }
  row["coarse"] = plan_once(name, graph, cluster, batch, None)
  if k > FLAGS.exact_max_devices:
    row["exact"] = {"error": "not run (--exact_max_devices)", "seconds": 0.0}
  else:
    row["exact"] = plan_once(name, graph, cluster, batch, FLAGS.exact_timeout, **exact_options)
  c, e = row["coarse"], row["exact"]
  if "iteration_time" in c and "iteration_time" in e:
    row["ratio"] = c["iteration_time"] / e["iteration_time"]
    # Whether the exact plan's stage widths are all multiples of the coarse DP's slot (the
    # coarse DP could then have built its stages; the polish moves single devices anyway).
    row["exact_in_grid"] = all(w % row["unit"] == 0 for w in e["widths"])
  return row


def cell(r: dict, key: str, fmt: str) -> str:
  return format(r[key], fmt) if key in r else "-"


def main(argv):
  del argv
  print(
    f"Coarse device grid (the default) against the exact DP (device_grid=None), {FLAGS.preset} "
    "shapes: predicted iteration times are modelled (simulated on the V100 preset), nothing "
    "is run; search seconds are wall clock on this machine."
  )
  header = (
    f"{'model':10s} {'dev':>4s} {'planner':9s} {'unit':>4s} | {'coarse ms':>10s} "
    f"{'exact ms':>10s} {'c/e':>6s} | {'coarse s':>8s} {'exact s':>8s} | "
    f"{'idle c':>6s} {'idle e':>6s} {'e in grid':>9s}"
  )
  print(header)
  print("-" * len(header))
  rows = []
  t_all = time.perf_counter()
  for model in FLAGS.models:
    for k in map(int, FLAGS.devices):
      for name in FLAGS.planners:
        r = run_config(model, k, name)
        rows.append(r)
        c, e = r["coarse"], r["exact"]
        ms = [
          f"{x['iteration_time'] * 1e3:10.3f}" if "iteration_time" in x else f"{'-':>10s}"
          for x in (c, e)
        ]
        exact_s = "-" if e.get("error", "").startswith("not run") else f"{e['seconds']:.2f}"
        print(
          f"{model:10s} {k:4d} {name:9s} {r['unit']:4d} | {ms[0]} {ms[1]} "
          f"{cell(r, 'ratio', '6.3f'):>6s} | {c['seconds']:8.2f} "
          f"{exact_s:>8s} | "
          f"{cell(c, 'idle_devices', 'd'):>6s} {cell(e, 'idle_devices', 'd'):>6s} "
          f"{({True: 'yes', False: 'no'}).get(r.get('exact_in_grid'), '-'):>9s}",
          flush=True,
        )
        if FLAGS.json:
          with open(FLAGS.json, "w") as f:
            json.dump(rows, f, indent=1)
  print(
    f"\nTotal {time.perf_counter() - t_all:.0f} s. unit: the coarse DP's slot of devices; "
    "e in grid: every stage of the exact plan has a multiple of unit devices."
  )
  ratios = [r["ratio"] for r in rows if "ratio" in r]
  if ratios:
    print(
      f"coarse / exact over {len(ratios)} pairs: min {min(ratios):.3f}, max {max(ratios):.3f} "
      "(modelled)"
    )
  for r in rows:
    for which in ("coarse", "exact"):
      x = r[which]
      if "error" in x:
        print(f"  {r['model']} x{r['devices']} {r['planner']} {which}: {x['error']}")
      elif x.get("idle_reason"):
        print(
          f"  {r['model']} x{r['devices']} {r['planner']} {which}: {x['idle_devices']} idle: "
          f"{x['idle_reason']}"
        )
  print("command: python benchmarks/device_grid.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
  app.run(main)
