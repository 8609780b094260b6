"""The tiny zoo models train pipelined with the GraphPipe plan exactly as on one device."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import gpp_jax
from gpp_jax.experiments.loss_curves import CurveConfig, loss_curves

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("model", ["mmt", "dlrm", "candle_uno"])
def test_loss_curve_matches_one_device(model):
  pipe, one, plan = loss_curves(model, 6, CurveConfig(num_microbatches=4, batch_size=16))
  assert plan.planner == "graphpipe"
  assert plan.depth() < plan.num_stages  # branches run as concurrent stages, not a chain
  assert np.all(np.isfinite(pipe))
  assert float(np.max(np.abs(pipe - one))) <= 1e-4
  assert one[-1] < one[0]  # it trains


def test_float64_loss_curve_matches_one_device_for_200_steps(tmp_path):
  """The full 200-step check for the model whose float32 curves separate (a ReLU kink
  crossing): in float64 the pipelined curve is the one-device curve."""
  env = dict(os.environ)  # the run's XLA flags: 8 forced CPU devices
  out = tmp_path / "curves.json"
  r = subprocess.run(
    [
      sys.executable,
      "-m",
      "gpp_jax.experiments.loss_curves",
      "--models=candle_uno",
      "--steps=200",
      "--dtype=float64",
      f"--out={out}",
    ],
    capture_output=True,
    text=True,
    timeout=600,
    env=env,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  c = json.loads(out.read_text())["candle_uno"]
  pipe, one = np.array(c["pipelined"]), np.array(c["one_device"])
  assert len(pipe) == 200 and c["dtype"] == "float64"
  assert float(np.max(np.abs(pipe - one))) <= 1e-10
  assert one[-1] < 0.5 * one[0]


def test_zoo_float64_needs_x64():
  from gpp_jax.experiments import zoo

  with pytest.raises(ValueError, match="jax_enable_x64"):
    zoo.setup("candle_uno", dtype="float64")


def _train(*flags):
  env = dict(os.environ)  # the run's XLA flags: 8 forced CPU devices
  return subprocess.run(
    [sys.executable, "-m", "gpp_jax.train", *flags],
    capture_output=True,
    text=True,
    timeout=600,
    env=env,
  )


def test_train_entry_point_writes_a_run_folder(tmp_path):
  env = dict(os.environ)  # the run's XLA flags: 8 forced CPU devices
  flagfile = os.path.join(os.path.dirname(__file__), "..", "configs", "candle_uno_tiny.flags")
  r = subprocess.run(
    [
      sys.executable,
      "-m",
      "gpp_jax.train",
      f"--flagfile={flagfile}",
      "--num_devices=4",
      "--num_microbatches=4",
      "--batch_size=16",
      "--min_stages=2",  # a pipeline, whatever plain jit would measure on this machine
      "--steps=6",
      "--log_every=2",
      f"--run_dir={tmp_path}",
    ],
    capture_output=True,
    text=True,
    timeout=600,
    env=env,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  for name in (
    "plan.json",
    "plan.txt",
    "layer_graph.json",
    "stage_graph.dot",
    "timeline_measured.json",
    "timeline_predicted.json",
    "metrics.jsonl",
    "calibration.json",
    "summary.json",
  ):
    assert (tmp_path / name).stat().st_size > 0, name
  rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [2, 4, 6] and all(np.isfinite(r["loss"]) for r in rows)
  assert "step 6/6" in r.stderr  # steps count from 1 to --steps
  measured = json.loads((tmp_path / "timeline_measured.json").read_text())["traceEvents"]
  assert any(e["name"].startswith("B") for e in measured)
  tracks = {e["args"]["name"] for e in measured if e.get("name") == "process_name"}
  assert any(t.startswith("stage 0 (devices ") for t in tracks), tracks
  summary = json.loads((tmp_path / "summary.json").read_text())
  # Steps 3-4 only: step 2 measured the memory, step 6 the timeline (both slower).
  assert summary["measured_ms"] == rows[1]["step_ms"], (summary, rows)
  assert summary["model"] == "host-aware" and summary["predicted_devices_ms"] > 0
  assert summary["prediction"] in ("measured", "modelled")
  assert summary["candidates_how"][summary["chosen"]] == summary["prediction"]
  # Each device's measured peak beside the program's prediction and the planner's own model.
  assert summary["memory"] and all(
    d["planned_peak_bytes"] > 0 and d["measured_peak_bytes"] > 0 for d in summary["memory"]
  )
  assert "the planner's memory model" in r.stdout
  assert "step time, measured" in r.stdout and "devices only:" in r.stdout
  cal = json.loads((tmp_path / "calibration.json").read_text())
  layers = {n["id"] for n in json.loads((tmp_path / "layer_graph.json").read_text())["nodes"]}
  assert set(cal["time_f"]) == layers and min(cal["time_f"].values()) > 0
  assert "digraph stages" in (tmp_path / "stage_graph.dot").read_text()
  plan = json.loads((tmp_path / "plan.json").read_text())
  # From the flagfile: GraphPipe's plan of at least min_stages=2 stages.
  assert plan["planner"] == "graphpipe" and len(plan["stages"]) >= 2, (
    plan["planner"],
    r.stderr[-2000:],
  )
  # The schedule visualiser: the plan under every schedule, and the measured step.
  from gpp_jax.passes.schedules import GENERATORS

  for name in [*GENERATORS, "measured"]:
    png = (tmp_path / f"schedule_{name}.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000, name


def test_train_reruns_a_saved_plan_exactly(tmp_path):
  first, again = tmp_path / "first", tmp_path / "again"
  common = ["--model=candle_uno", "--num_devices=4", "--num_microbatches=4", "--batch_size=16"]
  r = _train(*common, "--steps=2", f"--run_dir={first}")
  assert r.returncode == 0, r.stderr[-3000:]
  r = _train(*common, "--steps=2", f"--run_dir={again}", f"--plan={first / 'plan.json'}")
  assert r.returncode == 0, r.stderr[-3000:]
  a = gpp_jax.Plan.load(str(first / "plan.json"))
  b = gpp_jax.Plan.load(str(again / "plan.json"))
  assert a == b and a.fingerprint() == b.fingerprint()
  # The given plan was run as it is; its layers were measured only to predict its time here.
  summary = json.loads((again / "summary.json").read_text())
  assert summary["predicted_ms"] > 0 and summary["measured_ms"] > 0, summary


@pytest.mark.parametrize(
  "flag, message",
  [
    ("--model=resnet", "--model='resnet' is not one of"),
    ("--planner=nope", "--planner='nope' is not one of"),
    ("--planner=manual", "a plan you write is given as --plan=PATH"),
    ("--batch_size=10", "does not split into --num_microbatches=8"),
    ("--plan=/nonexistent/plan.json", "no such file"),
  ],
)
def test_train_bad_flags_get_a_message_without_a_traceback(flag, message):
  r = _train(flag, "--steps=1")
  assert r.returncode != 0
  assert message in r.stderr, r.stderr[-2000:]
  assert "Traceback" not in r.stderr, r.stderr[-2000:]
