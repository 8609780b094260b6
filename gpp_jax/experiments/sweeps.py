"""What the paper reproduction runs, and what its figure modules share.

``Sweep`` (the configuration; ``FULL`` and ``QUICK``), the planner lists, and the helpers of
the figure and table modules (``throughput``, ``branches``, ``microbatch``, ``ablation``):
running every planner of a sweep on one configuration, pivoting a configuration's rows per
planner, ratios and the progress log (stderr, so it never mixes with the tables).

Each sweep returns long-form rows: one per (configuration, planner), the fields of
``planner_runs.run_planner`` plus the configuration. Each figure module's table builder
pivots them into one row per configuration.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import networkx as nx

from gpp_jax.cost.cluster import Cluster
from gpp_jax.experiments.planner_runs import best_row, run_planner, short_error
from gpp_jax.passes.partition import SEQUENTIAL_PLANNERS

ALL_PLANNERS = ("graphpipe",) + tuple(SEQUENTIAL_PLANNERS)
# The sequential planners the paper compares against (Fig. 6, Table 1).
PAPER_BASELINES = ("pipedream", "piper")

Log = Callable[[str], None]
Row = dict[str, Any]


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
QUICK = Sweep(
  devices=(4, 8),
  branches=(2, 4),
  branch_devices=8,
  microbatch_list=(8, 32),
  ablation_devices=8,
  steps=20,
)


def progress_log(msg: str) -> None:
  """The default progress log: one line on stderr, flushed (the tables go to files)."""
  print(msg, file=sys.stderr, flush=True)


def progress_label(tag: str, what: str, i: int, n: int) -> str:
  """``"[throughput] MMT 16 devices (3/12)"``: which sweep, which configuration, how far."""
  return f"[{tag}] {what} ({i}/{n})"


# ------------------------------------------------------------------------------ running


def run_one(name: str, graph, cluster, batch: int, **kw) -> Row:
  """``planner_runs.run_planner`` with a failed row's message cut to its cause."""
  row = run_planner(name, graph, cluster, batch, **kw)
  if "error" in row:
    row["error"] = short_error(row)
  return row


@dataclasses.dataclass(frozen=True, eq=False)
class Configuration:
  """One configuration of a sweep: ``graph`` planned for ``cluster`` at mini-batch ``batch``;
  ``fields`` are its columns, first in each of its rows; ``label`` names it in the progress
  log."""

  graph: nx.DiGraph
  cluster: Cluster
  batch: int
  fields: Mapping[str, Any]
  label: str = ""


def run_config(
  planners: Sequence[str], config: Configuration, log: Log | None = None, **kw
) -> list[Row]:
  """Every planner on one configuration: one row per planner, ``config.fields`` first, then
  ``run_one``'s row (``kw`` go to the planner). With ``log``, one line ``"{label} ..."``
  before the planners run and one line ``"{label}: "`` + each planner's result and the
  configuration's seconds after."""
  c = config
  t0 = time.perf_counter()
  if log is not None:
    log(f"{c.label} {', '.join(planners)} ...")
  rows = [{**c.fields, **run_one(name, c.graph, c.cluster, c.batch, **kw)} for name in planners]
  if log is not None:
    log(f"{c.label}: " + ", ".join(brief(r) for r in rows) + f" [{time.perf_counter() - t0:.1f} s]")
  return rows


def brief(r: Mapping[str, Any]) -> str:
  """One planner's result for the progress log."""
  if "error" in r:
    return f"{r['planner']} failed ({r['seconds']:.2f} s)"
  return f"{r['planner']} {r['throughput']:.1f}/s ({r['seconds']:.2f} s)"


# --------------------------------------------------------------------------- table helpers


def group_rows(rows: Iterable[Mapping[str, Any]], keys: Sequence[str]) -> dict[tuple, list]:
  """Rows grouped by the values of ``keys``, groups in first-seen order."""
  groups: dict[tuple, list] = {}
  for r in rows:
    groups.setdefault(tuple(r[k] for k in keys), []).append(r)
  return groups


def by_planner(
  rows: Sequence[Mapping[str, Any]],
) -> tuple[dict[str, Mapping[str, Any]], Mapping[str, Any], Mapping[str, Any] | None]:
  """One configuration's rows as (row per planner, GraphPipe's row ({} when absent), the best
  sequential row (None when no sequential planner planned))."""
  by = {r["planner"]: r for r in rows}
  return by, by.get("graphpipe", {}), best_row(rows, [p for p in by if p != "graphpipe"])


def planner_throughputs(by: Mapping[str, Mapping[str, Any]]) -> Row:
  """Each of ``ALL_PLANNERS``' throughput (None: it failed or did not run)."""
  return {p: by[p].get("throughput") if p in by else None for p in ALL_PLANNERS}


def vs_best_sequential(gp: Mapping[str, Any], seq: Mapping[str, Any] | None) -> Row:
  """The best sequential plan's throughput and planner, and GraphPipe / that throughput."""
  return {
    "best_sequential": seq and seq["throughput"],
    "best_sequential_planner": seq and seq["planner"],
    "speedup": ratio(gp.get("throughput"), seq and seq["throughput"]),
  }


def ratio(a, b) -> float | None:
  """a / b, None when either is missing (or zero)."""
  return a / b if a and b else None


def fmt_num(x) -> str:
  """A throughput for the progress log ("-" when missing)."""
  return "-" if x is None else f"{x:.1f}"
