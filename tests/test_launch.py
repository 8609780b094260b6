"""The local launcher: its own cores and GPUs per process, clear errors when they do not fit."""

import os
import subprocess
import sys

import pytest

from gpp_jax.cli.launch import LaunchOptions, assign
from gpp_jax.errors import GppError


def test_even_split_gives_each_process_its_own_block_of_cores():
  a = assign(LaunchOptions(num_processes=4), list(range(16)))
  assert [x.cores for x in a] == [tuple(range(4 * i, 4 * i + 4)) for i in range(4)]
  assert all(x.gpus is None for x in a)
  # An uneven split leaves the remainder idle rather than sharing a core.
  b = assign(LaunchOptions(num_processes=3), [2, 3, 5, 7, 11, 13, 17])
  assert [x.cores for x in b] == [(2, 3), (5, 7), (11, 13)]


def test_cpus_per_process_and_oversubscription():
  three = LaunchOptions(num_processes=2, cpus_per_process=3)
  assert [x.cores for x in assign(three, list(range(8)))] == [(0, 1, 2), (3, 4, 5)]
  with pytest.raises(GppError, match=r"3 processes x 2 cores need 6 cores.*may use 4 \(0-3\)"):
    assign(LaunchOptions(num_processes=3, cpus_per_process=2), [0, 1, 2, 3])
  with pytest.raises(GppError, match="--nopin"):
    assign(LaunchOptions(num_processes=3), [0, 1])
  # Unpinned processes share every core.
  unpinned = LaunchOptions(num_processes=3, pin=False)
  assert [x.cores for x in assign(unpinned, [0, 1])] == [None] * 3


def test_each_process_gets_its_own_gpus():
  two = LaunchOptions(num_processes=2, gpus_per_process=2)
  a = assign(two, list(range(16)), gpus=["0", "1", "2", "3"])
  assert [x.gpus for x in a] == [("0", "1"), ("2", "3")]
  assert [x.cores for x in a] == [tuple(range(8)), tuple(range(8, 16))]
  with pytest.raises(GppError, match="3 processes x 1 GPUs need 3 GPUs, but 2 are visible"):
    assign(LaunchOptions(num_processes=3), list(range(16)), gpus=["4", "5"])


def test_launched_processes_run_on_disjoint_cores():
  cores = sorted(os.sched_getaffinity(0))
  n = min(2, len(cores))
  code = "import os; print('CORES', sorted(os.sched_getaffinity(0)))"
  r = subprocess.run(
    [
      sys.executable,
      "-m",
      "gpp_jax.launch",
      f"--num_processes={n}",
      "--cpus_per_process=1",
      "--platform=cpu",
      "--",
      "python",
      "-c",
      code,
    ],
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert r.returncode == 0, r.stdout + r.stderr
  seen = sorted(l.split(" CORES ")[1] for l in r.stdout.splitlines() if " CORES " in l)
  assert seen == sorted(f"[{c}]" for c in cores[:n])


def test_launch_refuses_more_processes_than_cores():
  n = len(os.sched_getaffinity(0)) + 1
  r = subprocess.run(
    [sys.executable, "-m", "gpp_jax.launch", f"--num_processes={n}", "--platform=cpu", "--"]
    + ["python", "-c", "pass"],
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert r.returncode != 0
  assert f"{n} processes x 1 cores need {n} cores" in r.stderr
