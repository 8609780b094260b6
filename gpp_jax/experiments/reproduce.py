"""Reproduces the GraphPipe paper's comparisons in simulation, and checks real pipelined training.

  python -m gpp_jax.experiments.reproduce --quick          # runs/reproduce-quick-<time>/
  python -m gpp_jax.experiments.reproduce                  # runs/reproduce-<time>/
  python -m gpp_jax.experiments.reproduce --out_dir=docs   # regenerates the committed docs/

The paper: "GraphPipe: Improving Performance and Scalability of DNN Training with Graph
Pipeline Parallelism", Jeon et al., ASPLOS 2025 (arXiv:2406.17145), §7 and App. A.2.

On the V100 preset (``gpp_jax.cost.cluster.v100_cluster``: 4 V100 16 GB per node, NVLink,
100 Gb/s InfiniBand) at the paper's shapes (``gpp_jax.experiments.model_graphs``), every planner
plans and the simulator predicts; nothing runs on a GPU. Tables, one CSV each in ``--out_dir``:

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

Where the outputs go: by default a new folder ``runs/reproduce-<time>/`` (with ``--quick``:
``runs/reproduce-quick-<time>/``) under the working directory; the repository's committed
results in ``docs/`` are rewritten only when asked, with ``--out_dir=docs`` (and only by the
full sweep at the paper's shapes: ``--quick`` or ``--preset=tiny`` into ``docs/`` is refused).

``--quick`` runs a reduced sweep (4 and 8 devices, 2 and 4 branches at 8 devices, two
micro-batch sizes, the ablation at 8 devices, 20 training steps). ``--preset=tiny`` runs the
same topologies at small widths (seconds; a smoke test, not a reproduction). Progress (which
sweep, which configuration, how far) goes to stderr.

This module is the runner: ``reproduce`` runs every sweep and writes the outputs. Each figure
or table has its own module (``throughput``: (a) and (e); ``branches``: (b); ``microbatch``:
(c); ``ablation``: (d); ``loss_check``), ``sweeps`` holds the configuration (``Sweep``,
``FULL``, ``QUICK``) and what the sweeps share, ``plotting`` the matplotlib helpers, and
``report`` the CSV, markdown and plot writers and ``results.md``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from typing import Any

from gpp_jax.experiments.ablation import ABLATION_COLUMNS, ablation
from gpp_jax.experiments.branches import BRANCH_COLUMNS, branch_sweep, branch_table
from gpp_jax.experiments.loss_check import LOSS_COLUMNS, loss_check
from gpp_jax.experiments.microbatch import MICROBATCH_COLUMNS, microbatch_sweep, microbatch_table
from gpp_jax.experiments.report import Provenance, results_markdown, write_csv, write_plots
from gpp_jax.experiments.sweeps import FULL, QUICK, Sweep
from gpp_jax.experiments.sweeps import progress_log as _log
from gpp_jax.experiments.throughput import (
  SEARCH_COLUMNS,
  THROUGHPUT_COLUMNS,
  device_sweep,
  search_time_table,
  throughput_table,
)


def reproduce(
  sweep: Sweep, out_dir: str, *, loss: bool = True, plots: bool = True, command: str = ""
) -> dict[str, list[dict[str, Any]]]:
  """Runs every sweep and writes the CSVs, plots and ``results.md`` to ``out_dir``."""
  t0 = time.perf_counter()
  os.makedirs(out_dir, exist_ok=True)
  _log(f"(a) device sweep: {', '.join(sweep.models)} on {sweep.devices} devices")
  dev = device_sweep(sweep)
  tables: dict[str, list[dict[str, Any]]] = {
    "throughput": throughput_table(dev),
    "search_time": search_time_table(dev),
  }
  _log(f"(b) branch sweep: CANDLE-Uno {sweep.branches} branches, {sweep.branch_devices} devices")
  branch_rows = branch_sweep(sweep)
  tables["branches"] = branch_table(branch_rows)
  tables["search_time"] += search_time_table(branch_rows)
  _log(
    f"(c) micro-batch sweep: {sweep.microbatch_model}, {sweep.microbatch_devices} devices, "
    f"mini-batch {sweep.microbatch_batch}"
  )
  tables["microbatch"] = microbatch_table(microbatch_sweep(sweep))
  _log(f"(d) ablation at {sweep.ablation_devices} devices")
  tables["ablation"] = ablation(sweep, dev)
  if loss:
    _log(
      f"[loss check] {', '.join(sweep.loss_models)}, {sweep.steps} steps on 8 CPU devices, "
      "float32 then float64 (a subprocess; compiling takes most of it) ..."
    )
    tables["loss_check"] = loss_check(sweep.loss_models, sweep.steps)
    for r in tables["loss_check"]:
      _log(
        f"[loss check] {r['model']} ({r['dtype']}): "
        + (f"max diff {r['max_diff']:.2e}" if "max_diff" in r else r["error"])
      )
  columns = {
    "throughput": THROUGHPUT_COLUMNS,
    "search_time": SEARCH_COLUMNS,
    "branches": BRANCH_COLUMNS,
    "microbatch": MICROBATCH_COLUMNS,
    "ablation": ABLATION_COLUMNS,
    "loss_check": LOSS_COLUMNS,
  }
  for name, rows in tables.items():
    write_csv(rows, columns[name], os.path.join(out_dir, f"{name}.csv"))
  files = write_plots(tables, out_dir) if plots else []
  # Section (f) comes from benchmarks/planners.py (--markdown=<out_dir>/planner_fidelity.md).
  extra = ""
  fidelity = os.path.join(out_dir, "planner_fidelity.md")
  if os.path.exists(fidelity):
    with open(fidelity) as f:
      extra = f.read()
  provenance = Provenance(command, time.perf_counter() - t0)
  md = results_markdown(tables, sweep, files, provenance, extra=extra)
  with open(os.path.join(out_dir, "results.md"), "w") as f:
    f.write(md)
  _log(
    f"wrote {', '.join([f'{n}.csv' for n in tables] + files + ['results.md'])} to "
    f"{out_dir} in {time.perf_counter() - t0:.0f} s"
  )
  return tables


# The repository's committed results (``docs/`` beside the package), rewritten only on request.
REPO_DOCS = os.path.join(
  os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs"
)


def default_out_dir(quick: bool, preset: str = "paper") -> str:
  """``runs/reproduce[-quick][-tiny]-<time>``, under the working directory."""
  name = "reproduce" + ("-quick" if quick else "") + ("-tiny" if preset != "paper" else "")
  return os.path.join("runs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")


def is_repo_docs(out_dir: str) -> bool:
  """Whether ``out_dir`` is the repository's committed ``docs/``."""
  return os.path.realpath(out_dir) == os.path.realpath(REPO_DOCS)


def check_args(
  out_dir: str | None, *, quick: bool, preset: str, steps: int | None, loss: bool
) -> str:
  """The output folder for these flags, or ValueError naming the bad flag and the fix."""
  if steps is not None and steps < 1:
    raise ValueError(f"--steps must be at least 1, got {steps}")
  if steps is not None and not loss:
    raise ValueError("--steps sets the real-training check's steps; drop it or --noloss_check")
  if out_dir is None:
    return default_out_dir(quick, preset)
  if not out_dir.strip():
    raise ValueError("--out_dir is empty; give a folder, or drop it for runs/reproduce-<time>/")
  if is_repo_docs(out_dir) and (quick or preset != "paper"):
    what = "--quick" if quick else f"--preset={preset}"
    raise ValueError(
      f"{what} would replace the full sweep's results in docs/ ({REPO_DOCS}) with a reduced "
      f"one; drop --out_dir to write under runs/, or drop {what} to regenerate docs/"
    )
  if os.path.exists(out_dir) and not os.path.isdir(out_dir):
    raise ValueError(f"--out_dir={out_dir} is a file, not a folder; choose another path")
  return out_dir


def command_line(
  out_dir: str | None, *, quick: bool, preset: str, steps: int | None, loss: bool
) -> str:
  """The command as ``results.md`` records it (the flags that change the results)."""
  parts = ["python -m gpp_jax.experiments.reproduce"]
  if quick:
    parts.append("--quick")
  if preset != "paper":
    parts.append(f"--preset={preset}")
  if steps is not None:
    parts.append(f"--steps={steps}")
  if not loss:
    parts.append("--noloss_check")
  if out_dir is not None:
    parts.append("--out_dir=docs" if is_repo_docs(out_dir) else f"--out_dir={out_dir}")
  return " ".join(parts)


def define_flags() -> None:
  """Defines the flags (only when run as a program: ``gpp_jax.train`` and ``loss_curves``
  define flags of the same names)."""
  from absl import flags

  flags.DEFINE_string(
    "out_dir",
    None,
    "folder for results.md, the CSVs and the plots (default: a new runs/reproduce-<time>/, "
    "runs/reproduce-quick-<time>/ with --quick; --out_dir=docs regenerates the committed "
    "results)",
  )
  flags.DEFINE_bool("quick", False, "reduced sweep (4 and 8 devices, 20 training steps)")
  flags.DEFINE_enum(
    "preset",
    "paper",
    ["paper", "tiny"],
    "model shapes: the paper's, or tiny (same topologies, small widths: a smoke test)",
  )
  flags.DEFINE_integer(
    "steps", None, "training steps of the real-training check (default 200, 20 with --quick)"
  )
  flags.DEFINE_bool("loss_check", True, "run the real-training check (a subprocess)")
  flags.DEFINE_bool("plots", True, "write PNG plots when matplotlib is importable")


def main(argv: Sequence[str]) -> None:
  from absl import app, flags

  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}; everything is given as --flags")
  FLAGS = flags.FLAGS
  args = dict(quick=FLAGS.quick, preset=FLAGS.preset, steps=FLAGS.steps, loss=FLAGS.loss_check)
  try:
    out_dir = check_args(FLAGS.out_dir, **args)
    os.makedirs(out_dir, exist_ok=True)
  except (ValueError, OSError) as e:
    raise app.UsageError(f"{e}" if isinstance(e, ValueError) else f"--out_dir: {e}") from None
  sweep = dataclasses.replace(QUICK if FLAGS.quick else FULL, preset=FLAGS.preset)
  if FLAGS.steps is not None:
    sweep = dataclasses.replace(sweep, steps=FLAGS.steps)
  command = command_line(FLAGS.out_dir, **args)
  reproduce(sweep, out_dir, loss=FLAGS.loss_check, plots=FLAGS.plots, command=command)


if __name__ == "__main__":
  from absl import app

  define_flags()
  app.run(main)
