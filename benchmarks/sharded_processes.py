"""What a JAX user runs against pipelines, over two processes of 4 forced CPU devices each.

  python benchmarks/sharded_processes.py
  python benchmarks/sharded_processes.py --models=gpt --steps=20

The six configurations of ``benchmarks/memory.py --parts=sharded`` (plain jit, jit data
parallel, jit fsdp, jit sharded over the mesh ``data:4,model:2``, GraphPipe's plan with
replicated and with sharded stages), each trained by ``python -m gpp_jax.launch
--num_processes=2`` for ``--steps`` steps, one after another. Per configuration: the measured
step time (median of the logged intervals after the first, process 0's clock), the ratio to
plain jit's, and the peak per device of process 0's devices, measured over the second step
(``gpp_jax.train --measure_memory``) and as the step's program predicts it. The baselines run
as saved plans (``--plan``), the pipelines as their planner chooses them (``--min_stages=2``).
"""

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["gpt", "mmt"], "zoo models (tiny presets)")
flags.DEFINE_integer("steps", 30, "training steps per configuration")
flags.DEFINE_integer("batch_size", 32, "examples per step")
flags.DEFINE_integer("microbatches", 4, "micro-batches per step for the pipelines")

MESH = "data:4,model:2"
BASELINES = {  # name -> (mesh or None, devices of the one stage, param_sharding)
  "plain jit": (None, 1, "model"),
  "jit data parallel": (None, 8, "replicated"),
  "jit fsdp": (None, 8, "fsdp"),
  "jit sharded": (MESH, 4, "model"),
}
PIPELINES = {"graphpipe replicated": None, "graphpipe sharded": MESH}


def layers_of(model: str) -> list[str]:
  """The model's layers, as ``gpp_jax.train`` groups them (one device, nothing compiled)."""
  import gpp_jax
  from gpp_jax.experiments import zoo

  run = zoo.setup(model, "tiny")
  pp = gpp_jax.graph_pipeline(run.train_step, num_microbatches=1, layer_depth=run.spec.layer_depth)
  graph = pp.layer_graph_for(run.model, run.optimizer, run.batches(FLAGS.batch_size, 1)[0])
  return list(graph.nodes)


def launch(model: str, extra: list[str], run_dir: str) -> dict:
  cmd = [sys.executable, "-m", "gpp_jax.launch", "--num_processes=2"]
  cmd += ["--devices_per_process=4", "--platform=cpu", "--grace_s=5", "--"]
  cmd += [f"--model={model}", "--preset=tiny", "--nocalibrate"]
  cmd += [f"--batch_size={FLAGS.batch_size}", f"--steps={FLAGS.steps}", "--log_every=5"]
  cmd += ["--timeout_s=120", f"--run_dir={run_dir}", *extra]
  env = dict(os.environ)
  env["XLA_FLAGS"] = re.sub(
    r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")
  )
  r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
  out = r.stdout + r.stderr
  if r.returncode:
    return {"error": out.strip().splitlines()[-1][:120] if out.strip() else "?"}
  ms = [float(m) for m in re.findall(r"^\[0\] .* ([\d.]+) ms/step$", out, re.M)]
  table = re.findall(r"^\[0\]\s+cpu:\d+\s+([\d.]+)\s+([\d.]+)\s+[-+][\d.]+%", out, re.M)
  plan = next(iter(re.findall(r"^\[0\] (Plan by .*)$", out, re.M)), "")
  return {
    "step_ms": statistics.median(ms[1:]) if len(ms) > 1 else float("nan"),
    "measured_peak": max((float(m) for m, _ in table), default=float("nan")) * 2**20,
    "predicted_peak": max((float(p) for _, p in table), default=float("nan")) * 2**20,
    "plan": plan,
  }


def main(argv):
  del argv
  print(
    f"two processes x 4 forced CPU devices, batch {FLAGS.batch_size}, {FLAGS.steps} steps each; "
    "step time measured (process 0, median of the logged intervals after the first); peak per "
    "device of process 0's devices, measured over one step and as the step's program predicts"
  )
  print(
    f"{'model':6s} {'configuration':22s} {'step ms':>8s} {'vs plain':>8s} "
    f"{'peak MiB':>9s} {'pred MiB':>9s}  plan"
  )
  for model in FLAGS.models:
    layers = layers_of(model)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
      for name, (mesh, width, how) in BASELINES.items():
        plan = {
          "stages": [{"index": 0, "layers": layers, "devices": list(range(width))}],
          "edges": [],
          "num_microbatches": 1,
          "batch_size": FLAGS.batch_size,
          "planner": name,
          "param_sharding": how,
        }
        path = os.path.join(tmp, f"{model}-{width}-{how}.json")
        with open(path, "w") as f:
          json.dump(plan, f)
        extra = [f"--plan={path}", "--num_microbatches=1"] + ([f"--mesh={mesh}"] if mesh else [])
        rows[name] = launch(model, extra, os.path.join(tmp, name.replace(" ", "-")))
      for name, mesh in PIPELINES.items():
        extra = [
          "--planner=graphpipe",
          "--min_stages=2",
          f"--num_microbatches={FLAGS.microbatches}",
        ]
        extra += [f"--mesh={mesh}"] if mesh else ["--num_devices=8"]
        rows[name] = launch(model, extra, os.path.join(tmp, name.replace(" ", "-")))
    plain = rows["plain jit"].get("step_ms", float("nan"))
    for name, r in rows.items():
      if "error" in r:
        print(f"{model:6s} {name:22s} failed: {r['error']}")
        continue
      print(
        f"{model:6s} {name:22s} {r['step_ms']:8.1f} {plain / r['step_ms']:7.2f}x "
        f"{r['measured_peak'] / 2**20:9.2f} {r['predicted_peak'] / 2**20:9.2f}  {r['plan']}",
        flush=True,
      )


if __name__ == "__main__":
  app.run(main)
