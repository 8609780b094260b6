"""Two processes with 4 forced CPU devices each, started on loopback."""

import os
import signal
import subprocess
import sys
import time

import pytest

from gpp_jax.cli.launch import free_port
from gpp_jax.runtime import processes as dist

WORKER = os.path.join(os.path.dirname(__file__), "mp_worker.py")
pytestmark = pytest.mark.slow


def _env(i, port):
  e = dict(os.environ)
  e.pop("XLA_FLAGS", None)
  e.update(
    {
      dist.ENV_COORDINATOR: f"127.0.0.1:{port}",
      dist.ENV_NUM_PROCESSES: "2",
      dist.ENV_PROCESS_ID: str(i),
      dist.ENV_LOCAL_DEVICES: "4",
      dist.ENV_TRANSFER_ADDRESS: f"127.0.0.1:{free_port()}",
      "PYTHONUNBUFFERED": "1",
    }
  )
  return e


def test_two_processes_match_one_device_reference():
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  r = subprocess.run(
    [
      sys.executable,
      "-m",
      "gpp_jax.launch",
      "--num_processes=2",
      "--devices_per_process=4",
      "--platform=cpu",
      "--",
      "python",
      WORKER,
      "check",
      "120",
    ],
    capture_output=True,
    text=True,
    timeout=300,
    env=env,
  )
  out = r.stdout + r.stderr
  assert r.returncode == 0, out[-3000:]
  results = [l for l in out.splitlines() if "RESULT" in l]
  assert len(results) == 2, out[-3000:]
  for line in results:
    assert "checked=13" in line  # params, optimizer state and loss held by this process
    # Edges cross the process boundary both ways: 0->1, 1->2, 2->3 alternate processes.
    assert "edges=[(0, 1), (0, 3), (1, 2), (2, 3)]" in line


def _run_and_interrupt(sig):
  """Starts both processes, sends ``sig`` to process 1 after its step 2; returns process 0's
  exit code, output and the seconds it took to fail."""
  port = free_port()
  procs = [
    subprocess.Popen(
      [sys.executable, WORKER, "kill", "10"],
      env=_env(i, port),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  try:
    deadline = time.monotonic() + 180
    seen = []
    while time.monotonic() < deadline:
      line = procs[1].stdout.readline()
      seen.append(line)
      if line.startswith("STEP 2"):
        break
    else:
      pytest.fail("process 1 never reached step 2:\n" + "".join(seen[-50:]))
    procs[1].send_signal(sig)
    t = time.monotonic()
    out, _ = procs[0].communicate(timeout=120)
    return procs[0].returncode, out, time.monotonic() - t
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()


def test_killing_a_process_fails_the_other_with_a_clear_message():
  rc, out, elapsed = _run_and_interrupt(signal.SIGKILL)
  assert rc == 3, out[-3000:]
  assert "FAILED: the pipelined step failed on process 0 of 2" in out, out[-3000:]
  assert "the peer process has died" in out
  assert elapsed < 60


def test_stalled_peer_times_out_with_a_clear_message():
  rc, out, elapsed = _run_and_interrupt(signal.SIGSTOP)
  assert rc == 3, out[-3000:]
  assert "FAILED: the pipelined step did not finish within 10 s on process 0 of 2" in out, out[
    -3000:
  ]
  assert "peer process has died or stalls" in out
  assert elapsed < 60


def _launch_worker(mode, timeout="120"):
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  cmd = [sys.executable, "-m", "gpp_jax.launch", "--num_processes=2", "--devices_per_process=4"]
  cmd.append("--platform=cpu")
  return subprocess.run(
    [*cmd, "--", "python", WORKER, mode, timeout],
    capture_output=True,
    text=True,
    timeout=300,
    env=env,
  )


def test_two_processes_plan_alike_from_calibrated_times_and_match_the_reference():
  r = _launch_worker("calibrate")
  out = r.stdout + r.stderr
  assert r.returncode == 0, out[-3000:]
  results = [l for l in out.splitlines() if "RESULT" in l]
  assert len(results) == 2, out[-3000:]
  plans = {l.split("plan=")[1].split()[0] for l in results}
  assert len(plans) == 1, results  # one plan on both processes
  checked = [int(l.split("checked=")[1].split()[0]) for l in results]
  assert sum(checked) >= 13, results  # the parameters, optimizer state and loss, somewhere


def _results(r) -> list[str]:
  """The RESULT lines of both processes of a worker run that must have succeeded."""
  out = r.stdout + r.stderr
  assert r.returncode == 0, out[-3000:]  # each process exits 1 if a value it holds differs
  results = [l for l in out.splitlines() if "] RESULT process=" in l]
  assert len(results) == 2, out[-3000:]
  return results


def test_a_stage_spanning_two_processes_matches_the_reference():
  results = _results(_launch_worker("span"))
  maxdiff = [float(l.split("maxdiff=")[1].split()[0]) for l in results]
  assert max(maxdiff) <= 1e-5, results
  # Process 1 holds l1 (its shard of the spanning stage) and l2: both checked there.
  checked = {l.split("process=")[1][0]: int(l.split("checked=")[1].split()[0]) for l in results}
  assert checked["1"] >= 12, results


def test_run_steps_over_two_processes_equals_one_call_per_step():
  # Stages alternate between the processes; run_steps (which runs the steps one call at a
  # time with several processes) ends where 4 calls of the step end, on both processes.
  results = _results(_launch_worker("stream"))
  for line in results:
    assert float(line.split("maxdiff=")[1].split()[0]) <= 1e-5, results
    assert int(line.split("checked=")[1].split()[0]) >= 6, results


def test_processes_with_different_plans_get_a_clear_error():
  r = _launch_worker("differ")
  out = r.stdout + r.stderr
  assert r.returncode != 0, out[-3000:]
  errors = [l for l in out.splitlines() if "] PLANERROR process=" in l]
  assert len(errors) == 2, out[-3000:]  # both processes refuse, neither hangs
  assert all("planned differently from process 0" in l for l in errors), errors
  assert "Plan.load" in errors[0]


def test_a_process_that_never_sets_up_fails_the_others_after_the_timeout():
  r = _launch_worker("absent", timeout="4")
  out = r.stdout + r.stderr
  assert r.returncode != 0, out[-3000:]
  failed = [l for l in out.splitlines() if l.startswith("[0] FAILED: ")]
  assert len(failed) == 1, out[-3000:]
  assert "process 1 did not report its plan within 4 s" in failed[0], failed


def test_train_program_runs_an_nnx_model_over_two_processes_for_several_steps():
  """The state an update leaves on another process than the stage that reads it next step
  (a (1,)-shaped bias whose update used to follow the global norm to stage 0) moves there."""
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  r = subprocess.run(
    [sys.executable, "-m", "gpp_jax.launch", "--num_processes=2", "--devices_per_process=2"]
    + ["--platform=cpu", "--grace_s=5", "--", "--model=dlrm", "--num_devices=4"]
    + ["--planner=balanced", "--nocalibrate", "--batch_size=8", "--num_microbatches=2"]
    + [
      "--steps=4",
      "--log_every=1",
      "--timeout_s=60",
      f"--run_dir={os.environ.get('TMPDIR', '/tmp')}/gpp-mp-dlrm",
    ],
    capture_output=True,
    text=True,
    timeout=300,
    env=env,
  )
  out = r.stdout + r.stderr
  assert r.returncode == 0, out[-3000:]
  logged = [l for l in out.splitlines() if "train.py" in l and " step 4/4 loss" in l]
  assert len(logged) == 2, out[-3000:]


def test_every_placement_kind_runs_over_two_processes():
  """One device to two devices of the other process, to a stage spanning both, to two devices
  of the first: each transfer between them crosses the processes and matches the reference."""
  results = _results(_launch_worker("widths"))
  maxdiff = [float(l.split("maxdiff=")[1].split()[0]) for l in results]
  assert max(maxdiff) <= 1e-5, results
  assert "devices=[(0,), (2048, 2049), (3, 2050), (1, 2)]" in results[0], results


@pytest.mark.parametrize("planner", ["balanced", "graphpipe", "pipedream"])
def test_plans_the_planners_choose_run_over_two_processes(planner):
  results = _results(_launch_worker(f"planned-{planner}"))
  maxdiff = [float(l.split("maxdiff=")[1].split()[0]) for l in results]
  assert max(maxdiff) <= 1e-5, results
  plans = {l.split("plan=")[1].split()[0] for l in results}
  assert len(plans) == 1, results
  checked = [int(l.split("checked=")[1].split()[0]) for l in results]
  assert sum(checked) >= 13, results
  # Devices given alternately from each process: the planner's stages use both.
  ids = [
    int(x)
    for x in results[0]
    .split("devices=")[1]
    .replace("(", " ")
    .replace(")", " ")
    .replace(",", " ")
    .replace("[", " ")
    .replace("]", " ")
    .split()
  ]
  assert min(ids) < 2048 <= max(ids), results
