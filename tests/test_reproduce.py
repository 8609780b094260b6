"""The planning CLI and the paper-reproduction tables, on tiny shapes (a few seconds)."""

import csv
import json
import os
import subprocess
import sys

import pytest
from harness import child_env

from gpp_jax.cli import plan as plan_cli
from gpp_jax.experiments.ablation import ABLATION_COLUMNS, ablation
from gpp_jax.experiments.branches import BRANCH_COLUMNS, branch_sweep, branch_table
from gpp_jax.experiments.loss_check import loss_check
from gpp_jax.experiments.microbatch import MICROBATCH_COLUMNS, microbatch_sweep, microbatch_table
from gpp_jax.experiments.planner_runs import build_graph
from gpp_jax.experiments.report import (
  _label,
  paper_comparison,
  results_markdown,
  write_csv,
  write_plots,
)
from gpp_jax.experiments.sweeps import Sweep
from gpp_jax.experiments.throughput import (
  SEARCH_COLUMNS,
  THROUGHPUT_COLUMNS,
  device_sweep,
  search_time_table,
  throughput_table,
)
from gpp_jax.ir.plan import Plan, validate_plan

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _summary(text: str) -> dict[str, str]:
  """planner -> its line of the summary table."""
  lines = text.splitlines()
  start = next(i for i, l in enumerate(lines) if l.startswith("planner "))
  rows = {}
  for line in lines[start + 2 :]:
    if not line.strip():
      break
    rows[line.split()[0]] = line
  return rows


def test_plan_cli_prints_a_row_per_planner_with_a_failure_row(tmp_path):
  out = tmp_path / "plans.json"
  env = child_env()
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "gpp_jax.plan",
      "--model=candle_uno",
      "--preset=tiny",
      "--cluster=v100",
      "--num_devices=4",
      "--planner=graphpipe,piper,pipedream",
      f"--json={out}",
    ],
    capture_output=True,
    text=True,
    cwd=REPO,
    env=env,
    timeout=120,
  )
  assert proc.returncode == 0, proc.stderr
  assert "RuntimeWarning" not in proc.stderr
  # Progress on stderr: which planner, how far, how long; the report alone on stdout.
  progress = [l for l in proc.stderr.splitlines() if l.startswith("[")]
  assert [l.split()[:2] for l in progress] == [
    [f"[{i}/3]", name]
    for i, name in enumerate(("graphpipe", "piper", "pipedream"), 1)
    for _ in "ab"
  ]
  assert "failed: piper: candle_uno7 has more than" in progress[3] and "elapsed" in progress[3]
  assert "[1/3]" not in proc.stdout
  rows = _summary(proc.stdout)
  assert list(rows) == ["graphpipe", "piper", "pipedream"]
  # Tiny CANDLE-Uno keeps 7 towers of 4 layers: more downsets than Piper's limit (40,000), and
  # it says so.
  assert "FAILED" in rows["piper"] and "downset" in rows["piper"]
  for name in ("graphpipe", "pipedream"):
    cells = rows[name].split()
    # planner stages v depth mb M iter-ms samples/s peak-GiB fits ...
    assert "FAILED" not in rows[name] and cells[9] == "yes"
    # --stages_per_device not given: on V100s each planner chooses 1, 2 or 4 by prediction.
    assert cells[2] in ("1", "2", "4")
    assert float(cells[7]) > 0  # samples/s
  assert "Plan by graphpipe" in proc.stdout and "Plan by pipedream" in proc.stdout
  report = json.loads(out.read_text())
  by = {r["planner"]: r for r in report["results"]}
  assert report["stages_per_device"] == "auto"
  for name in ("graphpipe", "pipedream"):
    chosen = Plan.from_dict(by[name]["plan"]).stages_per_device
    assert rows[name].split()[2] == str(chosen)
  assert "error" in by["piper"] and "plan" not in by["piper"]
  plan = Plan.from_dict(by["graphpipe"]["plan"])
  graph = build_graph("candle_uno", "tiny", report["batch_size"])
  validate_plan(plan, graph, 4)
  assert plan.predicted["throughput"] == pytest.approx(by["graphpipe"]["throughput"])


def test_plan_cli_compare_and_report():
  report = plan_cli.compare(
    plan_cli.PlanOptions(
      "candle_uno",
      preset="tiny",
      num_devices=4,
      planners=("graphpipe", "pipedream"),
      shape={"branches": 4},
    )
  )
  assert report["graph"] == "candle_uno4" and report["batch_size"] == 4 * 128
  gp, pd = report["results"]
  # Four independent towers on four devices: the stage DAG is shallower and faster.
  assert gp["depth"] < gp["stages"] and gp["throughput"] > pd["throughput"]
  rows = _summary(plan_cli.format_report(report))
  assert rows["graphpipe"].split()[-1] == "1.000"
  assert float(rows["pipedream"].split()[-1]) == pytest.approx(
    pd["throughput"] / gp["throughput"], abs=1e-3
  )
  fixed = plan_cli.compare(
    plan_cli.PlanOptions(
      "candle_uno", preset="tiny", num_devices=4, planners=("graphpipe",), num_microbatches=8
    )
  )["results"][0]
  assert fixed["num_microbatches"] == 8 and fixed["microbatch"] == 4 * 128 // 8


def test_plan_cli_rejects_bad_input_before_planning():
  with pytest.raises(ValueError, match="unknown planner"):
    plan_cli.compare(
      plan_cli.PlanOptions(
        "candle_uno", preset="tiny", num_devices=2, planners=("graphpipe", "nope")
      )
    )
  assert plan_cli.parse_shape(["branches=16", "layers=2"]) == {"branches": 16, "layers": 2}
  for items, match in [
    (["branches"], "key=value"),
    (["=3"], "key=value"),
    (["branches=x"], "branches: expected a positive integer, got 'x'"),
    (["layers=-1"], "layers: expected a positive integer, got '-1'"),
    (["batch_size=8"], "set the mini-batch with --batch_size"),
  ]:
    with pytest.raises(ValueError, match=match):
      plan_cli.parse_shape(items)
  ok = dict(preset="tiny", num_devices=2, planners=("pipedream",))
  for kw, match in [
    (dict(model="resnet"), "unknown model 'resnet'; choose one of"),
    (dict(planners=()), "no planner given; name one or more of"),
    (dict(num_devices=0), "--num_devices must be at least 1, got 0"),
    (dict(batch_size=0), "--batch_size must be at least 1, got 0"),
    (dict(num_microbatches=0), "--num_microbatches=0 does not divide"),
    (dict(batch_size=64, num_microbatches=3), "=3 does not divide the mini-batch of 64"),
    (dict(shape={"towers": 3}), "'candle_uno' has no shape argument 'towers'"),
    (dict(shape={"branches": 0}), "CANDLE-Uno needs at least one branch"),
  ]:
    with pytest.raises(ValueError, match=match):
      plan_cli.prepare(plan_cli.PlanOptions(**{"model": "candle_uno", **ok, **kw}))
  graph, cluster, batch = plan_cli.prepare(
    plan_cli.PlanOptions("candle_uno", **ok, batch_size=64, num_microbatches=4)
  )
  assert batch == 64 and cluster.num_devices == 2 and graph.graph["name"] == "candle_uno7"


TINY = Sweep(
  models=("candle_uno", "mmt"),
  devices=(2, 4),
  planners=("graphpipe", "pipedream", "piper"),
  preset="tiny",
  branches=(2, 4),
  branch_devices=4,
  microbatch_model="mmt",
  microbatch_devices=4,
  microbatch_batch=32,
  microbatch_list=(4, 16),
  ablation_devices=4,
  loss_models=(),
  steps=1,
)


@pytest.fixture(scope="module")
def tables():
  quiet = lambda msg: None
  dev = device_sweep(TINY, log=quiet)
  br = branch_sweep(TINY, log=quiet)
  return {
    "throughput": throughput_table(dev),
    "search_time": search_time_table(dev) + search_time_table(br),
    "branches": branch_table(br),
    "microbatch": microbatch_table(microbatch_sweep(TINY, log=quiet)),
    "ablation": ablation(TINY, dev, log=quiet),
    "_device_rows": dev,
  }


def test_throughput_and_search_tables(tables):
  tp, st = tables["throughput"], tables["search_time"]
  assert [(r["model"], r["devices"]) for r in tp] == [
    ("candle_uno", 2),
    ("candle_uno", 4),
    ("mmt", 2),
    ("mmt", 4),
  ]
  for r in tp:
    assert set(r) == set(THROUGHPUT_COLUMNS)
    seq = [r[p] for p in ("pipedream", "piper") if r[p]]
    assert r["best_sequential"] == max(seq)
    assert r["speedup"] == pytest.approx(r["graphpipe"] / r["best_sequential"])
    assert r["bapipe"] is None and r["luo"] is None  # not in this sweep
  cu4 = tp[1]
  assert cu4["piper"] is None and cu4["failed"] == "piper"  # 7 tiny towers: state limit
  assert cu4["speedup"] > 1.0
  assert [_label(r["model"]) for r in st[4:]] == [
    "CANDLE-Uno, 2 branches",
    "CANDLE-Uno, 4 branches",
  ]
  for r in st:
    assert set(r) == set(SEARCH_COLUMNS)
    assert r["graphpipe_s"] > 0 and r["pipedream_s"] > 0
    assert r["pipedream_over_graphpipe"] == pytest.approx(r["pipedream_s"] / r["graphpipe_s"])
    assert (r["piper_over_graphpipe"] is None) == ("piper" in r["failed"].split())


def test_branch_microbatch_and_ablation_tables(tables):
  br = tables["branches"]
  assert [r["branches"] for r in br] == [2, 4]
  for r in br:
    assert set(r) == set(BRANCH_COLUMNS) and r["devices"] == 4
    assert r["speedup_vs_pipedream"] == pytest.approx(r["graphpipe"] / r["pipedream"])
    assert r["speedup"] <= r["speedup_vs_pipedream"] + 1e-12  # best seq >= PipeDream
  mb = tables["microbatch"]
  assert [(r["microbatch"], r["num_microbatches"]) for r in mb] == [(4, 8), (16, 2)]
  for r in mb:
    assert set(r) == set(MICROBATCH_COLUMNS) and r["graphpipe"] and r["pipedream"]
  ab = tables["ablation"]
  assert [r["model"] for r in ab] == ["candle_uno", "mmt"]
  dev = {(r["model"], r["planner"]): r for r in tables["_device_rows"] if r["devices"] == 4}
  for r in ab:
    assert set(r) == set(ABLATION_COLUMNS)
    assert r["full"] == dev[(r["model"], "graphpipe")]["throughput"]  # reused, not re-run
    assert r["full_speedup"] == pytest.approx(r["full"] / r["sequential"])
    assert r["parallel_speedup"] == pytest.approx(r["parallel"] / r["sequential"])


def test_microbatch_sweep_holds_every_planner_to_the_size():
  sweep = Sweep(
    planners=("graphpipe", "pipedream"),
    preset="tiny",
    microbatch_model="mmt",
    microbatch_devices=4,
    microbatch_batch=32,
    microbatch_list=(8,),
  )
  rows = microbatch_sweep(sweep, log=lambda m: None)
  assert [r["planner"] for r in rows] == ["graphpipe", "pipedream"]
  assert all(r["microbatch"] == 8 and r["num_microbatches"] == 4 for r in rows)


def test_outputs_csv_markdown_and_plots(tables, tmp_path):
  path = tmp_path / "throughput.csv"
  write_csv(tables["throughput"], THROUGHPUT_COLUMNS, str(path))
  with open(path) as f:
    got = list(csv.DictReader(f))
  assert len(got) == 4 and tuple(got[0]) == THROUGHPUT_COLUMNS
  assert got[1]["piper"] == "" and float(got[1]["speedup"]) > 1
  comp = paper_comparison(tables, TINY)
  head = next(r for r in comp if r["claim"].startswith("Max throughput gain over PipeDream"))
  best = max(
    r["graphpipe"] / max(r[p] for p in ("pipedream", "piper") if r[p]) for r in tables["throughput"]
  )
  assert head["paper"] == "1.61x" and float(head["ratio"]) == pytest.approx(best / 1.61, abs=0.01)
  lost = [r for r in comp if r["paper"] is None]
  assert lost and all("lost" in r["note"] for r in lost)
  assert any("Table 1" in r["claim"] for r in lost)
  md = results_markdown(tables, TINY, plots=["throughput.png"])
  for section in (
    "## Ours vs the paper",
    "## (a)",
    "## (b)",
    "## (c)",
    "## (d)",
    "## (e)",
    "## What limits the comparison",
    "![throughput vs devices](throughput.png)",
  ):
    assert section in md
  assert "| fail |" in md  # Piper's failed cell
  import matplotlib  # noqa: F401  (installed by the test extra)

  files = write_plots(tables, str(tmp_path))
  assert files == ["throughput.png", "branches.png", "microbatch.png", "ablation.png"]
  assert all((tmp_path / f).stat().st_size > 1000 for f in files)


def test_loss_check_reports_a_failed_run():
  rows = loss_check(["no_such_model"], steps=1, timeout=120, dtypes=("float32",))
  assert rows[0]["model"] == "no_such_model" and "exit" in rows[0]["error"]
  assert rows[0]["dtype"] == "float32"
