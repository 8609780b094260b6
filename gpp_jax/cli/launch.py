"""Starts a local multi-process run on loopback.

  python -m gpp_jax.launch --num_processes=2 --devices_per_process=4 -- --model=mmt --steps=20

runs ``python -m gpp_jax.train`` with the flags after ``--`` in each process (or, when what
follows ``--`` is not a flag, that command, e.g. ``-- python my_script.py``). Process i gets
``GPP_COORDINATOR=127.0.0.1:<port>``, ``GPP_PROCESS_ID=i`` and forced CPU devices; its output
is prefixed with ``[i]``. If one process fails, the others are stopped after ``--grace_s``, and
the launcher exits with the first non-zero exit code.
"""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
import threading
import time

from absl import app, flags

from gpp_jax.runtime import processes as dist

FLAGS = flags.FLAGS
flags.DEFINE_integer("num_processes", 2, "processes to start")
flags.DEFINE_integer("devices_per_process", 4, "forced CPU devices per process")
flags.DEFINE_integer("port", 0, "coordinator port on 127.0.0.1 (0: pick a free one)")
flags.DEFINE_float("grace_s", 10.0, "after one process fails, seconds before the others are killed")
flags.DEFINE_bool("pin_cores", False, "pin process i to core i (modulo the cores available)")


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch(
  command: list[str],
  num_processes: int,
  devices_per_process: int,
  port: int = 0,
  grace_s: float = 10.0,
  env: dict | None = None,
  pin_cores: bool = False,
) -> int:
  """Runs ``command`` in ``num_processes`` processes; returns the first non-zero exit code.

  With ``pin_cores`` process i runs on core ``i % cores`` only.
  """
  cores = sorted(os.sched_getaffinity(0))
  port = port or free_port()
  procs = []
  for i in range(num_processes):
    e = dict(os.environ if env is None else env)
    e.update(
      {
        dist.ENV_COORDINATOR: f"127.0.0.1:{port}",
        dist.ENV_NUM_PROCESSES: str(num_processes),
        dist.ENV_PROCESS_ID: str(i),
        dist.ENV_LOCAL_DEVICES: str(devices_per_process),
        dist.ENV_TRANSFER_ADDRESS: f"127.0.0.1:{free_port()}",
        "PYTHONUNBUFFERED": "1",
      }
    )
    pin = functools.partial(os.sched_setaffinity, 0, {cores[i % len(cores)]}) if pin_cores else None
    procs.append(
      subprocess.Popen(
        command, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=pin
      )
    )

  def pump(i, p):
    for line in p.stdout:
      sys.stdout.write(f"[{i}] {line}")
      sys.stdout.flush()

  pumps = [threading.Thread(target=pump, args=(i, p), daemon=True) for i, p in enumerate(procs)]
  for t in pumps:
    t.start()
  code, failed_at = 0, None
  while any(p.poll() is None for p in procs):
    for p in procs:
      rc = p.poll()
      if rc is not None and rc != 0 and code == 0:
        code, failed_at = rc, time.monotonic()
    if failed_at is not None and time.monotonic() - failed_at > grace_s:
      for p in procs:
        if p.poll() is None:
          p.kill()
    time.sleep(0.1)
  for t in pumps:
    t.join(timeout=5)
  for p in procs:
    if code == 0 and p.returncode:
      code = p.returncode
  return code


def main(argv):
  rest = argv[1:]
  if rest and rest[0] == "--":
    rest = rest[1:]
  if not rest or rest[0].startswith("-"):
    command = [sys.executable, "-m", "gpp_jax.train", *rest]
  else:
    command = [sys.executable if rest[0] == "python" else rest[0], *rest[1:]]
  sys.exit(
    launch(
      command,
      FLAGS.num_processes,
      FLAGS.devices_per_process,
      FLAGS.port,
      FLAGS.grace_s,
      pin_cores=FLAGS.pin_cores,
    )
  )


if __name__ == "__main__":
  app.run(main)
