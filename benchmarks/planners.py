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
  python benchmarks/planners.py --json=docs/planners.json --markdown=docs/planner_fidelity.md

``docs/results.md`` includes ``docs/planner_fidelity.md`` when the reproduction regenerates it.

``--scaling``: search seconds and peak resident memory of each planner alone (as
``python -m gpp_jax.plan --planner=NAME`` runs it) on each model at 32-1,024 devices, one
subprocess per run (``ru_maxrss`` of the child), with the simulated throughput of its plan.
``--tree=PATH`` runs the planners of another checkout of the repository (e.g. a ``git
worktree`` of an earlier commit), to compare before and after on the same machine:

  python benchmarks/planners.py --scaling --json=/tmp/after.json
  python benchmarks/planners.py --scaling --tree=/tmp/plan_before --json=/tmp/before.json

The mini-batch grows with the device count (``--per_device_batch``), as the paper sizes
mini-batches "close to the memory limit"; the paper's exact sizes are not recoverable.
"""

from __future__ import annotations

import json
import sys
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
flags.DEFINE_string(
  "markdown", "", "Also write the tables as markdown to this file (docs/planner_fidelity.md)."
)
flags.DEFINE_list(
  "from_json", [], "Plan nothing: read the rows of earlier --json runs (in order) and report."
)
flags.DEFINE_integer(
  "piper_max_devices", 64, "Run Piper only up to this many devices (its DP grows with them)."
)
flags.DEFINE_bool("scaling", False, "Search time and peak memory per planner, one process each.")
flags.DEFINE_list(
  "scaling_devices", ["32", "64", "128", "256", "512", "1024"], "Device counts for --scaling."
)
flags.DEFINE_list(
  "scaling_planners",
  ["graphpipe", "pipedream", "pipedream-published", "piper-published", "bapipe", "luo"],
  "Planners for --scaling.",
)
flags.DEFINE_string("tree", "", "--scaling: the repository checkout whose planners run.")
flags.DEFINE_integer("timeout", 600, "--scaling: seconds before a run is stopped.")

# One --scaling run in a fresh interpreter: gpp_jax (and its passes and models folders) from
# the checkout ``root``, then the planner's search time and the process's peak memory.
CHILD = """
import importlib.util, json, os, resource, sys, time
root, model, k, name = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
folders = {"gpp_jax": "gpp_jax", "gpp_jax.passes": "passes", "gpp_jax.models": "models"}

class Tree:
  @classmethod
  def find_spec(cls, fullname, path=None, target=None):
    if fullname not in folders:
      return None
    d = os.path.join(root, folders[fullname])
    return importlib.util.spec_from_file_location(
      fullname, os.path.join(d, "__init__.py"), submodule_search_locations=[d])

sys.meta_path.insert(0, Tree)
from gpp_jax.cost.cluster import v100_cluster
from gpp_jax.experiments.planner_runs import PER_DEVICE_BATCH, build_graph, run_planner
batch = PER_DEVICE_BATCH[model] * k
graph = build_graph(model, "paper", batch)
row = run_planner(name, graph, v100_cluster(k), batch)
row["maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(row))
"""


def scaling_run(root: str, model: str, k: int, name: str) -> dict:
  """One planner on one model and device count in a subprocess (see ``CHILD``)."""
  import subprocess

  cmd = [sys.executable, "-c", CHILD, root, model, str(k), name]
  row: dict[str, Any] = {"model": model, "devices": k, "planner": name}
  t0 = time.perf_counter()
  try:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=FLAGS.timeout, cwd="/")
  except subprocess.TimeoutExpired:
    return {**row, "error": f"over {FLAGS.timeout} s", "seconds": time.perf_counter() - t0}
  if out.returncode != 0:
    return {**row, "error": out.stderr.strip().splitlines()[-1:], "seconds": 0.0}
  return {**row, **json.loads(out.stdout.strip().splitlines()[-1])}


def scaling(models: list[str]) -> None:
  """``--scaling``: the table of search seconds, peak MB and throughput per planner."""
  import os

  root = os.path.abspath(FLAGS.tree or os.path.join(os.path.dirname(__file__), ".."))
  print(f"planners of {root}")
  print(
    f"{'model':10s} {'dev':>5s} {'planner':20s} {'search s':>9s} {'peak MB':>8s} "
    f"{'samples/s':>10s} {'stages':>6s}"
  )
  rows = []
  for model in models:
    for k in map(int, FLAGS.scaling_devices):
      for name in FLAGS.scaling_planners:
        r = scaling_run(root, model, k, name)
        rows.append(r)
        if "error" in r:
          print(
            f"{model:10s} {k:5d} {name:20s} {r['seconds']:9.2f} {'-':>8s} {str(r['error'])[:40]}",
            flush=True,
          )
        else:
          print(
            f"{model:10s} {k:5d} {name:20s} {r['seconds']:9.2f} {r['maxrss_mb']:8.0f} "
            f"{r['throughput']:10.1f} {r['stages']:6d}",
            flush=True,
          )
        if FLAGS.json:
          with open(FLAGS.json, "w") as f:
            json.dump(rows, f, indent=1)


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
    if name == "piper" and k > FLAGS.piper_max_devices:
      results[col] = {"planner": name, "error": "not run (--piper_max_devices)", "seconds": 0.0}
      continue
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


def markdown(rows: list[dict], command: str, note: str = "") -> str:
  """The benchmark's two tables (throughput, search seconds) as markdown."""
  cols = ["GraphPipe"] + [c for c, _, _ in BASELINES]
  names = {
    "PD pub": "PipeDream (published)",
    "Piper pub": "Piper (published)",
    "PD": "PipeDream (polished)",
    "Piper": "Piper (polished)",
    "BaPipe": "BaPipe (polished)",
    "Luo": "Luo (polished)",
  }
  out = [
    "## (f) GraphPipe vs the baselines as published and as polished",
    "",
    f"Generated by `{command}`{note}. Simulated samples/s on the V100 preset; DLRM as the paper "
    "describes it (concatenated bags, interaction input 73,472 wide). *Published*: the "
    "planner's own objective (smallest bottleneck TPS per micro-batch size, the size by the "
    "analytic 1F1B time), no simulation ranking, no polish. *Polished*: simulation-ranked "
    "candidates improved by `refine.polish`. GraphPipe is given the polished plans as "
    "candidates (`seed_plans`), so it is never below them; `from` names the planner whose "
    "plan it returned when that was a seed. `fail` = no plan (Piper: more than 40,000 "
    "downsets); `not run` = Piper skipped at that device count (`--piper_max_devices`).",
    "",
    "| model | devices | batch | "
    + " | ".join(names.get(c, c) for c in cols)
    + " | GP / PipeDream pub | GP / best pub | GP / best polished | from |",
    "|" + "---|" * (len(cols) + 7),
  ]
  for r in rows:
    res = r["results"]
    cells = [
      f"{res[c]['throughput']:.1f}"
      if "throughput" in res[c]
      else ("not run" if res[c]["error"].startswith("not run") else "fail")
      for c in cols
    ]
    ratios = [
      fmt(r[k], 0, 3).strip()
      for k in ("gp_over_pd_published", "gp_over_best_published", "gp_over_best_polished")
    ]
    out.append(
      f"| {r['model']} | {r['devices']} | {r['batch']} | "
      + " | ".join(cells + ratios)
      + f" | {res['GraphPipe'].get('from_seed') or 'GraphPipe'} |"
    )
  out += [
    "",
    "Search seconds (wall clock on a shared machine; a failed planner's time is the time it "
    "took to give up, `-` = not run). GraphPipe's time is its own search (the seeds it is "
    "given are the baselines' plans, timed in their columns), split into the DP runs, the "
    "chain seeds and the polish.",
    "",
    "| model | devices | "
    + " | ".join(names.get(c, c) for c in cols)
    + " | GP DP / seeds / polish | PipeDream pub / GP | Piper pub / GP |",
    "|" + "---|" * (len(cols) + 5),
  ]
  for r in rows:
    res = r["results"]
    gs = res["GraphPipe"]["seconds"]
    sp = res["GraphPipe"].get("split", {})
    pp = res["Piper pub"]
    out.append(
      f"| {r['model']} | {r['devices']} | "
      + " | ".join(
        "-" if res[c].get("error", "").startswith("not run") else f"{res[c]['seconds']:.2f}"
        for c in cols
      )
      + " | "
      + " / ".join(f"{sp.get(x, 0):.2f}" for x in ("dp_seconds", "seeds_seconds", "polish_seconds"))
      + f" | {res['PD pub']['seconds'] / gs:.2f} | "
      + (f"{pp['seconds'] / gs:.2f}" if "throughput" in pp else "-")
      + " |"
    )
  return "\n".join(out) + "\n"


def main(argv):
  del argv
  if FLAGS.scaling:
    scaling(FLAGS.models)
    return
  if FLAGS.from_json:
    rows = []
    for path in FLAGS.from_json:
      with open(path) as f:
        rows += json.load(f)
    report(rows)
    return
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
  report(rows)


def report(rows: list[dict]) -> None:
  """Errors, the targets checked against the rows, and the markdown file if asked."""
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
  if FLAGS.markdown:
    command = "python benchmarks/planners.py " + " ".join(sys.argv[1:])
    note = (
      " from the rows of earlier `--json` runs (docs/results/planning.md lists them)"
      if FLAGS.from_json
      else ""
    )
    with open(FLAGS.markdown, "w") as f:
      f.write(markdown(rows, command, note))
    print(f"wrote {FLAGS.markdown}")


if __name__ == "__main__":
  app.run(main)
