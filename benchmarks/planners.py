"""Planner benchmark: GraphPipe vs published and polished sequential baselines.

For MMT, DLRM (as the paper describes it: concatenated bags) and CANDLE-Uno at the paper's
shapes on the V100 preset (4 GPUs per node, NVLink, 100 Gb/s between nodes) at 8, 16, 32 and
64 devices, runs side by side in one process:

  * PipeDream and Piper as published (``selection="published"``: their own objective, the
    smallest bottleneck TPS, no simulation ranking, no polish);
  * PipeDream, Piper, BaPipe and Luo et al. polished (simulation-ranked, ``refine.polish``);
  * GraphPipe, given the polished sequential plans as candidates (``seed_plans``), so its plan
    is never slower than any of them; its search time is its own (the baselines' searches are
    in their columns), split into the DP, the chain seeds and the polish.

It prints the simulated throughput (samples/s) of each, GraphPipe's ratios to published
PipeDream, to the best published baseline and to the best polished one, every planner's search
seconds, and, last, the issue's targets checked against the numbers.

  python benchmarks/planners.py
  python benchmarks/planners.py --models=candle_uno --devices=8,16 --json=/tmp/planners.json

The mini-batch grows with the device count (``--per_device_batch``), as the paper sizes
mini-batches "close to the memory limit"; the paper's exact sizes are not recoverable.
"""

from __future__ import annotations

import json
import time
from typing import Any

from absl import app, flags

from gpp_jax.cost.cluster import v100_cluster
from gpp_jax.experiments.planner_runs import (
  PER_DEVICE_BATCH,
  build_graph,
  run_planner,
  short_error,
)

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["mmt", "dlrm", "candle_uno"], "Model presets to plan.")
flags.DEFINE_list("devices", ["8", "16", "32", "64"], "Device counts.")
flags.DEFINE_string(
  "per_device_batch",
  ",".join(f"{m}={PER_DEVICE_BATCH[m]}" for m in ("mmt", "dlrm", "candle_uno")),
  "Samples per device of the mini-batch, per model.",
)
flags.DEFINE_integer("candle_branches", 7, "CANDLE-Uno branch count (the paper sweeps 2-16).")
flags.DEFINE_string("json", "", "Also write the results to this JSON file (after every row).")

# (column, planner, options); the published ones first.
BASELINES: tuple[tuple[str, str, dict[str, Any]], ...] = (
  ("PD pub", "pipedream", {"selection": "published"}),
  ("Piper pub", "piper", {"selection": "published"}),
  ("PD", "pipedream", {}),
  ("Piper", "piper", {}),
  ("BaPipe", "bapipe", {}),
  ("Luo", "luo", {}),
)
PUBLISHED = ("PD pub", "Piper pub")
POLISHED = ("PD", "Piper", "BaPipe", "Luo")


def best_of(results: dict, columns) -> tuple[str, dict] | None:
  ok = [(c, results[c]) for c in columns if "throughput" in results[c]]
  return max(ok, key=lambda x: x[1]["throughput"]) if ok else None


def run_config(model: str, k: int, batch: int) -> dict:
  shape = {"branches": FLAGS.candle_branches} if model == "candle_uno" else {}
  graph = build_graph(model, "paper", batch, **shape)
  cluster = v100_cluster(k)
  results = {}
  for col, name, opts in BASELINES:
    r = run_planner(name, graph, cluster, batch, keep_plan=True, **opts)
    if "error" in r:
      r["error"] = short_error(r)
    results[col] = r
  seeds = [results[c]["plan"] for c in POLISHED if "plan" in results[c]]
  gp = run_planner(
    "graphpipe", graph, cluster, batch, keep_plan=True, seed_plans=seeds, chain_plans=False
  )
  if "plan" in gp:
    plan = gp.pop("plan")
    s = plan.predicted["search"]
    gp["split"] = {x: s[x] for x in ("dp_seconds", "seeds_seconds", "polish_seconds", "dp_runs")}
    gp["from_seed"] = plan.predicted.get("seed")
  results["GraphPipe"] = gp
  for r in results.values():
    r.pop("plan", None)
  return {
    "model": model,
    "devices": k,
    "batch": batch,
    "layers": graph.number_of_nodes(),
    "results": results,
  }


def ratio(a: dict, b: dict | None) -> float | None:
  if b is None or "throughput" not in a or "throughput" not in b:
    return None
  return a["throughput"] / b["throughput"]


def fmt(x: float | None, w: int = 6, p: int = 3) -> str:
  return f"{x:{w}.{p}f}" if x is not None else f"{'-':>{w}s}"


def main(argv):
  del argv
  per_dev = dict(kv.split("=") for kv in FLAGS.per_device_batch.split(","))
  cols = ["GraphPipe"] + [c for c, _, _ in BASELINES]
  header = (
    f"{'model':10s} {'dev':>3s} {'batch':>5s} | "
    + " ".join(f"{c:>9s}" for c in cols)
    + " | GP/PDpub GP/pub GP/pol | search s: "
    + " ".join(f"{c:>9s}" for c in cols)
    + " | GP dp/seeds/polish s"
  )
  print("Throughput (samples/s, simulated) and search seconds")
  print(header)
  print("-" * len(header))
  rows = []
  t_all = time.perf_counter()
  for model in FLAGS.models:
    for k in map(int, FLAGS.devices):
      batch = int(per_dev[model]) * k
      row = run_config(model, k, batch)
      res = row["results"]
      gp = res["GraphPipe"]
      pub = best_of(res, PUBLISHED)
      pol = best_of(res, POLISHED)
      row["gp_over_pd_published"] = ratio(gp, res["PD pub"])
      row["gp_over_best_published"] = ratio(gp, pub[1] if pub else None)
      row["gp_over_best_polished"] = ratio(gp, pol[1] if pol else None)
      tput = " ".join(
        f"{r['throughput']:9.1f}" if "throughput" in r else f"{'fail':>9s}"
        for r in (res[c] for c in cols)
      )
      secs = " ".join(f"{res[c]['seconds']:9.2f}" for c in cols)
      split = gp.get("split", {})
      print(
        f"{model:10s} {k:3d} {batch:5d} | {tput} | {fmt(row['gp_over_pd_published'], 8)} "
        f"{fmt(row['gp_over_best_published'])} {fmt(row['gp_over_best_polished'])} | "
        f"{' ' * 10}{secs} | "
        + "/".join(
          f"{split.get(x, 0):.2f}" for x in ("dp_seconds", "seeds_seconds", "polish_seconds")
        ),
        flush=True,
      )
      rows.append(row)
      if FLAGS.json:
        with open(FLAGS.json, "w") as f:
          json.dump(rows, f, indent=1)
  print(f"\nTotal {time.perf_counter() - t_all:.0f} s.")
  for r in rows:
    for c, x in r["results"].items():
      if "error" in x:
        print(f"  {r['model']} x{r['devices']} {c}: {x['error']}")
  # The targets.
  print("\nTargets:")
  at32 = [r for r in rows if r["devices"] == 32]
  for r in at32:
    g = r["gp_over_pd_published"]
    print(f"  {r['model']} x32: GraphPipe / published PipeDream = {fmt(g)} (target >= 1.25)")
  below = [
    (r["model"], r["devices"], r["gp_over_best_polished"])
    for r in rows
    if r["gp_over_best_polished"] is not None and r["gp_over_best_polished"] < 1 - 1e-9
  ]
  print(f"  configurations where GraphPipe is below a polished baseline: {below or 'none'}")
  for r in at32:
    res = r["results"]
    gs = res["GraphPipe"]["seconds"]
    pd = res["PD pub"]["seconds"] / gs
    pp = res["Piper pub"]["seconds"] / gs if "throughput" in res["Piper pub"] else None
    print(
      f"  {r['model']} x32: GraphPipe {gs:.2f} s (target < 2 s); published PipeDream / "
      f"GraphPipe search time {pd:.2f}x, published Piper / GraphPipe {fmt(pp, 5, 2)}x "
      "(target >= 9x)"
    )
  mmt32 = [r for r in at32 if r["model"] == "mmt"]
  if mmt32:
    ok = "throughput" in mmt32[0]["results"]["Piper pub"]
    print(f"  Piper plans MMT x32: {'yes' if ok else 'no'}")


if __name__ == "__main__":
  app.run(main)
