"""Reproduces the GraphPipe paper's comparisons in simulation, and checks real pipelined training.

  python -m gpp_jax.experiments.reproduce                    # full sweep, writes docs/
  python -m gpp_jax.experiments.reproduce --quick --out_dir=/tmp/repro

On the V100 preset (``gpp_jax.cost.cluster.v100_cluster``: 4 V100 16 GB per node, NVLink, 100 Gb/s
InfiniBand) at the paper's shapes (``gpp_jax.experiments.model_graphs``), every planner plans and the
simulator predicts; nothing runs on a GPU. Tables, one CSV each in ``--out_dir``:

  throughput.csv   (a) throughput vs device count, MMT / DLRM / CANDLE-Uno, every planner
                       (the paper's Fig. 6)
  branches.csv     (b) CANDLE-Uno with 2-16 branches at a fixed device count, GraphPipe vs the
                       best sequential plan and vs PipeDream (Fig. 7 left)
  microbatch.csv   (c) MMT on 8 devices, mini-batch 128, one fixed micro-batch size per row
                       (Fig. 7 right)
  ablation.csv     (d) at 32 devices: GraphPipe's stage graph at the micro-batch size the best
                       sequential plan chose ("parallel") vs full GraphPipe (Fig. 9)
  search_time.csv  (e) planner search time per model and device count (Table 1)
  loss_check.csv   real training: ``gpp_jax.experiments.loss_curves`` on 8 forced CPU devices,
                       pipelined vs one device, max loss difference per tiny model

plus ``results.md`` (the tables, the paper's reported figures beside ours where they survive,
ours/paper ratios) and PNG plots when matplotlib is importable (the ``plots`` extra).

``--quick`` runs a reduced sweep (4 and 8 devices, 2 and 4 branches at 8 devices, two
micro-batch sizes, the ablation at 8 devices, 20 training steps).
"""
from __future__ import annotations

import csv
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

from gpp_jax.passes.partition import SEQUENTIAL_PLANNERS
from gpp_jax.passes.partition.plan_assembly import microbatch_sizes
from gpp_jax.cost.cluster import make_cluster
from gpp_jax.experiments.planner_runs import (MODEL_LABELS, best_row, build_graph, default_batch_size,
                                  run_planner, short_error)

ALL_PLANNERS = ("graphpipe",) + tuple(SEQUENTIAL_PLANNERS)
# The sequential planners the paper compares against (Fig. 6, Table 1).
PAPER_BASELINES = ("pipedream", "piper")


@dataclasses.dataclass(frozen=True)
class Sweep:
  """What the reproduction runs.

  Attributes:
    models: models of the device sweep and the ablation.
    devices: device counts of the device sweep.
    planners: planners to run; "graphpipe" must be among them.
    preset: model shapes ("paper" or "tiny", see ``gpp_jax.experiments.planner_runs``).
    cluster: cluster preset ("v100" or "cpu").
    branches: CANDLE-Uno branch counts of the branch sweep.
    branch_devices: device count of the branch sweep.
    microbatch_model, microbatch_devices, microbatch_batch: the micro-batch sweep's set-up
      (the paper: MMT, 8 GPUs, mini-batch 128).
    microbatch_list: micro-batch sizes of that sweep (empty: every power of two dividing the
      mini-batch).
    ablation_devices: device count of the ablation.
    loss_models, steps: the real-training check (zoo models, tiny presets).
  """
  models: tuple[str, ...] = ("mmt", "dlrm", "candle_uno")
  devices: tuple[int, ...] = (4, 8, 16, 32)
  planners: tuple[str, ...] = ALL_PLANNERS
  preset: str = "paper"
  cluster: str = "v100"
  branches: tuple[int, ...] = (2, 4, 8, 16)
  branch_devices: int = 32
  microbatch_model: str = "mmt"
  microbatch_devices: int = 8
  microbatch_batch: int = 128
  microbatch_list: tuple[int, ...] = ()
  ablation_devices: int = 32
  loss_models: tuple[str, ...] = ("mmt", "dlrm", "candle_uno")
  steps: int = 200

  def __post_init__(self):
    if "graphpipe" not in self.planners:
      raise ValueError(f"the sweep compares against GraphPipe; planners {self.planners} lack it")


FULL = Sweep()
QUICK = Sweep(devices=(4, 8), branches=(2, 4), branch_devices=8, microbatch_list=(8, 32),
              ablation_devices=8, steps=20)

# Columns of each table (CSV header order).
THROUGHPUT_COLUMNS = ("model", "devices", "batch", *[f"{p}" for p in ALL_PLANNERS],
                      "graphpipe_stages", "graphpipe_depth", "graphpipe_microbatch",
                      "best_sequential", "best_sequential_planner", "best_sequential_stages",
                      "best_sequential_microbatch", "speedup", "failed")
SEARCH_COLUMNS = ("model", "devices", *[f"{p}_s" for p in ALL_PLANNERS], "failed",
                  "pipedream_over_graphpipe", "piper_over_graphpipe")
BRANCH_COLUMNS = ("branches", "devices", "batch", "graphpipe", "graphpipe_stages",
                  "graphpipe_depth", "graphpipe_microbatch", "pipedream", "pipedream_stages",
                  "best_sequential", "best_sequential_planner", "speedup",
                  "speedup_vs_pipedream")
MICROBATCH_COLUMNS = ("microbatch", "num_microbatches", *ALL_PLANNERS, "graphpipe_depth",
                      "best_sequential", "best_sequential_planner", "best_sequential_depth",
                      "speedup")
ABLATION_COLUMNS = ("model", "devices", "batch", "sequential", "sequential_planner",
                    "sequential_microbatch", "parallel", "parallel_depth", "full",
                    "full_microbatch", "full_depth", "parallel_speedup", "full_speedup")
LOSS_COLUMNS = ("model", "dtype", "steps", "stages", "depth", "loss_first", "loss_last", "max_diff",
                "max_rel_diff", "first_step_over_1e-5", "error")


def _log(msg: str) -> None:
  print(msg, flush=True)


def _run(name: str, graph, cluster, batch: int, **kw) -> dict[str, Any]:
  row = run_planner(name, graph, cluster, batch, **kw)
  if "error" in row:
    row["error"] = short_error(row)
  return row


# ----------------------------------------------------------------------------------- sweeps
# Each sweep returns long-form rows: one per (configuration, planner), the fields of
# ``planner_runs.run_planner`` plus the configuration. The table builders below pivot them.

def device_sweep(sweep: Sweep, log: Callable[[str], None] = _log) -> list[dict[str, Any]]:
  """(a)/(e): every planner on every model and device count."""
  rows = []
  for model in sweep.models:
    for k in sweep.devices:
      batch = default_batch_size(model, k)
      graph = build_graph(model, sweep.preset, batch)
      cluster = make_cluster(sweep.cluster, k)
      for name in sweep.planners:
        r = _run(name, graph, cluster, batch)
        rows.append({"model": model, "devices": k, "batch": batch, **r})
      log(f"  {model} x{k}: " + ", ".join(_brief(r) for r in rows[-len(sweep.planners):]))
  return rows


def branch_sweep(sweep: Sweep, log: Callable[[str], None] = _log) -> list[dict[str, Any]]:
  """(b): CANDLE-Uno with each branch count at ``branch_devices`` devices."""
  rows = []
  k = sweep.branch_devices
  batch = default_batch_size("candle_uno", k)
  cluster = make_cluster(sweep.cluster, k)
  for b in sweep.branches:
    graph = build_graph("candle_uno", sweep.preset, batch, branches=b)
    for name in sweep.planners:
      rows.append({"model": f"candle_uno:branches={b}", "branches": b, "devices": k,
                   "batch": batch, **_run(name, graph, cluster, batch)})
    log(f"  candle_uno {b} branches x{k}: "
        + ", ".join(_brief(r) for r in rows[-len(sweep.planners):]))
  return rows


def microbatch_sweep(sweep: Sweep, log: Callable[[str], None] = _log) -> list[dict[str, Any]]:
  """(c): one model at a fixed device count and mini-batch, one fixed micro-batch size at a
  time (every planner gets ``num_microbatches = batch / microbatch``)."""
  rows = []
  B, k = sweep.microbatch_batch, sweep.microbatch_devices
  graph = build_graph(sweep.microbatch_model, sweep.preset, B)
  cluster = make_cluster(sweep.cluster, k)
  sizes = list(sweep.microbatch_list) or microbatch_sizes(B)
  for b in sizes:
    for name in sweep.planners:
      rows.append({"model": sweep.microbatch_model, "devices": k, "batch": B, "microbatch_size": b,
                   **_run(name, graph, cluster, B, num_microbatches=B // b)})
    log(f"  {sweep.microbatch_model} micro-batch {b} x{k}: "
        + ", ".join(_brief(r) for r in rows[-len(sweep.planners):]))
  return rows


def ablation(sweep: Sweep, device_rows: Sequence[Mapping[str, Any]] = (),
             log: Callable[[str], None] = _log) -> list[dict[str, Any]]:
  """(d): per model at ``ablation_devices``: the best sequential plan, GraphPipe at that plan's
  micro-batch size ("parallel": the stage-graph effect alone) and full GraphPipe (its own
  micro-batch choice). Reuses ``device_rows`` of that device count when given."""
  k = sweep.ablation_devices
  out = []
  for model in sweep.models:
    have = [r for r in device_rows if r["model"] == model and r["devices"] == k]
    batch = default_batch_size(model, k)
    graph = build_graph(model, sweep.preset, batch)
    cluster = make_cluster(sweep.cluster, k)
    if not have:
      have = [{"model": model, "devices": k, "batch": batch, **_run(n, graph, cluster, batch)}
              for n in sweep.planners]
    full = next(r for r in have if r["planner"] == "graphpipe")
    seq = best_row(have, [p for p in sweep.planners if p != "graphpipe"])
    row = {"model": model, "devices": k, "batch": batch, "full": full.get("throughput"),
           "full_microbatch": full.get("microbatch"), "full_depth": full.get("depth")}
    if seq is not None:
      par = _run("graphpipe", graph, cluster, batch,
                 num_microbatches=batch // seq["microbatch"])
      row.update(sequential=seq["throughput"], sequential_planner=seq["planner"],
                 sequential_microbatch=seq["microbatch"], parallel=par.get("throughput"),
                 parallel_depth=par.get("depth"))
    out.append(row)
    log(f"  ablation {model} x{k}: sequential {_num(row.get('sequential'))} "
        f"({row.get('sequential_planner')}, mb {row.get('sequential_microbatch')}), parallel "
        f"{_num(row.get('parallel'))}, full {_num(row['full'])} (mb {row['full_microbatch']})")
  return [_with_ratios(r) for r in out]


def _with_ratios(row: dict[str, Any]) -> dict[str, Any]:
  seq = row.get("sequential")
  row["parallel_speedup"] = _ratio(row.get("parallel"), seq)
  row["full_speedup"] = _ratio(row.get("full"), seq)
  return {c: row.get(c) for c in ABLATION_COLUMNS}


def _ratio(a, b) -> float | None:
  return a / b if a and b else None


def _num(x) -> str:
  return "-" if x is None else f"{x:.1f}"


def _brief(r: Mapping[str, Any]) -> str:
  if "error" in r:
    return f"{r['planner']} failed ({r['seconds']:.2f} s)"
  return f"{r['planner']} {r['throughput']:.1f}/s ({r['seconds']:.2f} s)"


# --------------------------------------------------------------------------- table builders

def _group(rows: Iterable[Mapping[str, Any]], keys: Sequence[str]) -> dict[tuple, list]:
  groups: dict[tuple, list] = {}
  for r in rows:
    groups.setdefault(tuple(r[k] for k in keys), []).append(r)
  return groups


def _planners_of(rows: Sequence[Mapping[str, Any]]) -> list[str]:
  return list(dict.fromkeys(r["planner"] for r in rows))


def throughput_table(device_rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
  """(a): one row per (model, devices): each planner's throughput (None: it failed), GraphPipe's
  shape, the best sequential plan and GraphPipe / best sequential."""
  out = []
  for (model, k), rows in _group(device_rows, ("model", "devices")).items():
    by = {r["planner"]: r for r in rows}
    gp = by.get("graphpipe", {})
    seq = best_row(rows, [p for p in by if p != "graphpipe"])
    row = {"model": model, "devices": k, "batch": rows[0]["batch"]}
    row.update({p: by[p].get("throughput") if p in by else None for p in ALL_PLANNERS})
    row.update(graphpipe_stages=gp.get("stages"), graphpipe_depth=gp.get("depth"),
               graphpipe_microbatch=gp.get("microbatch"),
               best_sequential=seq and seq["throughput"],
               best_sequential_planner=seq and seq["planner"],
               best_sequential_stages=seq and seq["stages"],
               best_sequential_microbatch=seq and seq["microbatch"],
               speedup=_ratio(gp.get("throughput"), seq and seq["throughput"]),
               failed=" ".join(r["planner"] for r in rows if "error" in r))
    out.append(row)
  return out


def search_time_table(device_rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
  """(e): one row per (model, devices): each planner's search seconds (a failed planner's
  seconds are the time it took to give up, and it is listed in ``failed``), and PipeDream's and
  Piper's time over GraphPipe's (None when that planner failed)."""
  out = []
  for (model, k), rows in _group(device_rows, ("model", "devices")).items():
    by = {r["planner"]: r for r in rows}
    row = {"model": model, "devices": k}
    row.update({f"{p}_s": by[p]["seconds"] if p in by else None for p in ALL_PLANNERS})
    row["failed"] = " ".join(r["planner"] for r in rows if "error" in r)
    gp = by.get("graphpipe", {})
    for p in PAPER_BASELINES:
      ok = p in by and "error" not in by[p] and "error" not in gp and gp
      row[f"{p}_over_graphpipe"] = by[p]["seconds"] / gp["seconds"] if ok else None
    out.append(row)
  return out


def branch_table(branch_rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
  """(b): one row per branch count: GraphPipe, PipeDream and the best sequential plan."""
  out = []
  for (b,), rows in _group(branch_rows, ("branches",)).items():
    by = {r["planner"]: r for r in rows}
    gp, pd = by.get("graphpipe", {}), by.get("pipedream", {})
    seq = best_row(rows, [p for p in by if p != "graphpipe"])
    out.append({"branches": b, "devices": rows[0]["devices"], "batch": rows[0]["batch"],
                "graphpipe": gp.get("throughput"), "graphpipe_stages": gp.get("stages"),
                "graphpipe_depth": gp.get("depth"), "graphpipe_microbatch": gp.get("microbatch"),
                "pipedream": pd.get("throughput"), "pipedream_stages": pd.get("stages"),
                "best_sequential": seq and seq["throughput"],
                "best_sequential_planner": seq and seq["planner"],
                "speedup": _ratio(gp.get("throughput"), seq and seq["throughput"]),
                "speedup_vs_pipedream": _ratio(gp.get("throughput"), pd.get("throughput"))})
  return out


def microbatch_table(mb_rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
  """(c): one row per micro-batch size: each planner's throughput at that fixed size."""
  out = []
  for (b,), rows in _group(mb_rows, ("microbatch_size",)).items():
    by = {r["planner"]: r for r in rows}
    gp = by.get("graphpipe", {})
    seq = best_row(rows, [p for p in by if p != "graphpipe"])
    row = {"microbatch": b, "num_microbatches": rows[0]["batch"] // b}
    row.update({p: by[p].get("throughput") if p in by else None for p in ALL_PLANNERS})
    row.update(graphpipe_depth=gp.get("depth"), best_sequential=seq and seq["throughput"],
               best_sequential_planner=seq and seq["planner"],
               best_sequential_depth=seq and seq["depth"],
               speedup=_ratio(gp.get("throughput"), seq and seq["throughput"]))
    out.append(row)
  return out


# ------------------------------------------------------------------------- real training

def loss_check(models: Sequence[str], steps: int, timeout: float = 3600,
               dtypes: Sequence[str] = ("float32", "float64")) -> list[dict[str, Any]]:
  """Runs ``gpp_jax.experiments.loss_curves`` in a subprocess with 8 forced CPU devices, once
  per precision in ``dtypes``, and returns one row per (model, dtype): plan shape, one-device
  loss at the first and last step, the largest |pipelined - one device| loss difference
  (absolute and relative to the one-device loss) and the first step (1-based) where it exceeds
  1e-5 (``error`` if the run failed)."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
  env["JAX_PLATFORMS"] = "cpu"
  rows = []
  for dtype in dtypes:
    with tempfile.TemporaryDirectory() as tmp:
      out = os.path.join(tmp, "curves.json")
      cmd = [sys.executable, "-m", "gpp_jax.experiments.loss_curves",
             f"--models={','.join(models)}", f"--steps={steps}", f"--out={out}",
             f"--dtype={dtype}"]
      failed = None
      try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not os.path.exists(out):
          tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
          failed = f"exit {proc.returncode}: {tail[0]}"
      except subprocess.TimeoutExpired:
        failed = f"timed out after {timeout:.0f} s"
      if failed:
        rows += [{"model": m, "dtype": dtype, "steps": steps, "error": failed} for m in models]
        continue
      with open(out) as f:
        curves = json.load(f)
    for m, c in curves.items():
      pipe, one = c["pipelined"], c["one_device"]
      diff = [abs(a - b) for a, b in zip(pipe, one)]
      over = [i + 1 for i, d in enumerate(diff) if d > 1e-5]
      rows.append({"model": m, "dtype": dtype, "steps": steps, "stages": c["stages"],
                   "depth": c["depth"], "loss_first": one[0], "loss_last": one[-1],
                   "max_diff": c["max_diff"],
                   "max_rel_diff": max(d / max(abs(b), 1e-12) for d, b in zip(diff, one)),
                   "first_step_over_1e-5": over[0] if over else None})
  return rows


# ------------------------------------------------------------------------------ writing

def _cell(v) -> str:
  if v is None:
    return ""
  if isinstance(v, float):
    return f"{v:.6g}"
  return str(v)


def write_csv(rows: Sequence[Mapping[str, Any]], columns: Sequence[str], path: str) -> None:
  with open(path, "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(columns)
    for r in rows:
      w.writerow([_cell(r.get(c)) for c in columns])


def md_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str, str]]) -> str:
  """A markdown table; ``columns`` are (key, header, format) with format "" for str(),
  a format spec for numbers; a missing value prints as "fail" for numeric columns."""
  lines = ["| " + " | ".join(h for _, h, _ in columns) + " |",
           "|" + "|".join("---" for _ in columns) + "|"]
  for r in rows:
    cells = []
    for key, _, fmt in columns:
      v = r.get(key)
      if v is None or v == "":
        cells.append("fail" if fmt and fmt != "s" else "-")
      elif fmt and fmt != "s":
        cells.append(format(v, fmt))
      else:
        cells.append(str(v))
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def write_plots(tables: Mapping[str, Sequence[Mapping[str, Any]]], out_dir: str) -> list[str]:
  """PNG plots of tables (a)-(d); returns the file names ([] without matplotlib)."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib is not installed: skipping plots (pip install 'gpp-jax[plots]')")
    return []
  files = []
  labels = {"graphpipe": "GraphPipe", "pipedream": "PipeDream", "piper": "Piper",
            "bapipe": "BaPipe", "luo": "Luo et al."}
  styles = {"graphpipe": dict(marker="o", linewidth=2.2)}

  tp = tables.get("throughput") or []
  models = list(dict.fromkeys(r["model"] for r in tp))
  if models:
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.6), squeeze=False)
    for ax, m in zip(axes[0], models):
      rows = [r for r in tp if r["model"] == m]
      for p in ALL_PLANNERS:
        pts = [(r["devices"], r[p]) for r in rows if r.get(p)]
        if pts:
          ax.plot(*zip(*pts), label=labels[p], **styles.get(p, dict(marker=".")))
      ax.set_xscale("log", base=2)
      ax.set_xticks([r["devices"] for r in rows], [str(r["devices"]) for r in rows])
      ax.set_title(MODEL_LABELS.get(m, m))
      ax.set_xlabel("V100 devices (simulated)")
      ax.set_ylabel("samples/s")
      ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "throughput.png"), dpi=110)
    plt.close(fig)
    files.append("throughput.png")

  br = tables.get("branches") or []
  if br:
    fig, ax = plt.subplots(figsize=(5, 3.6))
    x = list(range(len(br)))
    ax.bar([i - 0.2 for i in x], [r["speedup_vs_pipedream"] or 0 for r in br], 0.4,
           label="GraphPipe / PipeDream")
    ax.bar([i + 0.2 for i in x], [r["speedup"] or 0 for r in br], 0.4,
           label="GraphPipe / best sequential")
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.set_xticks(x, [str(r["branches"]) for r in br])
    ax.set_xlabel(f"CANDLE-Uno branches ({br[0]['devices']} devices)")
    ax.set_ylabel("throughput ratio")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "branches.png"), dpi=110)
    plt.close(fig)
    files.append("branches.png")

  mb = tables.get("microbatch") or []
  if mb:
    fig, ax = plt.subplots(figsize=(5, 3.6))
    for p in ALL_PLANNERS:
      pts = [(r["microbatch"], r[p]) for r in mb if r.get(p)]
      if pts:
        ax.plot(*zip(*pts), label=labels[p], **styles.get(p, dict(marker=".")))
    ax.set_xscale("log", base=2)
    ax.set_xticks([r["microbatch"] for r in mb], [str(r["microbatch"]) for r in mb])
    ax.set_xlabel("micro-batch size (fixed)")
    ax.set_ylabel("samples/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "microbatch.png"), dpi=110)
    plt.close(fig)
    files.append("microbatch.png")

  ab = tables.get("ablation") or []
  if ab:
    fig, ax = plt.subplots(figsize=(5, 3.6))
    x = list(range(len(ab)))
    for off, key, lab in ((-0.27, None, "best sequential"), (0, "parallel_speedup", "Parallel"),
                          (0.27, "full_speedup", "GraphPipe")):
      ax.bar([i + off for i in x], [1.0 if key is None else (r[key] or 0) for r in ab], 0.27,
             label=lab)
    ax.set_xticks(x, [MODEL_LABELS.get(r["model"], r["model"]) for r in ab])
    ax.set_ylabel(f"throughput / best sequential ({ab[0]['devices']} devices)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "ablation.png"), dpi=110)
    plt.close(fig)
    files.append("ablation.png")
  return files


# ------------------------------------------------------------------- paper comparison

def _span(values: Sequence[float]) -> tuple[float, float] | None:
  values = [v for v in values if v]
  return (min(values), max(values)) if values else None


def paper_comparison(tables: Mapping[str, Sequence[Mapping[str, Any]]],
                     sweep: Sweep) -> list[dict[str, Any]]:
  """One row per figure the paper reports (``shared/notes/planners.md`` §1.7): the claim, the
  paper's figure, ours and ours/paper; ``paper`` is None where the figure is lost."""
  tp, st = tables.get("throughput") or [], tables.get("search_time") or []
  br, mb, ab = tables.get("branches") or [], tables.get("microbatch") or [], tables.get("ablation") or []
  rows = []

  def add(claim, paper, ours, ratio, note=""):
    rows.append({"claim": claim, "paper": paper, "ours": ours, "ratio": ratio, "note": note})

  def fmt_span(s):
    return "-" if s is None else (f"{s[0]:.2f}x" if abs(s[0] - s[1]) < 5e-3
                                  else f"{s[0]:.2f}-{s[1]:.2f}x")

  # End-to-end headline (abstract, Fig. 6).
  vs_base = []
  for r in tp:
    base = [r[p] for p in PAPER_BASELINES if r.get(p)]
    if r.get("graphpipe") and base:
      vs_base.append((r["graphpipe"] / max(base), r))
  if vs_base:
    best, where = max(vs_base, key=lambda x: x[0])
    add("Max throughput gain over PipeDream/Piper, any model and device count (abstract: up "
        "to 1.6x; conclusion 1.61x)", "1.61x", f"{best:.2f}x ({MODEL_LABELS[where['model']]}, "
        f"{where['devices']} devices)", f"{best / 1.61:.2f}")
  sp = [r["speedup"] for r in tp if r.get("speedup")]
  if sp:
    best_r = max((r for r in tp if r.get("speedup")), key=lambda r: r["speedup"])
    add("Max throughput gain over the best of all four sequential planners", "1.61x (vs "
        "PipeDream/Piper only)", f"{best_r['speedup']:.2f}x ({MODEL_LABELS[best_r['model']]}, "
        f"{best_r['devices']} devices)", f"{best_r['speedup'] / 1.61:.2f}",
        "BaPipe and Luo et al. are not baselines in the paper")
    wins = sum(1 for x in sp if x > 1.0 + 1e-9)
    ties = sum(1 for x in sp if abs(x - 1.0) <= 1e-9)
    add("Configurations where GraphPipe beats the sequential planners (Fig. 6: all but one)",
        "all but one", f"wins {wins}, ties {ties}, losses {len(sp) - wins - ties} of {len(sp)}",
        None, "per-configuration throughputs of Fig. 6 are lost (image)")
  add("Per-configuration throughput of Fig. 6 (samples/s per model and GPU count)", None,
      "table (a)", None, "lost: Fig. 6 was an image; only the claims above survive")

  # Ablation (Fig. 9).
  k = sweep.ablation_devices
  full = _span([r.get("full_speedup") for r in ab])
  par = _span([r.get("parallel_speedup") for r in ab])
  if full:
    add(f"Full GraphPipe / sequential at {k} devices, range over models (Fig. 9: 1.25-1.61x "
        "at 32 GPUs)", "1.25-1.61x", fmt_span(full),
        f"{full[0] / 1.25:.2f} / {full[1] / 1.61:.2f}", "ratio: low ends / high ends")
  if par:
    add(f"'Parallel' (GraphPipe stages at the sequential micro-batch) / sequential at {k} "
        "devices (Fig. 9: 1.12-1.40x)", "1.12-1.40x", fmt_span(par),
        f"{par[0] / 1.12:.2f} / {par[1] / 1.40:.2f}", "ratio: low ends / high ends")

  # Branch sweep (Fig. 7 left).
  if br:
    top = max(br, key=lambda r: r["branches"])
    gain = top.get("speedup_vs_pipedream")
    add(f"CANDLE-Uno at {top['branches']} branches, GraphPipe / PipeDream (Fig. 7 left: up to "
        "2x at 16 branches, 4-16 GPUs)", "2x",
        "-" if gain is None else f"{gain:.2f}x ({top['devices']} devices)",
        None if gain is None else f"{gain / 2.0:.2f}",
        "the paper's per-branch bars are lost; it swept 4/8/16 GPUs, we use "
        f"{top['devices']}")
    grows = all(a.get("speedup_vs_pipedream") is not None and b.get("speedup_vs_pipedream")
                is not None and b["speedup_vs_pipedream"] >= a["speedup_vs_pipedream"] - 1e-9
                for a, b in zip(br, br[1:]))
    add("Gain grows with the number of branches (Fig. 7 left)", "yes",
        "yes" if grows else "no: " + ", ".join(
            f"{r['branches']}: {_fmt_x(r.get('speedup_vs_pipedream'))}" for r in br), None)

  # Micro-batch sweep (Fig. 7 right).
  if mb:
    ok = [r for r in mb if r.get("speedup")]
    wins = sum(1 for r in ok if r["speedup"] > 1.0 + 1e-9)
    add(f"{MODEL_LABELS.get(sweep.microbatch_model)} at {sweep.microbatch_devices} devices, "
        "GraphPipe above the sequential planners at every fixed micro-batch size (Fig. 7 right)",
        "every size", f"{wins} of {len(ok)} sizes with a plan on both sides"
        + (f" (gain {fmt_span(_span([r['speedup'] for r in ok]))})" if ok else ""), None,
        "bar heights lost (image)")

  # Search time (Table 1).
  pd = _span([r.get("pipedream_over_graphpipe") for r in st])
  gp_max = max((r["graphpipe_s"] for r in st if r.get("graphpipe_s") is not None), default=None)
  if pd:
    add("Search time of PipeDream / GraphPipe (Table 1: GraphPipe 9-21x faster than PipeDream "
        "and Piper)", "9-21x", fmt_span(pd), f"{pd[0] / 9:.3f} / {pd[1] / 21:.3f}",
        ("below 1x = our GraphPipe searched slower (a recursive Python DP run once per "
         "binary-search step, frontier point and micro-batch size, vs a few numpy operations "
         "per layer for PipeDream); " if pd[0] < 1 else "") + "Table 1's seconds are lost")
  piper_ok = [r for r in st if r.get("piper_over_graphpipe")]
  piper_failed = sorted({_label(r["model"]) for r in st if r["model"] in sweep.models
                         and "piper" in (r.get("failed") or "").split()})
  add("Piper: no strategy for DLRM and CANDLE-Uno, strategies for MMT (Fig. 6, Table 1)",
      "fails on DLRM, CANDLE-Uno",
      ("fails on " + ", ".join(piper_failed)) if piper_failed else "plans every model",
      None, "our Python Piper stops at 4000 downsets / 150 000 pairs; the authors' C++ copes "
      "with MMT's ~10^4 downsets" if piper_failed else "")
  if piper_ok:
    sp_ = _span([r["piper_over_graphpipe"] for r in piper_ok])
    add("Search time of Piper / GraphPipe where our Piper plans (" + ", ".join(
        _label(r["model"]) + f" x{r['devices']}" for r in piper_ok) + ")", "9-21x",
        fmt_span(sp_), f"{sp_[0] / 9:.2f} / {sp_[1] / 21:.2f}",
        "Piper's cost grows with the downsets, l^b for b branches of l layers")
  if gp_max is not None:
    add("GraphPipe search time per configuration (Table 1: under 1 minute on an M1 Max)",
        "< 60 s", f"max {gp_max:.1f} s", f"{gp_max / 60:.2f}",
        "ratio: our max / 60 s; shared 2-core machine")
  add("Search seconds per model and GPU count (Table 1)", None, "table (e)", None,
      "lost: Table 1 was an image")
  add("Mini-batch sizes per GPU count (App. A.2 table)", None,
      ", ".join(f"{MODEL_LABELS[m]} {default_batch_size(m, 1)}/device" for m in sweep.models),
      None, "lost: we scale the mini-batch with the device count")
  return rows


def _label(model: str) -> str:
  """Display name: "candle_uno:branches=4" -> "CANDLE-Uno, 4 branches"."""
  name, _, branches = model.partition(":branches=")
  label = MODEL_LABELS.get(name, name)
  return f"{label}, {branches} branches" if branches else label


def _fmt_x(v) -> str:
  return "fail" if v is None else f"{v:.2f}x"


# ------------------------------------------------------------------------------ results.md

def _planner_cols(fmt=".1f"):
  names = {"graphpipe": "GraphPipe", "pipedream": "PipeDream", "piper": "Piper",
           "bapipe": "BaPipe", "luo": "Luo"}
  return [(p, names[p], fmt) for p in ALL_PLANNERS]


def results_markdown(tables: Mapping[str, Sequence[Mapping[str, Any]]], sweep: Sweep,
                     plots: Sequence[str] = (), command: str = "",
                     elapsed: float | None = None) -> str:
  """``results.md``: the paper comparison, then tables (a)-(e) and the real-training check."""
  k_ab = sweep.ablation_devices
  out = [
      "# GraphPipe reproduction: simulated results beside the paper's",
      "",
      f"Generated by `{command or 'python -m gpp_jax.experiments.reproduce'}`"
      + (f" in {elapsed / 60:.1f} min" if elapsed else "") + ". Every throughput below is a "
      "**prediction**: the planners plan on the V100 preset (4 V100 16 GB per node, NVLink "
      "inside a node, 100 Gb/s InfiniBand between nodes; `gpp_jax.cost.cluster.v100_cluster`) for "
      "the synthetic LayerGraphs at the paper's shapes (`gpp_jax.experiments.model_graphs`), and the "
      "simulator times the plan's schedule with the cost model. Nothing ran on a GPU. The "
      "paper's numbers were measured on Summit (FlexFlow runtime). Search times are wall-clock "
      "seconds on a shared 2-core machine.",
      "",
      "Sources for the paper's figures: `shared/notes/planners.md` §1.7. The only full text "
      "available lost every figure and table that was an image (Fig. 6, 7, 9 values, Table 1 "
      "seconds, the mini-batch table); where a figure is lost, the row says so and gives no "
      "ratio.",
      "",
      "## Ours vs the paper",
      "",
  ]
  comp = paper_comparison(tables, sweep)
  out.append(md_table([{**r, "paper": r["paper"] or "lost", "ratio": r["ratio"] or "-"}
                       for r in comp],
                      [("claim", "claim", "s"), ("paper", "paper", "s"), ("ours", "ours", "s"),
                       ("ratio", "ours / paper", "s"), ("note", "note", "s")]))
  out += ["", "Reading the ratios: 1.00 means we reproduce the paper's figure; for the search "
          "time, a ratio below 1 means our GraphPipe's search is relatively slower than the "
          "paper's.", ""]

  tp = tables.get("throughput") or []
  if tp:
    out += ["## (a) Throughput vs device count (Fig. 6)", "",
            "Simulated samples/s; `fail` = the planner gave no plan (Piper's state limit). "
            "Mini-batch = " + ", ".join(f"{MODEL_LABELS[m]} {default_batch_size(m, 1)}"
                                        for m in sweep.models) + " samples per device. "
            "S/D = stages / depth, mb = micro-batch size.", "",
            md_table([{**r, "model": MODEL_LABELS.get(r["model"], r["model"]),
                       "gp_shape": f"{r['graphpipe_stages']}/{r['graphpipe_depth']}"
                       if r.get("graphpipe_stages") else "-"} for r in tp],
                     [("model", "model", "s"), ("devices", "devices", "d"),
                      ("batch", "batch", "d"), *_planner_cols(),
                      ("gp_shape", "GP S/D", "s"), ("graphpipe_microbatch", "GP mb", "d"),
                      ("best_sequential_planner", "best seq", "s"),
                      ("best_sequential_microbatch", "seq mb", "d"),
                      ("speedup", "GP / best seq", ".3f")]), ""]
    if "throughput.png" in plots:
      out += ["![throughput vs devices](throughput.png)", ""]

  br = tables.get("branches") or []
  if br:
    out += [f"## (b) Branch sweep: CANDLE-Uno at {br[0]['devices']} devices (Fig. 7 left)", "",
            f"Mini-batch {br[0]['batch']}. The paper normalises to PipeDream.", "",
            md_table([{**r, "gp_shape": f"{r['graphpipe_stages']}/{r['graphpipe_depth']}"
                       if r.get("graphpipe_stages") else "-"} for r in br],
                     [("branches", "branches", "d"), ("graphpipe", "GraphPipe", ".1f"),
                      ("gp_shape", "GP S/D", "s"), ("graphpipe_microbatch", "GP mb", "d"),
                      ("pipedream", "PipeDream", ".1f"), ("pipedream_stages", "PD stages", "d"),
                      ("best_sequential", "best seq", ".1f"),
                      ("best_sequential_planner", "by", "s"),
                      ("speedup_vs_pipedream", "GP / PipeDream", ".3f"),
                      ("speedup", "GP / best seq", ".3f")]), ""]
    if "branches.png" in plots:
      out += ["![branch sweep](branches.png)", ""]

  mb = tables.get("microbatch") or []
  if mb:
    out += [f"## (c) Micro-batch sweep: {MODEL_LABELS.get(sweep.microbatch_model)} on "
            f"{sweep.microbatch_devices} devices, mini-batch {sweep.microbatch_batch} "
            "(Fig. 7 right)", "",
            "Every planner is held to one micro-batch size per row (`num_microbatches` fixed); "
            "`fail` = no plan fits memory (or Piper's state limit).", "",
            md_table(mb, [("microbatch", "micro-batch", "d"), ("num_microbatches", "M", "d"),
                          *_planner_cols(), ("graphpipe_depth", "GP depth", "d"),
                          ("best_sequential_planner", "best seq", "s"),
                          ("best_sequential_depth", "seq depth", "d"),
                          ("speedup", "GP / best seq", ".3f")]), ""]
    if "microbatch.png" in plots:
      out += ["![micro-batch sweep](microbatch.png)", ""]

  ab = tables.get("ablation") or []
  if ab:
    out += [f"## (d) Ablation at {k_ab} devices (Fig. 9)", "",
            "`sequential` = the best sequential plan of table (a); `parallel` = GraphPipe "
            "forced to that plan's micro-batch size (the stage-graph effect alone); `full` = "
            "GraphPipe with its own micro-batch choice. Throughput in samples/s.", "",
            md_table([{**r, "model": MODEL_LABELS.get(r["model"], r["model"])} for r in ab],
                     [("model", "model", "s"), ("sequential", "sequential", ".1f"),
                      ("sequential_planner", "by", "s"), ("sequential_microbatch", "mb", "d"),
                      ("parallel", "parallel", ".1f"), ("parallel_depth", "depth", "d"),
                      ("full", "full", ".1f"), ("full_microbatch", "mb", "d"),
                      ("full_depth", "depth", "d"), ("parallel_speedup", "parallel / seq", ".3f"),
                      ("full_speedup", "full / seq", ".3f")]),
            "", "Paper (Fig. 9, 32 GPUs): parallel 1.12-1.40x, full 1.25-1.61x over the "
            "sequential baseline; per-model bars lost.", ""]
    if "ablation.png" in plots:
      out += ["![ablation](ablation.png)", ""]

  st = tables.get("search_time") or []
  if st:
    out += ["## (e) Search time (Table 1)", "",
            "Wall-clock seconds per planner (a failed planner's entry is the time it took to "
            "give up; it is listed under `failed`). Paper: GraphPipe 9-21x faster than "
            "PipeDream and Piper, under a minute everywhere (seconds lost). The rows after "
            "the three models are the branch sweep's configurations (b).",
            "",
            md_table([{**r, "model": _label(r["model"])} for r in st],
                     [("model", "model", "s"), ("devices", "devices", "d"),
                      *[(f"{p}_s", f"{h} s", ".2f") for p, h, _ in _planner_cols()],
                      ("failed", "failed", "s"),
                      ("pipedream_over_graphpipe", "PD / GP", ".3f"),
                      ("piper_over_graphpipe", "Piper / GP", ".3f")]), ""]

  lc = tables.get("loss_check") or []
  if lc:
    out += ["## Real training: pipelined vs one device", "",
            "`python -m gpp_jax.experiments.loss_curves` with 8 forced CPU devices "
            "(`XLA_FLAGS=--xla_force_host_platform_device_count=8`): each tiny zoo model "
            "trains with the GraphPipe plan on 8 devices and, from the same initial state, "
            "undecorated on one device (AdamW, global-norm clipping, batch 32, 8 "
            "micro-batches), in float32 and in float64 (`--dtype=float64`). `max diff` = the "
            "largest |pipelined - one device| loss over the run. In float32 the two runs "
            "differ by rounding (~1e-7); when that rounding puts a ReLU pre-activation on the "
            "other side of zero, the unit's gradient switches on or off in one run only and "
            "the curves separate from that step on. In float64 the same runs agree to "
            "rounding for the whole run.", "",
            md_table([{**r, "model": MODEL_LABELS.get(r["model"], r["model"])} for r in lc],
                     [("model", "model", "s"), ("dtype", "dtype", "s"),
                      ("steps", "steps", "d"),
                      ("stages", "stages", "d"), ("depth", "depth", "d"),
                      ("loss_first", "loss at step 1", ".4f"),
                      ("loss_last", f"loss at step {lc[0]['steps']}", ".4f"),
                      ("max_diff", "max diff", ".2e"), ("max_rel_diff", "max rel. diff", ".2e"),
                      ("first_step_over_1e-5", "first step > 1e-5", "s"),
                      ("error", "error", "s")]),
            "", "`first step > 1e-5`: `-` when the curves never differ by more than 1e-5.", ""]

  out += ["## What limits the comparison", "",
          "- Simulation, not measurement: a roofline cost model with a fitted efficiency curve "
          "and affine links stands in for FlexFlow on Summit; absolute samples/s are not "
          "comparable, ratios between planners priced by the same model are.",
          "- The baselines are our re-implementations (PipeDream and Piper from their "
          "papers' and code's DPs, BaPipe and Luo et al. from abstracts only); the paper ran "
          "the authors' PipeDream and Piper planners on FlexFlow. GraphPipe, PipeDream and "
          "Piper all end with the same local search against the simulator "
          "(`passes/partition/refine.py`), so the chain baselines are stronger than the "
          "published planners and the gains are those of the stage DAG alone.",
          "- Lost figures: every plotted value and Table 1's seconds; the mini-batch sizes per "
          "GPU count (we use a fixed number of samples per device).",
          "- Piper: our Python version stops at its state limit on all three models (the "
          "paper's C++ planned MMT).",
          "- Model shapes follow App. A.2 (MMT 4 branches, DLRM 7+7, CANDLE-Uno 7); the paper "
          "itself gives other branch counts in §7.2.",
          ""]
  return "\n".join(out)


# ----------------------------------------------------------------------------------- main

def reproduce(sweep: Sweep, out_dir: str, *, loss: bool = True, plots: bool = True,
              command: str = "") -> dict[str, list[dict[str, Any]]]:
  """Runs every sweep and writes the CSVs, plots and ``results.md`` to ``out_dir``."""
  t0 = time.perf_counter()
  os.makedirs(out_dir, exist_ok=True)
  _log(f"(a) device sweep: {', '.join(sweep.models)} on {sweep.devices} devices")
  dev = device_sweep(sweep)
  tables: dict[str, list[dict[str, Any]]] = {"throughput": throughput_table(dev),
                                             "search_time": search_time_table(dev)}
  _log(f"(b) branch sweep: CANDLE-Uno {sweep.branches} branches, {sweep.branch_devices} devices")
  branch_rows = branch_sweep(sweep)
  tables["branches"] = branch_table(branch_rows)
  tables["search_time"] += search_time_table(branch_rows)
  _log(f"(c) micro-batch sweep: {sweep.microbatch_model}, {sweep.microbatch_devices} devices, "
       f"mini-batch {sweep.microbatch_batch}")
  tables["microbatch"] = microbatch_table(microbatch_sweep(sweep))
  _log(f"(d) ablation at {sweep.ablation_devices} devices")
  tables["ablation"] = ablation(sweep, dev)
  if loss:
    _log(f"real training: {', '.join(sweep.loss_models)}, {sweep.steps} steps on 8 CPU devices")
    tables["loss_check"] = loss_check(sweep.loss_models, sweep.steps)
    for r in tables["loss_check"]:
      _log(f"  {r['model']} ({r['dtype']}): " + (f"max diff {r['max_diff']:.2e}" if "max_diff" in r
                                  else r["error"]))
  columns = {"throughput": THROUGHPUT_COLUMNS, "search_time": SEARCH_COLUMNS,
             "branches": BRANCH_COLUMNS, "microbatch": MICROBATCH_COLUMNS,
             "ablation": ABLATION_COLUMNS, "loss_check": LOSS_COLUMNS}
  for name, rows in tables.items():
    write_csv(rows, columns[name], os.path.join(out_dir, f"{name}.csv"))
  files = write_plots(tables, out_dir) if plots else []
  md = results_markdown(tables, sweep, files, command, time.perf_counter() - t0)
  with open(os.path.join(out_dir, "results.md"), "w") as f:
    f.write(md)
  _log(f"wrote {', '.join([f'{n}.csv' for n in tables] + files + ['results.md'])} to "
       f"{out_dir} in {time.perf_counter() - t0:.0f} s")
  return tables


def define_flags() -> None:
  """Defines the flags (only when run as a program: ``gpp_jax.train`` and ``loss_curves``
  define flags of the same names)."""
  from absl import flags
  flags.DEFINE_string("out_dir", "docs/", "folder for results.md, the CSVs and the plots")
  flags.DEFINE_bool("quick", False, "reduced sweep (4 and 8 devices, 20 training steps)")
  flags.DEFINE_integer("steps", None, "training steps of the real-training check (default "
                       "200, 20 with --quick)")
  flags.DEFINE_bool("loss_check", True, "run the real-training check (a subprocess)")
  flags.DEFINE_bool("plots", True, "write PNG plots when matplotlib is importable")


def main(argv: Sequence[str]) -> None:
  from absl import app, flags
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  FLAGS = flags.FLAGS
  sweep = QUICK if FLAGS.quick else FULL
  if FLAGS.steps is not None:
    sweep = dataclasses.replace(sweep, steps=FLAGS.steps)
  command = "python -m gpp_jax.experiments.reproduce" + (" --quick" if FLAGS.quick else "")
  reproduce(sweep, FLAGS.out_dir, loss=FLAGS.loss_check, plots=FLAGS.plots, command=command)


if __name__ == "__main__":
  from absl import app
  define_flags()
  app.run(main)
