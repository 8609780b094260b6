"""The real-training check: pipelined training against one device, loss by loss.

``loss_check`` runs ``gpp_jax.experiments.loss_curves`` in a subprocess on 8 forced CPU
devices, once per precision, and returns one row per (model, dtype); ``LOSS_COLUMNS`` is the
CSV header of ``loss_check.csv``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

LOSS_COLUMNS = (
  "model",
  "dtype",
  "steps",
  "stages",
  "depth",
  "loss_first",
  "loss_last",
  "max_diff",
  "max_rel_diff",
  "first_step_over_1e-5",
  "error",
)


def loss_check(
  models: Sequence[str],
  steps: int,
  timeout: float = 3600,
  dtypes: Sequence[str] = ("float32", "float64"),
) -> list[dict[str, Any]]:
  """Runs ``gpp_jax.experiments.loss_curves`` in a subprocess with 8 forced CPU devices, once
  per precision in ``dtypes``, and returns one row per (model, dtype): plan shape, one-device
  loss at the first and last step, the largest |pipelined - one device| loss difference
  (absolute and relative to the one-device loss) and the first step (1-based) where it exceeds
  1e-5 (``error`` if the run failed)."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = (
    env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()
  env["JAX_PLATFORMS"] = "cpu"
  rows = []
  for dtype in dtypes:
    with tempfile.TemporaryDirectory() as tmp:
      out = os.path.join(tmp, "curves.json")
      cmd = [
        sys.executable,
        "-m",
        "gpp_jax.experiments.loss_curves",
        f"--models={','.join(models)}",
        f"--steps={steps}",
        f"--out={out}",
        f"--dtype={dtype}",
      ]
      failed = None
      try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not os.path.exists(out):
          tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
          failed = f"exit {proc.returncode}: {tail[0]}"
      except subprocess.TimeoutExpired:
        failed = f"timed out after {timeout:.0f} s"
      if failed:
        rows += [{"model": m, "dtype": dtype, "steps": steps, "error": failed} for m in models]
        continue
      with open(out) as f:
        curves = json.load(f)
    for m, c in curves.items():
      pipe, one = c["pipelined"], c["one_device"]
      diff = [abs(a - b) for a, b in zip(pipe, one)]
      over = [i + 1 for i, d in enumerate(diff) if d > 1e-5]
      rows.append(
        {
          "model": m,
          "dtype": dtype,
          "steps": steps,
          "stages": c["stages"],
          "depth": c["depth"],
          "loss_first": one[0],
          "loss_last": one[-1],
          "max_diff": c["max_diff"],
          "max_rel_diff": max(d / max(abs(b), 1e-12) for d, b in zip(diff, one)),
          "first_step_over_1e-5": over[0] if over else None,
        }
      )
  return rows
