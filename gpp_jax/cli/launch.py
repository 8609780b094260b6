"""Starts a local multi-process run on loopback, one process per core set or per GPU.

  python -m gpp_jax.launch --num_processes=2 --devices_per_process=4 -- --model=mmt --steps=20

runs ``python -m gpp_jax.train`` with the flags after ``--`` in each process (or, when what
follows ``--`` is not a flag, that command, e.g. ``-- python my_script.py``). Process i gets
``GPP_COORDINATOR=127.0.0.1:<port>``, ``GPP_PROCESS_ID=i`` and its devices:

* on a CPU host, ``--devices_per_process`` forced CPU devices, and the process is pinned to its
  own cores: ``--cpus_per_process`` of them (0: the cores this launcher may use, split evenly),
  process i taking the i-th block, so processes do not share cores with each other;
* on a GPU host (``--platform=gpu``, or ``auto`` when ``nvidia-smi`` lists GPUs), its own
  ``--gpus_per_process`` GPUs through ``CUDA_VISIBLE_DEVICES`` (and its block of cores).

Its output is prefixed with ``[i]``. If one process fails, the others are stopped after
``--grace_s``, and the launcher exits with the first non-zero exit code.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

from absl import app, flags, logging

from gpp_jax.errors import GppError
from gpp_jax.runtime import processes as dist

FLAGS = flags.FLAGS
flags.DEFINE_integer("num_processes", 2, "processes to start")
flags.DEFINE_integer("devices_per_process", 4, "forced CPU devices per process (CPU hosts)")
flags.DEFINE_integer(
  "cpus_per_process", 0, "cores each process is pinned to (0: an even split of the cores)"
)
flags.DEFINE_bool("pin", True, "pin each process to its own cores (--nopin: share all cores)")
flags.DEFINE_enum(
  "platform", "auto", ["auto", "cpu", "gpu"], "auto: gpu when nvidia-smi lists GPUs"
)
flags.DEFINE_integer("gpus_per_process", 1, "GPUs per process (GPU hosts)")
flags.DEFINE_integer("port", 0, "coordinator port on 127.0.0.1 (0: pick a free one)")
flags.DEFINE_float("grace_s", 10.0, "after one process fails, seconds before the others are killed")


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def local_gpus() -> list[str]:
  """The GPUs this launcher may hand out: ``CUDA_VISIBLE_DEVICES`` if set, else nvidia-smi's."""
  visible = os.environ.get("CUDA_VISIBLE_DEVICES")
  if visible is not None:
    return [g for g in visible.split(",") if g.strip() and g.strip() != "-1"]
  if shutil.which("nvidia-smi") is None:
    return []
  try:
    out = subprocess.run(
      ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
      capture_output=True,
      text=True,
      timeout=30,
    )
  except (OSError, subprocess.SubprocessError):
    return []
  return [line.strip() for line in out.stdout.splitlines() if line.strip().isdigit()]


@dataclasses.dataclass(frozen=True)
class LaunchOptions:
  """How to start the processes, one field per flag (``from_flags``).

  Attributes:
    num_processes: processes to start.
    devices_per_process: forced CPU devices per process (CPU hosts).
    cpus_per_process: cores each process is pinned to (0: an even split of the cores).
    pin: pin each process to its own cores (False: they share all cores).
    platform: "cpu", "gpu" or "auto" (gpu when GPUs are visible).
    gpus_per_process: GPUs per process (GPU hosts).
    port: coordinator port on 127.0.0.1 (0: pick a free one).
    grace_s: after one process fails, seconds before the others are killed.
  """

  num_processes: int = 2
  devices_per_process: int = 4
  cpus_per_process: int = 0
  pin: bool = True
  platform: str = "auto"
  gpus_per_process: int = 1
  port: int = 0
  grace_s: float = 10.0

  @classmethod
  def from_flags(cls, values: flags.FlagValues) -> LaunchOptions:
    """The options the launcher's flags give."""
    return cls(
      num_processes=values.num_processes,
      devices_per_process=values.devices_per_process,
      cpus_per_process=values.cpus_per_process,
      pin=values.pin,
      platform=values.platform,
      gpus_per_process=values.gpus_per_process,
      port=values.port,
      grace_s=values.grace_s,
    )


@dataclasses.dataclass(frozen=True)
class Assignment:
  """What one local process gets: its cores (None: not pinned) and GPUs (None: CPU devices)."""

  cores: tuple[int, ...] | None
  gpus: tuple[str, ...] | None


def assign(
  options: LaunchOptions, cores: list[int], gpus: list[str] | None = None
) -> list[Assignment]:
  """Splits ``cores`` (and ``gpus``, when given) into one disjoint block per process, as
  ``options`` asks (``num_processes``, ``cpus_per_process``, ``pin``, ``gpus_per_process``).

  ``cpus_per_process=0`` splits the cores evenly (at least one each). More processes than the
  cores allow is an error, not silent sharing: pass ``--nopin`` to share the cores.
  """
  num_processes, gpus_per_process = options.num_processes, options.gpus_per_process
  if num_processes < 1:
    raise GppError(f"num_processes must be at least 1, got {num_processes}")
  gpu_blocks: list[tuple[str, ...] | None] = [None] * num_processes
  if gpus is not None:
    need = num_processes * gpus_per_process
    if gpus_per_process < 1 or need > len(gpus):
      raise GppError(
        f"{num_processes} processes x {gpus_per_process} GPUs need {need} GPUs, but "
        f"{len(gpus)} are visible ({','.join(gpus) or 'none'}); start fewer processes or "
        f"pass --platform=cpu"
      )
    gpu_blocks = [
      tuple(gpus[i * gpus_per_process : (i + 1) * gpus_per_process]) for i in range(num_processes)
    ]
  if not options.pin:
    return [Assignment(None, g) for g in gpu_blocks]
  per = options.cpus_per_process or max(1, len(cores) // num_processes)
  if per * num_processes > len(cores):
    raise GppError(
      f"{num_processes} processes x {per} cores need {per * num_processes} cores, but this "
      f"launcher may use {len(cores)} ({_ranges(cores)}); lower --cpus_per_process or "
      f"--num_processes, or pass --nopin to let the processes share the cores"
    )
  return [
    Assignment(tuple(cores[i * per : (i + 1) * per]), gpu_blocks[i]) for i in range(num_processes)
  ]


def _ranges(cores) -> str:
  cores = sorted(cores)
  out, start = [], None
  for a, b in zip(cores, [*cores[1:], None]):
    start = a if start is None else start
    if b != a + 1:
      out.append(f"{start}" if start == a else f"{start}-{a}")
      start = None
  return ",".join(out)


def launch(command: list[str], options: LaunchOptions, env: dict | None = None) -> int:
  """Runs ``command`` in ``options.num_processes`` processes; returns the first non-zero exit
  code. ``env``: the environment they start from (None: this process's).

  ``options.platform`` is ``cpu`` (forced CPU devices), ``gpu`` (one block of GPUs per
  process) or ``auto`` (``gpu`` when GPUs are visible). Each process is pinned to its own block
  of cores unless ``options.pin`` is False (see ``assign``).
  """
  num_processes, devices_per_process = options.num_processes, options.devices_per_process
  base = dict(os.environ if env is None else env)
  gpus = local_gpus() if options.platform in ("gpu", "auto") else []
  if options.platform == "gpu" and not gpus:
    raise GppError("--platform=gpu, but no GPU is visible (nvidia-smi lists none)")
  use_gpu = bool(gpus) and options.platform != "cpu"
  plan = assign(options, sorted(os.sched_getaffinity(0)), gpus if use_gpu else None)
  grace_s = options.grace_s
  port = options.port or free_port()
  procs = []
  for i, a in enumerate(plan):
    e = dict(base)
    e.update(
      {
        dist.ENV_COORDINATOR: f"127.0.0.1:{port}",
        dist.ENV_NUM_PROCESSES: str(num_processes),
        dist.ENV_PROCESS_ID: str(i),
        dist.ENV_TRANSFER_ADDRESS: f"127.0.0.1:{free_port()}",
        "PYTHONUNBUFFERED": "1",
      }
    )
    if a.gpus is not None:
      e["CUDA_VISIBLE_DEVICES"] = ",".join(a.gpus)
      e.pop(dist.ENV_LOCAL_DEVICES, None)
    else:
      e[dist.ENV_LOCAL_DEVICES] = str(devices_per_process)
    logging.info(
      "process %d: cores %s, %s",
      i,
      _ranges(a.cores) if a.cores else "all",
      f"GPUs {','.join(a.gpus)}" if a.gpus else f"{devices_per_process} CPU devices",
    )
    procs.append(
      subprocess.Popen(
        command,
        env=e,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_pinner(a.cores),
      )
    )

  def pump(i, p):
    for line in p.stdout:
      sys.stdout.write(f"[{i}] {line}")
      sys.stdout.flush()

  pumps = [threading.Thread(target=pump, args=(i, p), daemon=True) for i, p in enumerate(procs)]
  for t in pumps:
    t.start()
  code, failed_at, started = 0, None, time.monotonic()
  while any(p.poll() is None for p in procs):
    for i, p in enumerate(procs):
      rc = p.poll()
      if rc is not None and rc != 0 and code == 0:
        code, failed_at = rc, time.monotonic()
        _say(
          f"process {i} exited with code {rc} after {failed_at - started:.1f} s; the others "
          f"are stopped if still running in {grace_s:g} s"
        )
    if failed_at is not None and time.monotonic() - failed_at > grace_s:
      for i, p in enumerate(procs):
        if p.poll() is None:
          _say(f"process {i} still runs {time.monotonic() - failed_at:.1f} s later: killed")
          p.kill()
    time.sleep(0.1)
  for t in pumps:
    t.join(timeout=5)
  for p in procs:
    if code == 0 and p.returncode:
      code = p.returncode
  return code


def _say(message: str) -> None:
  sys.stdout.write(f"gpp_jax.launch: {message}\n")
  sys.stdout.flush()


def _pinner(cores):
  if cores is None:
    return None
  return lambda: os.sched_setaffinity(0, set(cores))


def main(argv):
  rest = argv[1:]
  if rest and rest[0] == "--":
    rest = rest[1:]
  if not rest or rest[0].startswith("-"):
    command = [sys.executable, "-m", "gpp_jax.train", *rest]
  else:
    command = [sys.executable if rest[0] == "python" else rest[0], *rest[1:]]
  try:
    code = launch(command, LaunchOptions.from_flags(FLAGS))
  except GppError as e:
    sys.exit(f"gpp_jax.launch: {e}")
  sys.exit(code)


if __name__ == "__main__":
  app.run(main)
