"""The planning and reproduction programs as a user runs them: where the outputs go, progress on
stderr, and bad flag values stopped with the message alone (subprocesses, tiny shapes)."""

import glob
import hashlib
import os
import shutil
import subprocess
import sys

import pytest
from harness import child_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(REPO, "docs")


def _run(*args: str, cwd: str = REPO, timeout: float = 120) -> subprocess.CompletedProcess:
  env = child_env()
  return subprocess.run(
    [sys.executable, "-m", *args],
    capture_output=True,
    text=True,
    cwd=cwd,
    env=env,
    timeout=timeout,
  )


def _docs_digest() -> dict[str, str]:
  """Path under docs/ -> sha256 of every file in the committed docs/ (sub-folders included)."""
  out = {}
  for root, _, names in os.walk(DOCS):
    for name in sorted(names):
      path = os.path.join(root, name)
      with open(path, "rb") as f:
        out[os.path.relpath(path, DOCS)] = hashlib.sha256(f.read()).hexdigest()
  return out


def _git_status() -> str | None:
  """``git status --porcelain`` of the repository (None when it is not a git checkout)."""
  try:
    proc = subprocess.run(
      ["git", "-C", REPO, "status", "--porcelain", "--untracked-files=all"],
      capture_output=True,
      text=True,
      timeout=60,
    )
  except FileNotFoundError:
    return None
  return proc.stdout if proc.returncode == 0 else None


def test_reproduce_writes_under_runs_and_leaves_docs_alone():
  docs, status = _docs_digest(), _git_status()
  runs = os.path.join(REPO, "runs")
  had_runs = os.path.isdir(runs)
  before = set(glob.glob(os.path.join(runs, "reproduce-quick-tiny-*")))
  proc = _run(
    "gpp_jax.experiments.reproduce", "--quick", "--preset=tiny", "--noloss_check", "--noplots"
  )
  made = set(glob.glob(os.path.join(runs, "reproduce-quick-tiny-*"))) - before
  try:
    assert proc.returncode == 0, proc.stderr
    assert len(made) == 1, (made, proc.stderr)
    (out_dir,) = made
    files = sorted(os.listdir(out_dir))
    assert files == [
      "ablation.csv",
      "branches.csv",
      "microbatch.csv",
      "results.md",
      "search_time.csv",
      "throughput.csv",
    ]
    with open(os.path.join(out_dir, "results.md")) as f:
      md = f.read()
    assert "--quick --preset=tiny --noloss_check" in md and "`tiny` preset" in md
    # The committed results and the work tree are untouched.
    assert _docs_digest() == docs
    if status is not None:
      assert _git_status() == status
    # Progress: which sweep, which configuration, how far; on stderr, not in the tables.
    assert "[throughput] MMT 4 devices (1/6)" in proc.stderr
    assert "[throughput] CANDLE-Uno 8 devices (6/6)" in proc.stderr
    assert "[branches] CANDLE-Uno 4 branches, 8 devices (2/2)" in proc.stderr
    assert "[ablation] DLRM 8 devices (2/3)" in proc.stderr
    assert os.path.basename(out_dir) in proc.stderr.splitlines()[-1]
    assert "[throughput]" not in proc.stdout
    with open(os.path.join(out_dir, "throughput.csv")) as f:
      assert "[throughput]" not in f.read()
  finally:
    for d in made:
      shutil.rmtree(d, ignore_errors=True)
    if not had_runs and os.path.isdir(runs) and not os.listdir(runs):
      os.rmdir(runs)


@pytest.mark.parametrize(
  "args, message",
  [
    (["--quick", "--out_dir=docs"], "--quick would replace the full sweep's results in docs/"),
    (["--steps=0"], "--steps must be at least 1, got 0"),
  ],
)
def test_reproduce_bad_flags_print_the_message_alone(args, message):
  docs = _docs_digest()
  proc = _run("gpp_jax.experiments.reproduce", *args)
  assert proc.returncode != 0
  assert message in proc.stderr and "Traceback" not in proc.stderr + proc.stdout
  assert "[throughput]" not in proc.stderr  # stopped before any sweep
  assert _docs_digest() == docs


@pytest.mark.parametrize(
  "args, message",
  [
    (["--planner=graphpipe,nope"], "unknown planner 'nope'; choose one of"),
    (["--shape=towers=3"], "has no shape argument 'towers'; its shape arguments are"),
    (["--num_microbatches=3"], "--num_microbatches=3 does not divide the mini-batch"),
    (["--json=/nonexistent-folder/plans.json"], "folder /nonexistent-folder does not exist"),
  ],
)
def test_plan_cli_bad_flags_print_the_message_alone(args, message):
  # Every check of ``prepare`` is covered in-process by test_reproduce.py; these run the program.
  proc = _run(
    "gpp_jax.plan", "--model=candle_uno", "--preset=tiny", "--num_devices=2", *args, timeout=60
  )
  assert proc.returncode != 0
  assert message in proc.stderr, proc.stderr
  assert "Traceback" not in proc.stderr + proc.stdout
  assert "[1/" not in proc.stderr and not proc.stdout  # stopped before planning


def test_the_planning_program_plans_under_a_memory_limit():
  from gpp_jax.cli.plan import PlanOptions, compare, format_report

  tiny = PlanOptions("mmt", preset="tiny", cluster="cpu", num_devices=4, planners=["pipedream"])
  free = compare(tiny)
  need = free["results"][0]["max_memory"]
  report = compare(
    PlanOptions(
      "mmt",
      preset="tiny",
      cluster="cpu",
      num_devices=4,
      planners=["pipedream", "graphpipe"],
      memory_limit=int(need * 0.9),
    )
  )
  assert report["memory_per_device"] == int(need * 0.9)
  for r in report["results"]:  # a plan under the budget, or the planner's no-fit error
    assert "error" in r or r["max_memory"] <= int(need * 0.9), r
  assert "KiB per device" in format_report(report) or "MiB per device" in format_report(report)
