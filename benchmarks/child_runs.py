"""Runs a benchmark's configuration in a process of its own: the script started again with
``--child=<the configuration as JSON>``, which prints its record as one ``RESULT <json>``
line (each configuration then compiles and measures memory from a fresh start)."""

import json
import subprocess
import sys


def run_child(script: str, cfg: dict, timeout: float = 1800) -> dict:
  """``script --child=cfg``'s record, or ``{"error": its last line of output}`` where it
  failed or printed none."""
  out = subprocess.run(
    [sys.executable, script, f"--child={json.dumps(cfg)}"],
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
  if out.returncode or not lines:
    tail = (out.stdout + out.stderr)[-1500:]
    return {"error": tail.strip().splitlines()[-1] if tail else "?"}
  return json.loads(lines[-1][len("RESULT ") :])
